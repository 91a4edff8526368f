"""Which dtypes the CPU build's kernels take, asked of the kernels themselves.

A fake kernel checks shapes, not whether the real kernel was built for a dtype: many CPU kernels have
no bfloat16, float16 or complex version (`avg_pool3d`, `cdist`, `multi_margin_loss`, antialiased
`interpolate`, fp16 `rrelu`, the gradient scaler's unscale of complex gradients, MKL's FFT of bf16 and
fp16 signals, `exp` of ComplexHalf), so a trace under fake tensors runs a step that eager's CPU
refuses. Before an op first runs on such a dtype, the tracer asks the kernel: it runs once on small
real tensors of the same dtypes (zeros, every dimension cut to at most PROBE_EDGE unless all of them
are small; the output sized by the meta kernel first, so no probe allocates much), and eager's own
refusal, "... not implemented for 'BFloat16'" or a check that names the dtype, becomes the trace's. Any
other error of the probe (a shape the cut made invalid, a value check on zeros) says nothing about the
dtype and is ignored. The answer is a property of the torch build, kept per op and dtypes.
Views are never asked (they run no kernel), nor are ops handed state another kernel made (an RNN
layer's workspace) or an integer equal to a dimension the cut would change (an RNN's hidden size: the
two would disagree where no meta kernel checks, and oneDNN aborts the process on such arguments).
Backward ops are asked too: some kernels have a dtype only in forward (pdist's of an empty batch). An
empty tensor is asked apart from a full one, since kernels often return on one before their dtype
dispatch (bf16 `det` of a 0 x 0 matrix runs, of a 2 x 2 one is refused).
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map

PROBED_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.complex32, torch.complex64, torch.complex128})
PROBE_EDGE = 8  # the longest dimension a probe cuts a large tensor's to
SMALL_BYTES = 64 << 10  # tensors this small together are probed at their own shapes
OUTPUT_LIMIT = 8 << 20  # a probe whose outputs would take more is not run
# eager's refusal of the dtypes: a kernel not built for them, or a check that names one of them ("Expected
# both inputs to be Half, Float or Double tensors but got BFloat16 and BFloat16": torch.complex, polar;
# "MKL FFT doesn't support tensors of type: BFloat16": torch.stft, whose `_fft_r2c` skips the dtype check
# `torch.fft.rfft` makes first; "... same type as tensor for argument #1 'per_sample_weights'; but type
# CPUBFloat16Type does not equal torch.FloatTensor": embedding_bag's weights beside float32 sample weights)
REFUSAL = re.compile(r"not implemented for '\w+'"
                     r"|(?:\b|CPU)(BFloat16|Half|ComplexHalf|ComplexFloat|ComplexDouble)(?:\b|Type)")

_answers: dict[tuple, str | None] = {}


def missing_cpu_kernel(func: Any, args: tuple, kwargs: dict) -> str | None:
    """Eager's error where the CPU kernel of aten op `func` does not take these tensors' dtypes, else None."""
    tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    if (func.namespace != "aten" or func.is_view or _takes_state(func) or not any(t.dtype in PROBED_DTYPES for t in tensors)
            or any(t.layout is not torch.strided or t.device.type != "cpu" for t in tensors)):
        return None
    key = (func, tuple((t.dtype, t.dim(), t.numel() == 0) for t in tensors))
    if key not in _answers:
        _answers[key] = _probe(func, args, kwargs, tensors)
    return _answers[key]


def _takes_state(func: Any) -> bool:
    """An argument made by another kernel for this one (an RNN layer's oneDNN workspace): zeros stand in
    for no such thing, and oneDNN aborts the process on them."""
    return any(a.name in ("workspace", "reserve") for a in func._schema.arguments)


def _probe(func: Any, args: tuple, kwargs: dict, tensors: list[torch.Tensor]) -> str | None:
    small = sum(t.numel() * t.element_size() for t in tensors) <= SMALL_BYTES
    shapes = {id(t): tuple(t.shape) if small else tuple(min(s, PROBE_EDGE) for s in t.shape) for t in tensors}
    cut = set() if small else {s for t in tensors for s in t.shape if s > PROBE_EDGE}
    numbers = {x for x in tree_flatten((args, kwargs))[0] if isinstance(x, int) and not isinstance(x, bool)}
    if cut & numbers:  # an integer tied to a dimension cut (an RNN's hidden size): the cut would part them
        return None

    def standing_in(device: str) -> tuple[tuple, dict]:
        return tree_map(lambda x: torch.zeros(shapes[id(x)], dtype=x.dtype, device=device)
                        if isinstance(x, torch.Tensor) else x, (args, kwargs))

    with _disable_current_modes(), torch._C.DisableTorchFunction():
        try:
            meta_args, meta_kwargs = standing_in("meta")
            outputs = [t for t in tree_flatten(func(*meta_args, **meta_kwargs))[0] if isinstance(t, torch.Tensor)]
        except Exception:  # noqa: BLE001 - no meta kernel, or a shape the cut made invalid: nothing learnt
            return None
        if sum(math.prod(t.shape) * t.element_size() for t in outputs) > OUTPUT_LIMIT:
            return None
        with torch.random.fork_rng(devices=[]):  # a random op's probe draws nothing from the step's stream
            try:
                cpu_args, cpu_kwargs = standing_in("cpu")
                func(*cpu_args, **cpu_kwargs)
            except (RuntimeError, NotImplementedError) as error:
                message = str(error).splitlines()[0] if str(error) else ""
                return message if REFUSAL.search(message) else None
    return None
