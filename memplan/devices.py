"""What a target device adds to the trace: how its allocator accounts for a storage, library
workspaces, kernel scratch the dispatcher never sees, optimizer defaults and autocast op lists.

Rules are data: `DEVICES` maps a name to a `DeviceModel`; memplan/scratch.py maps (device, aten op)
to a scratch formula, like torch/utils/flop_counter.py's registry.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch._prims_common import (
    compute_elementwise_output_strides,
    make_channels_last_strides_for,
    make_contiguous_strides_for,
    suggest_memory_format,
)

from memplan.allocator import CudaCachingAllocator, ExactAllocator
from memplan.cpu_kernels import missing_cpu_kernel
from memplan.cuda_kernels import cuda_kernels
from memplan.errors import BadInput
from memplan.scratch import rnn_workspace_bytes, scratch_of
from memplan.step import StepConfig, optimizer_rule
from memplan.trace import TraceRules

aten = torch.ops.aten

# --------------------------------------------------------------------------------------------------
# Fake kernels that allocate differently from the real ones: (device, op) -> fix(args, kwargs, out) -> out

OutputFix = Callable[[tuple, dict, Any], Any]
OUTPUT_FIXES: dict[tuple[str, Any], OutputFix] = {}


def _rnn_workspace(args: tuple, kwargs: dict, out: Any) -> Any:
    """mkldnn_rnn_layer's meta kernel returns an empty workspace; the real one keeps oneDNN's
    workspace (its 4th output) alive until backward when grad mode is on."""
    if not torch.is_grad_enabled():
        return out
    workspace = out[3].new_empty((rnn_workspace_bytes(args, kwargs),), dtype=torch.uint8)
    return (*out[:3], workspace)


def _batch_norm_stats_fp32(args: tuple, kwargs: dict, out: Any) -> Any:
    """With a bf16/fp16 input and an fp32 weight, bias or running statistic (autocast, Apex O2; a
    BatchNorm without affine parameters keeps fp32 running statistics), the real CPU and CUDA kernels
    (is_mixed_type) save the batch mean and inverse std in fp32, the accumulate type; the fake kernel
    uses the input's dtype."""
    x, parameters = args[0], [t for t in args[1:5] if isinstance(t, torch.Tensor)]
    if x.dtype in (torch.float16, torch.bfloat16) and any(t.dtype == torch.float32 for t in parameters):
        return (out[0], *(t.new_empty(t.shape, dtype=torch.float32) for t in out[1:3]), *out[3:])
    return out


def _batch_norm_output_layout_cpu(args: tuple, kwargs: dict, out: Any) -> Any:
    """aten/src/ATen/native/Normalization.cpp batch_norm_cpu allocates its output
    `empty_like(self, all_contiguous ? suggest_memory_format_contig(self) : self.suggest_memory_format())`:
    row-major unless the input is channels-last, whatever its strides; the fake kernel copies the
    input's strides. PatchTST normalises a transposed (batch, d_model, patches) view: eager's output
    is row-major, so the transpose back to (batch, patches, d_model) is not, and every linear layer
    after it copies its input (matmul's contiguous copy) where under tracing it viewed (addmm):
    one activation-sized copy per projection, 1-4% of the peak. An input both row-major and
    channels-last (size-1 dimensions: UPerNet's pooled (2, 256, 1, 1) features, strided (256, 1, 256,
    256) by their convolution) comes out with row-major strides, (256, 1, 1, 1), which the upsampling,
    concatenation and 3x3 convolution after it follow: under tracing they ran channels-last and the
    convolution's oneDNN reorders were probed for that layout (+8,640,560 B at UPerNet's forward peak)."""
    out = _batch_norm_stats_fp32(args, kwargs, out)
    x = args[0]
    dense = _normalization_dense(x) and all(t is None or t.is_contiguous() for t in args[1:5])
    return (_in_layout(out[0], _normalization_layout(x, dense)), *out[1:])


def _normalization_dense(t: torch.Tensor) -> bool:
    """Normalization.cpp is_contiguous: row-major, channels-last or channels-last-3d."""
    return t.is_contiguous() or (t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last)) or (
        t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d))


