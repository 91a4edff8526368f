"""Kernel scratch: bytes a kernel allocates and frees inside itself, invisible to a dispatch-level
trace. A registry (device, aten op) -> formula(args, kwargs, out) -> bytes, checked against the
allocator's own events (see benchmarks/scratch_calibration.py and tests/test_scratch.py).

The figure is what `memplan.estimate.simulate` adds on top of the live bytes once the op's outputs
are allocated: the peak of the running allocation total inside the op, minus the bytes of its
outputs (0 when the kernel needs nothing beyond them).

Three kinds of rules, all for the "cpu" device (CUDA kernels' scratch comes from the caching
allocator too, but no CUDA rule here is known well enough from source to be stated):

* Generic rules that hold for every op on the CPU: a Python number passed where the schema asks for
  a Tensor is a 0-dim "wrapped number" tensor the argument parser allocates for the call, and
  TensorIterator copies every operand whose dtype differs from the computation dtype.
* Formulas read off PyTorch's own CPU kernels (each cites its file and function).
* oneDNN: convolutions, reduced-precision matmuls and nn.LSTM run through oneDNN (ideep), whose
  reorders and scratchpad come from the same CPU allocator. Their sizes are chosen inside oneDNN by
  implementation dispatch and blocking heuristics that depend on the CPU's ISA, its cache sizes,
  the thread count and the oneDNN version, so no closed form read off PyTorch's source can state
  them. For these ops the rule asks oneDNN itself: it runs the op once on real tensors of the same
  sizes, strides and dtypes (and the current thread count) under the allocator's profiler, and
  caches the answer by that signature (`probe_scratch`).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

aten = torch.ops.aten

ScratchFormula = Callable[[tuple, dict, Any], int]
# Keys: (device, OpOverloadPacket) for a rule that holds for every overload, or (device, OpOverload)
# for one overload (looked up first).
SCRATCH_RULES: dict[tuple[str, Any], ScratchFormula] = {}
# Rules that apply to every op of a device, added to the op's own rule: (func, args, kwargs, out) -> bytes
GENERIC_RULES: dict[str, list[Callable[[Any, tuple, dict, Any], int]]] = {}


def scratch_rule(device: str, *ops: Any) -> Callable[[ScratchFormula], ScratchFormula]:
    def register(formula: ScratchFormula) -> ScratchFormula:
        for op in ops:
            SCRATCH_RULES[(device, op)] = formula
        return formula

    return register


def generic_rule(device: str) -> Callable[[Callable], Callable]:
    def register(formula: Callable) -> Callable:
        GENERIC_RULES.setdefault(device, []).append(formula)
        return formula

    return register


def scratch_of(device: str) -> Callable[[Any, tuple, dict, Any], int]:
    """The scratch formula lookup for one device, as the tracer calls it for each op."""

    def scratch(func: Any, args: tuple, kwargs: dict, out: Any) -> int:
        formula = SCRATCH_RULES.get((device, func)) or SCRATCH_RULES.get((device, func._overloadpacket))
        if formula is not None:
            return int(formula(args, kwargs, out))
        return sum(int(rule(func, args, kwargs, out)) for rule in GENERIC_RULES.get(device, ()))

    return scratch


# --------------------------------------------------------------------------------------------------
# Measuring an op's scratch on the allocator (oneDNN rules; benchmarks/scratch_calibration.py)


def allocator_events(run: Callable[[], Any]) -> tuple[list[int], Any]:
    """The CPU allocator's events (+bytes allocated, -bytes freed) while `run()` runs, in order,
    and what it returned."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, profile_memory=True) as prof:
        result = run()
    events = [
        (e.start_ns(), i, e.nbytes())
        for i, e in enumerate(prof.profiler.kineto_results.events())
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
    ]
    return [n for _, _, n in sorted(events)], result


def new_storage_bytes(out: Any, inputs: Any) -> int:
    """Bytes of the storages among `out` that no tensor of `inputs` shares: what the op allocated."""
    seen = {_storage_key(t) for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor)}
    total = 0
    for t in tree_flatten(out)[0]:
        if isinstance(t, torch.Tensor):
            key = _storage_key(t)
            if key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()
    return total


def extra_bytes(events: list[int], out_bytes: int) -> int:
    """The peak of the running total of `events` beyond `out_bytes` (the op's outputs)."""
    running = peak = 0
    for nbytes in events:
        running += nbytes
        peak = max(peak, running)
    return max(0, peak - out_bytes)


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


# Probing allocates real copies of an op's operands; beyond this many bytes the rule gives up (0).
PROBE_LIMIT_BYTES = 1 << 30
_PROBED: dict[tuple, int] = {}


