"""CUDA's choice of kernels where it differs from the CPU's, on fake CPU tensors.

Attention. On the CPU, `scaled_dot_product_attention` with dropout falls back to the math path, which
materialises the attention matrix; on a CUDA GPU the fused kernels handle dropout and never do.
So when tracing for CUDA, SDPA goes to the kernel CUDA would pick (torch's
sdp_utils priority: flash attention, then memory-efficient attention, then math): flash for
fp16/bf16 without an explicit mask and head dim <= 256, memory-efficient otherwise (fp32, masks).
Flash takes grouped-query attention's fewer key/value heads as they are (`enable_gqa=True`); for the
memory-efficient kernel each is repeated for its group, an upper bound (its meta backward takes no groups).
On Hopper and Blackwell with a recent cuDNN, torch prefers cuDNN's attention, which keeps what flash
keeps (the output and one float per row); its workspace is not modelled.
Both have meta kernels, so they run under fake tensors with their real saved tensors (output and
log-sum-exp, not the attention matrix).

Dropout. `aten::dropout` (aten/src/ATen/native/Dropout.cpp) runs the fused `native_dropout` when
`is_fused_kernel_acceptable`: a CUDA tensor, training, 0 < p < 1, not empty. It saves a bool mask,
one byte an element. The CPU takes the composite path instead (`bernoulli_` into a noise tensor of the
input's dtype, 4 bytes an element in fp32), and so does the in-place form on either device.

RMSNorm. `rms_norm` (aten/src/ATen/native/layer_norm.cpp) calls `_fused_rms_norm`, which has a CUDA
kernel and an autograd formula that keeps the input and rstd, one float per row. A CPU build has no
kernel for it, so it decomposes there into pow, mean, rsqrt and two products, and keeps the normalized
input as well: one more tensor the size of the input. While tracing for CUDA, memplan registers CPU
kernels for `_fused_rms_norm` and its backward that only allocate what CUDA's return, so autograd
keeps what it keeps on CUDA and the trace names the ops CUDA runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

aten = torch.ops.aten
FLASH_DTYPES = (torch.float16, torch.bfloat16)
FLASH_MAX_HEAD_DIM = 256


def _cuda_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    if torch.is_autocast_enabled("cpu"):  # the emulated CUDA autocast: SDPA is on the lower-precision list
        dtype = torch.get_autocast_dtype("cpu")
        query, key, value = (t.to(dtype) if t.is_floating_point() else t for t in (query, key, value))
    with torch.autocast("cpu", enabled=False):
        if query.dtype in FLASH_DTYPES and attn_mask is None and query.size(-1) <= FLASH_MAX_HEAD_DIM:
            # grouped-query attention's fewer key/value heads as they are: flash takes them (sdp_utils.cpp)
            return aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, False, scale=scale)[0]
        if enable_gqa and key.size(-3) != query.size(-3):
            # each key/value head repeated for its group of query heads, an upper bound: the
            # memory-efficient kernel takes them grouped too, but its meta backward does not
            repeat = query.size(-3) // key.size(-3)
            key, value = key.repeat_interleave(repeat, -3), value.repeat_interleave(repeat, -3)
        needs_lse = query.requires_grad or key.requires_grad or value.requires_grad
        return aten._scaled_dot_product_efficient_attention(
            query, key, value, attn_mask, needs_lse, dropout_p, is_causal, scale=scale
        )[0]


_cpu_dropout = F.dropout


def _cuda_dropout(input, p=0.5, training=True, inplace=False):
    if training and not inplace and 0 < p < 1 and input.numel() > 0:
        return aten.native_dropout(input, p, True)[0]
    return _cpu_dropout(input, p, training, inplace)


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _fused_rms_norm(input, normalized_shape, weight=None, eps=None):
    """The output, contiguous, and rstd over the leading dimensions (layer_norm_kernel.cu)."""
    dims = len(normalized_shape)
    rstd_shape = (*input.shape[: input.dim() - dims], *(1 for _ in range(dims)))
    return input.new_empty(input.shape), input.new_empty(rstd_shape, dtype=_accumulation_dtype(input.dtype))


def _fused_rms_norm_backward(grad_out, input, normalized_shape, rstd, weight, output_mask):
    grad_input = input.new_empty(input.shape) if output_mask[0] else None
    grad_weight = weight.new_empty(weight.shape) if output_mask[1] and weight is not None else None
    return grad_input, grad_weight


@contextlib.contextmanager
def cuda_kernels() -> Iterator[None]:
    """Route `torch.nn.functional.scaled_dot_product_attention` and `dropout` (which nn.Dropout calls)
    to CUDA's kernel choices while tracing, and give `_fused_rms_norm` the kernels a CPU build lacks
    (only fake tensors may run while this is active: the kernels allocate but do not compute).

    The function is swapped on the module rather than intercepted by a TorchFunctionMode: a mode is
    switched off while its own handler runs, and `Tensor.backward` passes through that handler, so
    the recomputation of checkpointed segments in backward would miss it. Code that bound the
    functions to other names before tracing keeps the CPU's choice."""
    originals = F.scaled_dot_product_attention, F.dropout
    F.scaled_dot_product_attention, F.dropout = _cuda_sdpa, _cuda_dropout
    kernels = torch.library.Library("aten", "IMPL")
    try:
        kernels.impl("_fused_rms_norm", _fused_rms_norm, "CPU")
        kernels.impl("_fused_rms_norm_backward", _fused_rms_norm_backward, "CPU")
        yield
    finally:
        kernels._destroy()
        F.scaled_dot_product_attention, F.dropout = originals