def _normalization_layout(x: torch.Tensor, all_contiguous: bool) -> torch.memory_format:
    """The memory format Normalization.cpp's CPU kernels allocate in: `suggest_memory_format_contig(x)`
    where every operand is dense (row-major whenever `x.is_contiguous()`, which ignores the strides
    of size-1 dimensions, else channels-last), else `x.suggest_memory_format()` (channels-last where
    x's strides are like channels-last, size-1 dimensions included)."""
    if not all_contiguous:
        return suggest_memory_format(x)
    if x.is_contiguous():
        return torch.contiguous_format
    return torch.channels_last_3d if x.dim() == 5 else torch.channels_last


def _in_layout(t: torch.Tensor | None, layout: torch.memory_format) -> torch.Tensor | None:
    """`t`, or an empty tensor like it with the strides `empty_like(t, layout)` gives: those of size-1
    dimensions too, which decide the memory format of the ops after it."""
    if t is None or t.stride() == _layout_strides(tuple(t.shape), layout):
        return t
    return torch.empty(t.shape, dtype=t.dtype, device=t.device, memory_format=layout)


def _layout_strides(shape: tuple[int, ...], layout: torch.memory_format) -> tuple[int, ...]:
    if layout == torch.channels_last and len(shape) == 4:
        return tuple(make_channels_last_strides_for(shape))
    if layout == torch.channels_last_3d and len(shape) == 5:
        return tuple(make_channels_last_strides_for(shape))
    return tuple(make_contiguous_strides_for(shape))


for _device in ("cpu", "cuda"):
    for _op in (aten.native_batch_norm.default, aten._native_batch_norm_legit.default):
        OUTPUT_FIXES[(_device, _op)] = _batch_norm_stats_fp32 if _device == "cuda" else _batch_norm_output_layout_cpu
OUTPUT_FIXES[("cpu", aten.mkldnn_rnn_layer.default)] = _rnn_workspace


def _batch_norm_grad_layout_cpu(args: tuple, kwargs: dict, out: Any) -> Any:
    """Normalization.cpp batch_norm_backward_cpu allocates the input gradient in the memory format
    the *input* suggests (row-major unless the input is channels-last), or, where the input and the
    incoming gradient are both dense and suggest the same format, `suggest_memory_format_contig(input)`
    (row-major whenever the input is); the fake kernel copies the incoming gradient's strides. CvT's
    depthwise projection (conv, then BatchNorm, then its output flattened to tokens) gets a
    channels-last incoming gradient for a row-major input: under tracing the convolution's backward
    then read a channels-last gradient and its oneDNN scratch was probed for that layout (256 B more
    than eager's, +0.10% at CvT's bf16 backward peak)."""
    grad_out, x = args[0], args[1]
    same = _normalization_dense(x) and _normalization_dense(grad_out) and (
        suggest_memory_format(x) == suggest_memory_format(grad_out))
    return (_in_layout(out[0], _normalization_layout(x, same)), *out[1:])


OUTPUT_FIXES[("cpu", aten.native_batch_norm_backward.default)] = _batch_norm_grad_layout_cpu


def _unreduced_loss_storage(reduction_index: int) -> OutputFix:
    """mse_loss, smooth_l1_loss, soft_margin_loss and binary_cross_entropy with a reduction return a
    0-dim loss whose storage keeps the unreduced size: the real kernel allocates the result like its
    input and reduces into it (resize_ never shrinks a storage); the fake kernel allocates 4 bytes.
    The loss lives until backward ends, so the difference counts in the backward peak. (Measured on
    the CPU's allocator: tests/test_unseen_models.py.)"""

    def fix(args: tuple, kwargs: dict, out: Any) -> Any:
        reduction = args[reduction_index] if len(args) > reduction_index else kwargs.get("reduction", 1)
        if reduction == 0 or not isinstance(out, torch.Tensor):
            return out
        numel = math.prod(torch.broadcast_shapes(args[0].shape, args[1].shape))
        if numel * out.element_size() <= out.untyped_storage().nbytes():
            return out
        return out.new_empty((numel,)).as_strided(out.shape, out.stride(), 0)

    return fix


def _col2im_storage(args: tuple, kwargs: dict, out: Any) -> Any:
    """aten/src/ATen/native/Col2Im.cpp col2im_cpu: `output = at::empty_like(input)`, then resized down
    to the image: the storage keeps the columns' size (fake: the image's)."""
    columns = args[0]
    needed = columns.numel() * out.element_size()
    if needed <= out.untyped_storage().nbytes():
        return out
    return out.new_empty((columns.numel(),)).as_strided(out.shape, out.stride(), 0)