def probe_scratch(func: Any, args: tuple, kwargs: dict,
                  prepare: Callable[[tuple, dict], tuple[tuple, dict]] | None = None) -> int:
    """Run `func` once on real zero-filled tensors laid out like `args` (fake or real: same sizes,
    strides, storage offsets, dtypes, and the same storage sharing between operands) and return the
    bytes it allocated beyond its outputs at its peak. Cached by that signature and the thread count.
    `prepare(real_args, real_kwargs)` may replace operands before the measured call (outside it)."""
    storages: dict[int, int] = {}  # storage key -> index among the operands' storages
    sizes: list[int] = []
    signature: list[Any] = []
    flat, _ = tree_flatten((args, kwargs))
    for value in flat:
        if isinstance(value, torch.Tensor):
            key = _storage_key(value)
            if key not in storages:
                storages[key] = len(sizes)
                sizes.append(value.untyped_storage().nbytes())
            signature.append((tuple(value.shape), value.stride(), value.storage_offset(), value.dtype,
                              str(value.device), storages[key]))
        else:
            signature.append(repr(value))
    cache_key = (str(func), tuple(signature), tuple(sizes), torch.get_num_threads(), torch.is_grad_enabled(),
                 torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled)
    if cache_key in _PROBED:
        return _PROBED[cache_key]
    if sum(sizes) > PROBE_LIMIT_BYTES or torch._C._autograd._profiler_enabled():
        warnings.warn(f"memplan: cannot measure the scratch of {func} here (operands too large or a profiler "
                      "is running); counted as 0", stacklevel=2)
        return 0
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), torch.autocast("cpu", enabled=False):
        real_storages = [torch.zeros(max(n, 1), dtype=torch.uint8).untyped_storage() for n in sizes]

        def materialize(value: Any) -> Any:
            if not isinstance(value, torch.Tensor):
                return value
            storage = real_storages[storages[_storage_key(value)]]
            real = torch.empty(0, dtype=value.dtype)
            real.set_(storage, value.storage_offset(), value.shape, value.stride())
            return real

        real_args, real_kwargs = tree_map(materialize, (args, kwargs))
        if prepare is not None:
            real_args, real_kwargs = prepare(real_args, real_kwargs)
        events, out = allocator_events(lambda: func(*real_args, **real_kwargs))
        scratch = extra_bytes(events, new_storage_bytes(out, (real_args, real_kwargs)))
        del out, real_args, real_kwargs, real_storages
    _PROBED[cache_key] = scratch
    return scratch


def _probe(func: Any) -> ScratchFormula:
    return lambda args, kwargs, out: probe_scratch(func, args, kwargs)


# --------------------------------------------------------------------------------------------------
# oneDNN-backed CPU ops


# Convolutions: at::_convolution picks a backend (aten/src/ATen/native/Convolution.cpp
# select_conv_backend): oneDNN (mkldnn/Conv.cpp _mkldnn_convolution, mkldnn_convolution_backward*,
# which reorder src, weights and dst to blocked formats and allocate the primitive's scratchpad) for
# float32/bfloat16/float16 whenever use_mkldnn() holds, else slow_conv2d's im2col buffers
# (ConvolutionMM2d.cpp), slow_conv_transpose2d's columns, or the depthwise kernels. All of them are
# measured, so the rule follows the backend PyTorch picks.
for _op in (aten.convolution.default, aten.convolution_backward.default):
    scratch_rule("cpu", _op)(_probe(_op))

# nn.LSTM/GRU on the CPU: aten/src/ATen/native/RNN.cpp lstm() takes the oneDNN path (use_mkldnn) and
# runs mkldnn_rnn_layer per layer and direction (mkldnn/RNN.cpp): the summed bias, the gate-shuffled
# weights, oneDNN's reordered weights (ldigo with padded leading dimension, or brgemm-blocked) and
# the scratchpad are freed inside; the backward converts gradients to float32 and back.
scratch_rule("cpu", aten.mkldnn_rnn_layer.default)(_probe(aten.mkldnn_rnn_layer.default))


def _real_rnn_workspace(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """mkldnn_rnn_layer_backward reads the forward's oneDNN workspace, which the meta kernel
    (torch/_meta_registrations.py mkldnn_rnn_layer) leaves empty: run the forward on the same
    operands to get a real one, so that the measured backward reads a buffer of the right size."""
    (input, w0, w1, w2, w3, hx, cx, _output, _hy, _cy, _go, _ghy, _gcy, reverse, mode, hidden_size, num_layers,
     has_biases, train, bidirectional, batch_sizes, batch_first, _workspace) = args
    with torch.enable_grad():
        workspace = aten.mkldnn_rnn_layer.default(input, w0, w1, w2, w3, hx, cx, reverse, batch_sizes, mode,
                                                  hidden_size, num_layers, has_biases, bidirectional, batch_first,
                                                  train)[3]
    return (*args[:-1], workspace), kwargs


@scratch_rule("cpu", aten.mkldnn_rnn_layer_backward.default)
def _mkldnn_rnn_layer_backward(args: tuple, kwargs: dict, out: Any) -> int:
    return probe_scratch(aten.mkldnn_rnn_layer_backward.default, args, kwargs, prepare=_real_rnn_workspace)

_REDUCED = (torch.bfloat16, torch.float16)


def _reduced_precision_matmul(func: Any) -> ScratchFormula:
    """bfloat16/float16 matmuls go to oneDNN (aten/src/ATen/native/LinearAlgebra.cpp addmm_impl_cpu_
    and bmm_out_or_baddbmm_ -> use_mkldnn_matmul -> mkldnn/Matmul.cpp mkldnn_matmul, whose ideep
    matmul allocates its scratchpad on each call); float32 goes to BLAS (MKL), whose buffers do not
    come from PyTorch's allocator."""

    def formula(args: tuple, kwargs: dict, out: Any) -> int:
        dtypes = {t.dtype for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        if not dtypes & set(_REDUCED):
            return _generic_cpu(func, args, kwargs, out)
        return probe_scratch(func, args, kwargs)

    return formula


for _op in (aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten.addbmm.default,
            aten._addmm_activation.default, aten.addmv.default, aten.mv.default):
    scratch_rule("cpu", _op)(_reduced_precision_matmul(_op))


# --------------------------------------------------------------------------------------------------
# Generic CPU rules


def _generic_cpu(func: Any, args: tuple, kwargs: dict, out: Any) -> int:
    return sum(int(rule(func, args, kwargs, out)) for rule in GENERIC_RULES.get("cpu", ()))