OUTPUT_FIXES[("cpu", aten.col2im.default)] = _col2im_storage


def _slow_transpose3d_storage(args: tuple, kwargs: dict, out: Any) -> Any:
    """aten/src/ATen/native/NaiveConvolutionTranspose3d.cpp slow_conv_transpose3d_cpu: `output =
    at::empty_like(input)`, then resized in place to the output's shape, so an output smaller than its
    input keeps the input's storage (fake: the output's). At::_convolution takes that kernel for an
    ungrouped transposed 3-d convolution oneDNN does not run (fp32, 1x1x1, unstrided, a batch under 16
    on one thread: MedNeXt's output head, 8 channels in, 2 out); the rule asks it which backend it takes."""
    x, weight, bias, stride, padding, dilation, transposed, output_padding, groups = args[:9]
    if not transposed or groups != 1 or weight.dim() != 5 or not isinstance(out, torch.Tensor):
        return out
    try:
        backend = torch._C._select_conv_backend(x, weight, bias, stride, padding, dilation, transposed,
                                                output_padding, groups)
    except (RuntimeError, TypeError):  # no backend to ask: the fake output as it is
        return out
    needed = x.numel() * out.element_size()
    if backend != torch._C._ConvBackend.SlowTranspose3d or needed <= out.untyped_storage().nbytes():
        return out
    return out.new_empty((x.numel(),)).as_strided(out.shape, out.stride(), 0)


OUTPUT_FIXES[("cpu", aten.convolution.default)] = _slow_transpose3d_storage


def _mixed_type_stats_fp32(params: slice) -> OutputFix:
    """aten/src/ATen/native/layer_norm.cpp layer_norm_cpu and group_norm.cpp native_group_norm: with a
    bf16/fp16 input and an fp32 weight or bias (`args[params]`; autocast keeps the norms' parameters
    fp32), `is_mixed_type` holds and the mean and rstd saved for backward are fp32
    (param_scalar_type); the fake kernels use the input's dtype."""

    def fix(args: tuple, kwargs: dict, out: Any) -> Any:
        x = args[0]
        given = [t for t in args[params] if isinstance(t, torch.Tensor)]
        if x.dtype in (torch.float16, torch.bfloat16) and given and given[0].dtype == torch.float32:
            return (out[0], *(t.new_empty_strided(t.shape, t.stride(), dtype=torch.float32) for t in out[1:3]))
        return out

    return fix


OUTPUT_FIXES[("cpu", aten.native_layer_norm.default)] = _mixed_type_stats_fp32(slice(2, 4))


def _group_norm_grad_input_dtype(args: tuple, kwargs: dict, out: Any) -> Any:
    """group_norm.cpp native_group_norm_backward allocates the input gradient like the input (its
    dtype); the fake kernel takes the saved mean's dtype, fp32 for a mixed-type forward
    (_mixed_type_stats_fp32)."""
    x, grad_input = args[1], out[0]
    if grad_input is None or grad_input.dtype == x.dtype:
        return out
    return (grad_input.new_empty_strided(grad_input.shape, grad_input.stride(), dtype=x.dtype), *out[1:])


OUTPUT_FIXES[("cpu", aten.native_group_norm.default)] = _mixed_type_stats_fp32(slice(1, 3))
OUTPUT_FIXES[("cpu", aten.native_group_norm_backward.default)] = _group_norm_grad_input_dtype


def _layer_norm_grad_contiguous(args: tuple, kwargs: dict, out: Any) -> Any:
    """aten/src/ATen/native/layer_norm.cpp layer_norm_backward_cpu allocates the input gradient
    `empty_like(X.contiguous())`: row-major whatever the incoming gradient's layout; the fake kernel
    copies the incoming gradient's strides. The layout decides whether a later `reshape` views or
    copies (a transposed gradient after a LayerNorm in a windowed attention block)."""
    grad_input = out[0]
    if grad_input is None or grad_input.is_contiguous():
        return out
    return (grad_input.new_empty(grad_input.shape), *out[1:])


OUTPUT_FIXES[("cpu", aten.native_layer_norm_backward.default)] = _layer_norm_grad_contiguous


def _grad_contiguous(args: tuple, kwargs: dict, out: Any) -> Any:
    """SoftMax.cpp log_softmax_backward_cpu_out computes into a gradient laid out like the
    contiguous copy of the incoming gradient; the fake kernel copies the incoming gradient's strides."""
    return out if out.is_contiguous() else out.new_empty(out.shape)


OUTPUT_FIXES[("cpu", aten._log_softmax_backward_data.default)] = _grad_contiguous

for _op, _index in ((aten.mse_loss.default, 2), (aten.smooth_l1_loss.default, 2), (aten.soft_margin_loss.default, 2),
                    (aten.binary_cross_entropy.default, 3)):
    OUTPUT_FIXES[("cpu", _op)] = _unreduced_loss_storage(_index)


def _iterator_layout(*positions: int) -> OutputFix:
    """The layout TensorIterator gives the output of a kernel over the operands at `positions`, in the
    kernel's order (TensorIteratorBase::reorder_dimensions: the first operand whose strides order two
    dimensions decides; torch._prims_common.compute_elementwise_output_strides mirrors it). The
    activations' backward kernels (aten/src/ATen/native/Activation.cpp and its structured metas:
    elu_backward, hardtanh_backward, softplus_backward, ...) iterate over (grad_output, input): the
    gradient's layout leads. Fake mode runs their decompositions, whose first pointwise op reads the
    input first, and gave a permuted gradient the input's layout (zuko's UNAF in bf16: the ELU's
    gradient, transposed in eager, reached the next bmm contiguous, and oneDNN's scratch parted: 32,896
    B short in backward)."""

    def fix(args: tuple, kwargs: dict, out: Any) -> Any:
        operands = [args[p] if p < len(args) else None for p in positions]
        if not isinstance(out, torch.Tensor) or out.numel() == 0 \
                or any(not isinstance(o, torch.Tensor) or o.shape != out.shape for o in operands):
            return out
        strides = tuple(compute_elementwise_output_strides(*operands))
        if strides == tuple(out.stride()):
            return out
        return out.new_empty_strided(out.shape, strides)

    return fix


for _op, _input in ((aten.elu_backward.default, 5), (aten.hardswish_backward.default, 1),
                    (aten.hardsigmoid_backward.default, 1), (aten.hardtanh_backward.default, 1),
                    (aten.softplus_backward.default, 1), (aten.logit_backward.default, 1)):
    for _device in ("cpu", "cuda"):
        OUTPUT_FIXES[(_device, _op)] = _iterator_layout(0, _input)
# leaky_relu_backward's meta builds its iterator over (self, grad_output); threshold_backward is
# threshold_out(grad_input, self, threshold, 0, grad): the input's layout leads
for _op in (aten.leaky_relu_backward.default, aten.threshold_backward.default):
    for _device in ("cpu", "cuda"):
        OUTPUT_FIXES[(_device, _op)] = _iterator_layout(1, 0)


def _contiguous_loss_grad(args: tuple, kwargs: dict, out: Any) -> Any:
    """aten/src/ATen/native/Loss.cpp mse_loss_backward, smooth_l1_loss_backward and huber_loss_backward
    allocate the input's gradient `zeros_like(input, LEGACY_CONTIGUOUS_MEMORY_FORMAT)`: row-major
    whatever the operands' layouts; the fake kernels (decompositions) follow a permuted input."""
    return out if not isinstance(out, torch.Tensor) or out.is_contiguous() else out.new_empty(out.shape)


for _op in (aten.mse_loss_backward.default, aten.smooth_l1_loss_backward.default, aten.huber_loss_backward.default):
    for _device in ("cpu", "cuda"):
        OUTPUT_FIXES[(_device, _op)] = _contiguous_loss_grad


def _weight_norm_norms_fp32(args: tuple, kwargs: dict, out: Any) -> Any:
    """aten/src/ATen/native/WeightNorm.cpp weight_norm_cpu keeps the norms it returns (and autograd
    saves) in the opmath type: float32 for a half or bfloat16 weight (`toOpMathType`); the fake kernel
    gives half weights half norms (nn.utils.weight_norm under fp16: EnCodec's convolutions)."""
    weight, norms = out
    if norms.dtype not in (torch.float16, torch.bfloat16):
        return out
    return (weight, norms.new_empty_strided(norms.shape, norms.stride(), dtype=torch.float32))


OUTPUT_FIXES[("cpu", aten._weight_norm_interface.default)] = _weight_norm_norms_fp32


def _embedding_bag_outputs_cpu(requires_grad: bool) -> OutputFix:
    """aten/src/ATen/native/EmbeddingBag.cpp _embedding_bag_cpu_impl: the real kernel sizes its three
    index outputs by resizing, and resize_ never shrinks a storage; the fake kernel allocates each at
    its final size (and takes bf16/fp16 weights off the fast path). With index type `index_t` (the
    indices' and offsets' promoted type), n indices, k offsets and `bags` bags:

    * offset2bag (make_offset2bag_out): none (0 elements) for mode sum on the fast path (float, half
      or bfloat16 weight with unit column stride, unit-stride per-sample weights, no padding_idx);
      otherwise zeroed at n + 1 elements, cumsum'd into a new n + 1 tensor and resized to n.
    * bag_size (make_bag_size): `empty(offsets.sizes())` (k elements) resized to `bags` when gradients
      are wanted (_embedding_bag) or the mode is mean or max; else it keeps the offsets' shape.
    * max_indices (make_max_indices): `empty(bag_size.sizes())`, resized to (bags, dim) for mode max."""

    def fix(args: tuple, kwargs: dict, out: Any) -> Any:
        names = ("weight", "indices", "offsets", "scale_grad_by_freq", "mode", "sparse", "per_sample_weights",
                 "include_last_offset", "padding_idx")
        bound = {"mode": 0, "per_sample_weights": None, "include_last_offset": False, "padding_idx": -1,
                 **dict(zip(names, args)), **kwargs}
        weight, indices, offsets, mode = bound["weight"], bound["indices"], bound["offsets"], bound["mode"]
        scale = bound["per_sample_weights"]
        if indices.dim() != 1 or offsets.dim() != 1 or weight.dim() != 2:
            return out
        index_dtype = torch.promote_types(indices.dtype, offsets.dtype)
        n, k = indices.size(0), offsets.size(0)
        bags = k - 1 if bound["include_last_offset"] else k
        fast = (weight.dtype in (torch.float32, torch.float16, torch.bfloat16) and weight.stride(1) == 1
                and bound["padding_idx"] < 0 and (scale is None or scale.stride(0) == 1))

        def index_tensor(shape: tuple[int, ...], numel: int) -> torch.Tensor:
            storage = out[0].new_empty((max(numel, math.prod(shape)),), dtype=index_dtype)
            return storage.as_strided(shape, make_contiguous_strides_for(shape), 0)

        offset2bag = index_tensor((0,), 0) if mode == 0 and fast else index_tensor((n,), n + 1)
        bag_size = index_tensor((bags,) if requires_grad or mode != 0 else (k,), k)
        if mode == 2:
            max_indices = index_tensor((bags, weight.size(1)), bag_size.numel())
        else:
            max_indices = index_tensor(tuple(bag_size.shape), bag_size.numel())
        return (out[0], offset2bag, bag_size, max_indices)

    return fix


OUTPUT_FIXES[("cpu", aten._embedding_bag.default)] = _embedding_bag_outputs_cpu(requires_grad=True)
OUTPUT_FIXES[("cpu", aten._embedding_bag_forward_only.default)] = _embedding_bag_outputs_cpu(requires_grad=False)


def output_fixes(device: str) -> Callable[[Any, tuple, dict, Any], Any]:
    def fix(func: Any, args: tuple, kwargs: dict, out: Any) -> Any:
        rule = OUTPUT_FIXES.get((device, func))
        return rule(args, kwargs, out) if rule else out

    return fix


@contextlib.contextmanager
def host_rng_state() -> Iterator[None]:
    """torch.utils.checkpoint keeps `torch.get_rng_state()` per segment from forward to recomputation:
    a 5,056-byte CPU tensor made outside the dispatcher. On the CPU target that is device memory, so
    while tracing it becomes a traced allocation of the same size (and restoring it, a no-op)."""
    get_state, set_state = torch.get_rng_state, torch.set_rng_state
    size = get_state().numel()
    torch.get_rng_state = lambda: torch.empty(size, dtype=torch.uint8)
    torch.set_rng_state = lambda state: None
    try:
        yield
    finally:
        torch.get_rng_state, torch.set_rng_state = get_state, set_state


# --------------------------------------------------------------------------------------------------
# Allocators


def exact_bytes(nbytes: int) -> int:
    """The CPU allocator's events report the bytes asked for."""
    return nbytes


CUDA_BLOCK = 512  # CUDACachingAllocator: kMinBlockSize; every request rounds up to a multiple of it


def cuda_block_bytes(nbytes: int) -> int:
    """What one storage adds to `max_memory_allocated`: rounded up to 512 bytes (0 stays 0)."""
    return 0 if nbytes == 0 else CUDA_BLOCK * math.ceil(nbytes / CUDA_BLOCK)


def cublas_workspace_bytes(compute_capability: tuple[int, int]) -> int:
    """torch's default cuBLAS workspace per (handle, stream), from ATen/cuda/CublasHandlePool.cpp
    parseChosenWorkspaceSize(): 32 MiB on Hopper and Blackwell (major 9, 10, 12), else ":4096:2:16:8"."""
    if compute_capability[0] in (9, 10, 12):
        return 4096 * 8 * 1024
    return 4096 * 1024 * 2 + 16 * 1024 * 8


# Ops that call cuBLAS and so allocate the calling thread's workspace the first time.
CUBLAS_OPS = frozenset(
    f"aten.{name}.default" for name in ("mm", "addmm", "bmm", "baddbmm", "addmv", "mv", "addbmm", "_addmm_activation")
) | frozenset({"aten.addmm.out", "aten.mm.out"})


@dataclass(frozen=True)
class DeviceModel:
    name: str
    description: str
    block_bytes: Callable[[int], int]
    scratch: Callable[[Any, tuple, dict, Any], int]
    # cuBLAS keeps one workspace per thread that calls it: the main thread (forward, optimizer) and
    # the autograd engine's device thread (backward)
    workspace_bytes: int = 0
    workspace_ops: frozenset[str] = frozenset()
    foreach_optimizers: bool = False  # torch's optimizer default: foreach on CUDA, for-loop on the CPU
    autocast_lists: str | None = None  # "cuda": emulate CUDA's autocast op lists on fake CPU tensors
    function_mode: Callable[[], Any] | None = None  # a context for device kernel choices made in Python
    missing_kernel: Callable[[Any, tuple, dict], str | None] | None = None  # see TraceRules.missing_kernel
    # allocator(baseline storage id -> bytes): the allocator model, with the baseline already live
    allocator: Callable[[dict[int, int]], Any] = ExactAllocator.from_live

    def trace_rules(self, config: StepConfig) -> TraceRules:
        foreach = None
        if self.foreach_optimizers and not optimizer_rule(config.optimizer).needs_cuda:
            foreach = True
        autocast = None
        if self.autocast_lists:
            from memplan.autocast import emulated_autocast

            autocast = emulated_autocast(self.autocast_lists)
        extra = {"function_mode": self.function_mode} if self.function_mode else {}
        if self.missing_kernel:
            extra["missing_kernel"] = self.missing_kernel
        return TraceRules(
            scratch=self.scratch, foreach=foreach, autocast=autocast, fix_outputs=output_fixes(self.name), **extra
        )


DEFAULT_COMPUTE_CAPABILITY = (9, 0)  # an H100/H200 unless --gpu says otherwise


def cuda_model(compute_capability: tuple[int, int] = DEFAULT_COMPUTE_CAPABILITY) -> DeviceModel:
    return DeviceModel(
        name="cuda",
        description=f"CUDA caching allocator, compute capability {compute_capability[0]}.{compute_capability[1]}",
        block_bytes=cuda_block_bytes,
        scratch=scratch_of("cuda"),
        workspace_bytes=cublas_workspace_bytes(compute_capability),
        workspace_ops=CUBLAS_OPS,
        foreach_optimizers=True,
        autocast_lists="cuda",
        allocator=CudaCachingAllocator.from_live,
        function_mode=cuda_kernels,
    )


DEVICES: dict[str, Callable[[], DeviceModel]] = {
    "cpu": lambda: DeviceModel(
        "cpu", "CPU allocator (exact request sizes)", exact_bytes, scratch_of("cpu"), function_mode=host_rng_state,
        missing_kernel=missing_cpu_kernel,
    ),
    "cuda": cuda_model,
}


def device_model(name: str, gpu: str | None = None) -> DeviceModel:
    """The rules of device `name`; for CUDA, `gpu` (a memplan.gpus name) sets the compute capability."""
    if name not in DEVICES:
        raise BadInput(f"unknown device {name!r}; expected one of: {', '.join(DEVICES)}")
    if gpu is not None:
        if name != "cuda":
            raise BadInput(f"--gpu describes a CUDA GPU; it cannot be used with --device {name}")
        from memplan.gpus import gpu_spec

        return cuda_model(gpu_spec(gpu).compute_capability)
    return DEVICES[name]()
