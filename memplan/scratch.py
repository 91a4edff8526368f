"""Kernel scratch: bytes a kernel allocates and frees inside itself, invisible to a dispatch-level
trace. A registry (device, aten op) -> formula(args, kwargs, out) -> bytes, checked against the
allocator's own events (benchmarks/scratch_calibration.py, tests/test_scratch.py).

The figure is what `memplan.estimate.simulate` adds on top of the live bytes once the op's outputs
are allocated: the peak of the running allocation total inside the op, minus the bytes of its
outputs (0 when the kernel needs nothing beyond them). Formulas get the operands and outputs as the
tracer has them (fake tensors) and may read `torch.get_num_threads()`.

Rules for the "cpu" device, of three kinds:

* Generic, for every op: a Python number passed where the schema asks for a Tensor is a 0-dim
  "wrapped number" tensor (8 bytes) that lives for the call, and TensorIterator copies each operand
  whose dtype differs from the computation dtype (pointwise ops).
* Formulas read off PyTorch's own CPU kernels (each cites its file and function): reductions,
  batch norm, layer norm backward, flash attention, softmax, embedding backward, upsampling, dropout,
  foreach ops, float32 matmuls' clones of layouts BLAS cannot read, sorting and selection,
  scatter/gather, logsumexp, binary cross-entropy with logits, FFTs (MKL). Ops still without a rule
  are listed by `benchmarks/scratch_calibration.py sweep:opinfo` (PyTorch's OpInfo samples).
* oneDNN: convolutions, bf16/fp16 matmuls and nn.LSTM run through oneDNN (ideep), whose reorders and
  scratchpad come from the same CPU allocator. Their sizes are chosen inside oneDNN by implementation
  dispatch and blocking heuristics that depend on the CPU's ISA and cache sizes, the thread count and
  the oneDNN version (e.g. src/cpu/x64/matmul/brgemm_matmul_utils.cpp), so no closed form read off
  PyTorch's source states them. For these ops the rule asks oneDNN itself: it runs the op once on
  real zero-filled tensors laid out like the traced ones (sizes, strides, dtypes, storage sharing),
  at the current thread count, under the allocator's profiler, and caches the figure by that
  signature (`probe_scratch`; operands beyond PROBE_LIMIT_BYTES are not probed).

For "cuda" only what the source states for certain is here (a reduction's input copy); cuDNN and
cuBLAS-Lt workspaces are chosen at run time and are left to the device model.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch._prims_common import make_contiguous_strides_for, suggest_memory_format
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map

from memplan.cpu_profiler import quiet_stderr

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


_MEASURED = "memplan.scratch.measured"


@dataclass(frozen=True)
class Measurement:
    events: tuple[int, ...]  # the allocator's events inside the call, in order (+allocated, -freed)
    out_bytes: int  # bytes of the storages it returned that none of its operands shares
    extra: int  # peak of the running total of `events` beyond `out_bytes`: the call's scratch


def measure(call: Callable[[Any], Any], setup: Callable[[], Any] = lambda: None) -> Measurement:
    """Run `call(setup())` under the CPU allocator's profiler and read its events.

    Everything is allocated and freed inside one profiler session: the operands by `setup()`, before
    the measured call; the result after it. (c10/core/CPUAllocator.cpp ProfiledCPUMemoryReporter keeps
    the size of each block allocated while profiling until that block is freed while profiling: a
    block allocated in a session and freed outside it leaves a stale entry that a later session
    reports, against an unrelated block at the same address, as a free of that size.)"""
    from torch._C._profiler import _EventType

    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
    with quiet_stderr():
        prof.__enter__()
    try:
        state = [setup()]
        with torch.profiler.record_function(_MEASURED):
            result = [call(state[0])]
        out_bytes = new_storage_bytes(result, state)
        state.clear()
        result.clear()
    finally:
        with quiet_stderr():
            prof.__exit__(None, None, None)

    def allocations(node: Any) -> list[tuple[int, int, int]]:
        found, stack = [], [node]
        while stack:
            child = stack.pop()
            if child.typed[0] == _EventType.Allocation:
                found.append((child.start_time_ns, len(found), child.typed[1].alloc_size))
            stack.extend(child.children)
        return found

    def find(nodes: list) -> Any:
        for node in nodes:
            if node.name == _MEASURED:
                return node
            hit = find(node.children)
            if hit is not None:
                return hit
        return None

    node = find(prof.profiler.kineto_results.experimental_event_tree())
    events = tuple(n for _, _, n in sorted(allocations(node))) if node is not None else ()
    return Measurement(events, out_bytes, extra_bytes(list(events), out_bytes))


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
# Mapped bytes glibc keeps above the top of its heap (mallopt M_TOP_PAD) once a probe has run. oneDNN's
# bf16 conv3d backward over a gradient laid out (N, D, C, H, W) (the gradient of a permute: diffusers'
# UNet3DConditionModel temporal convolutions) reads a few bytes past the end of a buffer it allocates
# itself; a probe's fresh allocations put that buffer at the top of the heap, where the read hits an
# unmapped page: the estimate died with a segfault in most runs (eager's step, whose buffers lie
# elsewhere, rarely). Kept headroom, the read lands in the heap's own free space.
HEAP_TOP_PAD_BYTES = 1 << 20
_M_TOP_PAD = -2  # glibc malloc.h


@functools.cache  # once per process
def _pad_heap_top() -> None:
    try:
        mallopt = ctypes.CDLL(None).mallopt  # glibc (and musl); absent elsewhere (macOS): nothing to do
    except (OSError, AttributeError):
        return
    mallopt(_M_TOP_PAD, HEAP_TOP_PAD_BYTES)


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
    _pad_heap_top()

    def setup() -> tuple[tuple, dict]:
        real_storages = [torch.zeros(max(n, 1), dtype=torch.uint8).untyped_storage() for n in sizes]

        def materialize(value: Any) -> Any:
            if not isinstance(value, torch.Tensor):
                return value
            real = torch.empty(0, dtype=value.dtype)
            real.set_(real_storages[storages[_storage_key(value)]], value.storage_offset(), value.shape,
                      value.stride())
            return real

        real_args, real_kwargs = tree_map(materialize, (args, kwargs))
        return prepare(real_args, real_kwargs) if prepare is not None else (real_args, real_kwargs)

    try:
        with _disable_current_modes(), torch.autocast("cpu", enabled=False):
            scratch = measure(lambda operands: func(*operands[0], **operands[1]), setup).extra
    except Exception as error:  # noqa: BLE001 - an op refusing zero-filled operands: no figure, not no trace
        warnings.warn(f"memplan: measuring the scratch of {func} failed ({error}); counted as 0", stacklevel=2)
        scratch = 0
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

# Losses that reduce into an output allocated like their input (the unreduced loss, reduced into the
# result: memplan.devices._unreduced_loss_storage), through a reduction that may upcast a bf16/fp16
# copy: the temporaries differ by reduction and dtype, so they are measured. Their backward kernels
# (soft_margin_loss_backward allocates and frees two input-sized temporaries) likewise.
for _op in (aten.mse_loss.default, aten.smooth_l1_loss.default, aten.soft_margin_loss.default,
            aten.binary_cross_entropy.default, aten.huber_loss.default, aten.soft_margin_loss_backward.default,
            aten.binary_cross_entropy_backward.default):
    scratch_rule("cpu", _op)(_probe(_op))

# F.unfold / F.fold (im2col, col2im: aten/src/ATen/native/Im2Col.cpp, Col2Im.cpp copy their input to a
# contiguous or resized buffer first), F.affine_grid's base grid, nn.Bilinear's _trilinear
# (Linear.cpp: sum-products through permuted, expanded copies of its operands), torch.cdist's
# matrix-product path for p=2 (Distance.cpp _euclidean_dist: squared norms, two padded copies of the
# operands through `cat`, their product), antialiased interpolation's weights and its separable passes'
# intermediate (UpSampleKernel.cpp), and mvlgamma's `arange(...).add(self.unsqueeze(-1))` (UnaryOps.cpp):
# measured.
for _op in (aten.im2col.default, aten.col2im.default, aten.affine_grid_generator.default, aten._trilinear.default,
            aten._euclidean_dist.default, aten._upsample_bilinear2d_aa.default, aten._upsample_bicubic2d_aa.default,
            aten._upsample_bilinear2d_aa_backward.default, aten._upsample_bicubic2d_aa_backward.default,
            aten.mvlgamma.default):
    scratch_rule("cpu", _op)(_probe(_op))

# torch.linalg.lstsq (BatchLinearAlgebra.cpp linalg_lstsq_out_info): a column-major copy of A and LAPACK's
# workspace, sized by its query, beside the outputs: measured, on zero-filled systems (the sizes do not
# depend on the values).
scratch_rule("cpu", aten.linalg_lstsq.default)(_probe(aten.linalg_lstsq.default))


@scratch_rule("cpu", aten.unfold_backward.default)
def _unfold_backward(args: tuple, kwargs: dict, out: Any) -> int:
    """aten/src/ATen/native/UnfoldBackward.cpp: overlapping windows (step < size, torch.istft's overlap-add)
    are summed through an int64 index over the positions the windows cover; apart, they are copied in."""
    _, input_sizes, dim, size, step = args[:5]
    if step >= size or not input_sizes:  # apart, or a 0-dim input's single window
        return 0
    windows = (input_sizes[dim] - size) // step + 1
    return 8 * ((windows - 1) * step + size)


def _probe_unless_contiguous(func: Any) -> ScratchFormula:
    """Pooling kernels, forward and backward (aten/src/ATen/native/cpu/MaxPoolKernel.cpp,
    AvgPoolKernel.cpp, AdaptiveMaxPoolKernel.cpp), pixel and channel shuffles and the reflection and
    replication pads take `.contiguous(memory_format)` copies of a gradient or input laid out otherwise
    (max_pool1d over a transposed sequence, MViT's pooling of a transposed attention head): row-major
    operands need nothing beyond the output; any other layout is measured."""

    def formula(args: tuple, kwargs: dict, out: Any) -> int:
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        # strides exactly row-major (is_contiguous() ignores size-1 dimensions; the kernels' memory
        # format choice, suggest_memory_format, does not)
        if all(t.stride() == make_contiguous_strides_for(t.shape) for t in tensors):
            return _generic_cpu(func, args, kwargs, out)
        return probe_scratch(func, args, kwargs)

    return formula


for _op in (aten.max_pool2d_with_indices.default, aten.max_pool2d_with_indices_backward.default,
            aten.avg_pool2d.default, aten.avg_pool2d_backward.default,
            aten.adaptive_max_pool2d.default, aten.adaptive_max_pool2d_backward.default,
            aten._adaptive_avg_pool2d.default, aten._adaptive_avg_pool2d_backward.default,
            aten.max_pool3d_with_indices.default, aten.max_pool3d_with_indices_backward.default,
            aten.avg_pool3d.default, aten.avg_pool3d_backward.default,
            aten.adaptive_max_pool3d.default, aten.adaptive_max_pool3d_backward.default,
            aten._adaptive_avg_pool3d.default, aten._adaptive_avg_pool3d_backward.default,
            aten.pixel_shuffle.default, aten.pixel_unshuffle.default, aten.channel_shuffle.default,
            aten.reflection_pad1d.default, aten.reflection_pad2d.default, aten.reflection_pad3d.default,
            aten.reflection_pad1d_backward.default, aten.reflection_pad2d_backward.default,
            aten.reflection_pad3d_backward.default,
            aten.replication_pad1d.default, aten.replication_pad2d.default, aten.replication_pad3d.default,
            aten.replication_pad1d_backward.default, aten.replication_pad2d_backward.default,
            aten.replication_pad3d_backward.default):
    scratch_rule("cpu", _op)(_probe_unless_contiguous(_op))

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
    come from PyTorch's allocator, through a contiguous clone of each matrix whose layout BLAS cannot
    take (_blas_clones)."""

    def formula(args: tuple, kwargs: dict, out: Any) -> int:
        dtypes = {t.dtype for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        if not dtypes & set(_REDUCED):
            return _generic_cpu(func, args, kwargs, out) + _blas_clones(func, args, out) + _conj_resolutions(func, args, out)
        return probe_scratch(func, args, kwargs)

    return formula


def _blas_ready(matrix: torch.Tensor) -> bool:
    """LinearAlgebra.cpp addmm_impl_cpu_: a matrix BLAS takes as it is, row- or column-major with a
    leading dimension at least its width (or height)."""
    rows, cols = matrix.shape
    row_stride, col_stride = matrix.stride()
    return (col_stride == 1 and row_stride >= max(1, cols)) or (row_stride == 1 and col_stride >= max(1, rows))


def _batch_items_ready(batch: torch.Tensor) -> bool:
    """LinearAlgebra.cpp batch_items_contiguous_or_transposed (a size-1 dimension's stride is free)."""
    _, rows, cols = batch.shape
    _, row_stride, col_stride = batch.stride()
    return (col_stride == 1 and (rows == 1 or row_stride >= cols)) or (row_stride == 1 and (cols == 1 or col_stride >= rows))


def _clone_bytes(matrices: tuple[torch.Tensor, ...]) -> int:
    return sum(m.numel() * _itemsize(m.dtype) for m in matrices if not _blas_ready(m))


# The matrices (argument positions) each matmul hands BLAS, and whether they are batches of them
_BLAS_OPERANDS: dict[Any, tuple[tuple[int, ...], bool]] = {
    aten.mm.default: ((0, 1), False), aten.addmm.default: ((1, 2), False),
    aten._addmm_activation.default: ((1, 2), False), aten.mv.default: ((0,), False),
    aten.addmv.default: ((1,), False), aten.bmm.default: ((0, 1), True), aten.baddbmm.default: ((1, 2), True),
    aten.mm.out: ((0, 1), False), aten.bmm.out: ((0, 1), True),  # _grouped_mm's calls, one per group
}


def _blas_clones(func: Any, args: tuple, out: Any) -> int:
    """Bytes of the contiguous clones addmm_impl_cpu_ (addmv_impl_cpu for mv) takes of the matrices BLAS
    cannot read as they are (an expanded gradient, a strided slice). A batch is cloned item by item
    (one at a time), where an item is neither contiguous nor transposed and the product is not so
    small that a plain loop runs it (contraction * rows * cols < 400). addbmm is not modelled."""
    positions, batched = _BLAS_OPERANDS.get(func, ((), False))
    matrices = [args[p] for p in positions]
    if not matrices or out.numel() == 0 or any(m.numel() == 0 for m in matrices):
        return 0
    if batched:
        first, second = matrices
        if first.shape[1] * first.shape[2] * second.shape[2] < 400 or all(map(_batch_items_ready, matrices)):
            return 0
        matrices = [m[0] for m in matrices]
    return _clone_bytes(tuple(matrices))


def _conj_resolutions(func: Any, args: tuple, out: Any) -> int:
    """Bytes of the copies addmm_impl_cpu_ makes of complex matrices that carry the conjugate bit (a
    complex matmul's backward: `grad.mm(mat2.t().conj())`): BLAS conjugates only a matrix it reads
    transposed, so one laid out as the result is (`a = m1.resolve_conj()`, the first branch of each
    operand's cast) is conjugated into a copy, freed when the product returns (an LRU's complex input
    projection: 4,096 B short in backward). Two-dimensional products only."""
    positions, batched = _BLAS_OPERANDS.get(func, ((), False))
    if batched or len(positions) != 2 or not isinstance(out, torch.Tensor) or out.dim() != 2:
        return 0
    first, second = (args[p] for p in positions)
    if not (first.is_conj() or second.is_conj()):
        return 0
    (rows, cols), (row_stride, col_stride) = out.shape, out.stride()
    transposed = not (row_stride == 1 and (cols == 1 or col_stride >= max(1, rows))) \
        and col_stride == 1 and (rows == 1 or row_stride >= max(1, cols))
    if transposed:
        first, second = second, first
    m = cols if transposed else rows
    k = first.shape[0 if transposed else 1]
    return sum(matrix.numel() * _itemsize(matrix.dtype) for matrix, lead in ((first, m), (second, k))
               if matrix.is_conj() and matrix.stride(1 if transposed else 0) == 1
               and matrix.stride(0 if transposed else 1) >= max(1, lead))


for _op in (aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten.addbmm.default,
            aten._addmm_activation.default, aten.addmv.default, aten.mv.default):
    scratch_rule("cpu", _op)(_reduced_precision_matmul(_op))


def _mm_out_scratch(first: torch.Tensor, second: torch.Tensor, out: torch.Tensor) -> int:
    """One at::mm_out (or bmm_out, for batches) into `out`."""
    func = aten.bmm.out if first.dim() == 3 else aten.mm.out
    return _reduced_precision_matmul(func)((first, second), {"out": out}, out)


def _group_operands(mat_a: torch.Tensor, mat_b: torch.Tensor, out: torch.Tensor, group: int, start: int,
                    end: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One group's (first, second, out) in _grouped_mm_fallback, whose group spans [start, end) of the
    tokens: (tokens, k) x (groups, k, n); (groups, m, k) x (k, tokens); or (m, tokens) x (tokens, n),
    the weights' gradient, one matrix per group."""
    if mat_b.dim() == 3:
        return mat_a[start:end], mat_b[group], out[start:end]
    if mat_a.dim() == 3:
        return mat_a[group], mat_b[:, start:end], out[:, start:end]
    return mat_a[:, start:end], mat_b[start:end], out[group]


@scratch_rule("cpu", aten._grouped_mm.default)
def _grouped_mm(args: tuple, kwargs: dict, out: Any) -> int:
    """aten/src/ATen/native/GroupedMMUtils.h _grouped_mm_fallback, the CPU kernel: one at::mm_out per
    group, from its slice of the operands into its slice of the output, each freeing its scratch
    before the next (oneDNN's for bf16/fp16: mixture-of-experts layers in bf16); both operands 3-d,
    one bmm_out. The groups end at the values of `offs`, which the tracer hands this rule as a real
    tensor where it knows them (memplan.trace._SCRATCH_READS_VALUES); unknown, every group is bounded
    by one holding all the rows (and the estimate says approximate)."""
    mat_a, mat_b = args[:2]
    offs = args[2] if len(args) > 2 else kwargs.get("offs")
    if offs is None:
        return _mm_out_scratch(mat_a, mat_b, out)
    if isinstance(offs, FakeTensor):
        extent = mat_a.shape[0] if mat_b.dim() == 3 else mat_b.shape[1] if mat_a.dim() == 3 else mat_b.shape[0]
        bounds = [(0, extent)] * offs.shape[0]
    else:
        with _disable_current_modes():  # a real tensor: read under the tracer's fake mode, it has no data
            ends = offs.tolist()
        bounds = list(zip([0, *ends[:-1]], ends))
    largest = 0
    for group, (start, end) in enumerate(bounds):
        largest = max(largest, _mm_out_scratch(*_group_operands(mat_a, mat_b, out, group, start, end)))
    return largest


# --------------------------------------------------------------------------------------------------
# Generic CPU rules: wrapped numbers and TensorIterator's dtype promotion


def _generic_cpu(func: Any, args: tuple, kwargs: dict, out: Any) -> int:
    return sum(int(rule(func, args, kwargs, out)) for rule in GENERIC_RULES.get("cpu", ()))


def _bind(func: Any, args: tuple, kwargs: dict) -> list[tuple[Any, Any]]:
    """(schema argument, value) for each argument given."""
    bound = []
    for i, argument in enumerate(func._schema.arguments):
        if i < len(args) and not argument.kwarg_only:
            bound.append((argument, args[i]))
        elif argument.name in kwargs:
            bound.append((argument, kwargs[argument.name]))
    return bound


def _is_tensor_type(argument: Any) -> bool:
    kind = argument.type
    if isinstance(kind, torch.OptionalType):
        kind = kind.getElementType()
    return isinstance(kind, torch.TensorType)


def _is_number(value: Any) -> bool:
    return isinstance(value, (bool, int, float, complex))


class SavedFloat(float):
    """A number a backward op reads from the wrapped numbers autograd saved in forward: it reaches a
    dispatch mode as a plain number, as one wrapped for the call does, but its tensor exists already
    (the tracer counts it from when it was saved): an operand, not scratch."""


class SavedInt(int):
    __doc__ = SavedFloat.__doc__


def as_saved_number(value: Any) -> Any:
    """`value` marked as a saved wrapped number (SavedFloat), where it is a float or an integer."""
    if isinstance(value, float):
        return SavedFloat(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return SavedInt(value)
    return value


def _wrapped_bytes(value: Any) -> int:
    """What wrapping `value` for the call allocates: nothing where it was saved already."""
    return 0 if isinstance(value, (SavedFloat, SavedInt)) else _itemsize(_wrapped_dtype(value))


def _wrapped_dtype(value: Any) -> torch.dtype:
    """The dtype of the 0-dim tensor a Python number becomes (torch/csrc/utils/python_arg_parser.cpp
    scalar_to_tensor -> c10::scalar_to_tensor: bool, int64, double or complex double)."""
    if isinstance(value, bool):
        return torch.bool
    if isinstance(value, int):
        return torch.int64
    if isinstance(value, float):
        return torch.float64
    return torch.complex128


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


@functools.cache
def _promote_types(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """torch.promote_types, remembered: the rules run on every op of a trace, where a torch function
    call passes through the tracer's function mode (_InPlaceScopes) first."""
    return torch.promote_types(a, b)


def _result_type(operands: list[tuple[torch.dtype, int, bool]]) -> torch.dtype | None:
    """c10/core/ScalarType + ATen/native/TypeProperties.cpp result_type: operands (dtype, dim, wrapped);
    dimensioned tensors outrank 0-dim tensors, which outrank wrapped numbers, unless the lower one is
    of a higher category (bool < integral < floating < complex)."""
    results: list[torch.dtype | None] = [None, None, None]  # dimensioned, zero-dim, wrapped
    for dtype, dim, wrapped in operands:
        if wrapped:
            # a wrapped floating number counts as the default dtype (update_result_type_state)
            if dtype.is_complex:
                dtype = torch.complex64 if torch.get_default_dtype() == torch.float32 else torch.complex128
            elif dtype.is_floating_point:
                dtype = torch.get_default_dtype()
            slot = 2
        else:
            slot = 1 if dim == 0 else 0
        results[slot] = dtype if results[slot] is None else _promote_types(results[slot], dtype)

    def combine(higher: torch.dtype | None, lower: torch.dtype | None) -> torch.dtype | None:
        # TypeProperties.cpp combine_categories
        if higher is None:
            return lower
        if lower is None or higher.is_complex:
            return higher
        if lower.is_complex:
            return _promote_types(higher, torch.complex64) if higher.is_floating_point else lower
        if higher.is_floating_point:
            return higher
        if higher == torch.bool or lower.is_floating_point:
            return _promote_types(higher, lower)
        return higher

    return combine(results[0], combine(results[1], results[2]))


def wrapped_numbers(func: Any, args: tuple, kwargs: dict) -> list[tuple[Any, torch.dtype]]:
    """The Python numbers that reach `func` where its schema asks for a Tensor: the argument parser
    (or the C++ caller, at::native::wrapped_scalar_tensor) made each a 0-dim CPU tensor that lives
    for the call. Under a dispatch mode they arrive as plain numbers again."""
    return [(value, _wrapped_dtype(value)) for argument, value in _bind(func, args, kwargs)
            if _is_number(value) and (_is_tensor_type(argument) or _wraps_scalar(func, argument))]


# Pointwise overloads taking an operand as a Scalar run the Tensor-Tensor kernel on a wrapped copy of
# it (aten/src/ATen/native/BinaryOps.cpp, e.g. `add(self, wrapped_scalar_tensor(other), alpha)`,
# TORCH_META_FUNC2(eq, Scalar) -> build_borrowing_comparison_op(..., wrapped_scalar_tensor(other)),
# pow.Scalar, xlogy.Scalar_Self, the special polynomials' x_scalar/n_scalar overloads): the operand
# arguments are named self/other/x/n; modifiers (alpha, value, min, max, exponent, weight, ...) stay
# Scalars.
_OPERAND_NAMES = frozenset({"self", "other", "x", "n"})


def _wraps_scalar(func: Any, argument: Any) -> bool:
    return (torch.Tag.pointwise in func.tags and str(argument.type) == "number"
            and argument.name in _OPERAND_NAMES)


# CompositeExplicitAutograd pointwise ops that multiply by a wrapped double inside
# (aten/src/ATen/native/UnaryOps.cpp rad2deg_out/deg2rad_out: at::mul_out(result, self,
# wrapped_scalar_tensor(Scalar(M_180_PI)))).
_IMPLICIT_WRAPPED = {op: 1.0 for op in (aten.rad2deg.default, aten.rad2deg_.default, aten.deg2rad.default,
                                         aten.deg2rad_.default)}
# Operands TensorIterator does not promote: a where's condition (TensorCompare.cpp where_self_out
# builds its iterator on `cond_bool` and the already converted self/other), a masked_fill's mask.
_NOT_PROMOTED = frozenset({"condition", "mask"})


# Namespaces whose ops are PyTorch's own (rules above, or none needed), or that have no kernel to measure
_OWN_NAMESPACES = frozenset({"aten", "prims", "prim", "profiler", "_c10d_functional", "c10d", "higher_order"})


@generic_rule("cpu")
def _custom_op(func: Any, args: tuple, kwargs: dict, out: Any) -> int:
    """An op registered outside aten (torch.library: torch's own `torch_nn::_linear_cross_entropy_batch_chunked`,
    torchvision's `roi_align`, a user's extension) is traced through its fake implementation, which
    makes the outputs and nothing of what the real kernel allocates inside (the chunked cross-entropy's
    logits and softmax per chunk): measured."""
    if getattr(func, "namespace", "aten") in _OWN_NAMESPACES:
        return 0
    return probe_scratch(func, args, kwargs)


@generic_rule("cpu")
def _wrapped_numbers(func: Any, args: tuple, kwargs: dict, out: Any) -> int:
    """Each wrapped number is a 0-dim tensor of its own (8 bytes for int64/double)."""
    if torch.Tag.pointwise in func.tags:
        return 0  # counted with the operands' promotion in _tensor_iterator_promotion
    return sum(_wrapped_bytes(value) for value, _ in wrapped_numbers(func, args, kwargs))


@generic_rule("cpu")
def _tensor_iterator_promotion(func: Any, args: tuple, kwargs: dict, out: Any) -> int:
    """Pointwise ops run on TensorIterator, which on the CPU (aten/src/ATen/TensorIterator.cpp
    TensorIteratorBase::compute_types, `common_device == kCPU`) copies every input whose dtype differs
    from the common dtype (`op.tensor().to(common_dtype_)`, promote_inputs_to_common_dtype) and
    computes into a temporary of the common dtype for an output of another dtype
    (cast_common_dtype_to_outputs, `at::empty_like(..., common_dtype_)`). Wrapped numbers are operands
    too: a double 0-dim tensor becomes a float32 one for a float32 op."""
    if torch.Tag.pointwise not in func.tags:
        return 0
    if func in _NO_PROMOTION:
        return 0
    bound = _bind(func, args, kwargs)
    inputs: list[tuple[torch.dtype, int, int, bool]] = []  # dtype, numel, dim, wrapped
    outputs: list[torch.Tensor] = []
    wrapped = 0
    for argument, value in bound:
        written = argument.alias_info is not None and argument.alias_info.is_write
        if isinstance(value, torch.Tensor):
            if written:
                outputs.append(value)
            if not (written and argument.name == "out") and argument.name not in _NOT_PROMOTED:
                inputs.append((value.dtype, value.numel(), value.dim(), False))
        elif _is_number(value) and (_is_tensor_type(argument) or _wraps_scalar(func, argument)):
            inputs.append((_wrapped_dtype(value), 1, 0, True))
            wrapped += _wrapped_bytes(value)
    if func in _IMPLICIT_WRAPPED:
        inputs.append((torch.float64, 1, 0, True))
        wrapped += 8
    if not inputs:
        return wrapped
    common = _result_type([(dtype, dim, w) for dtype, _, dim, w in inputs])
    results = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    if not outputs and results and results[0].dtype != torch.bool and not (
            results[0].dtype.is_floating_point and common is not None and common.is_complex):
        common = results[0].dtype  # what the op computes in (e.g. integers promoted to float)
    if common is None:
        return wrapped
    size = _itemsize(common)
    copies = sum(numel * size for dtype, numel, _, _ in inputs if dtype != common)
    copies += sum(t.numel() * size for t in outputs if t.dtype != common)
    return wrapped + copies


# Pointwise ops whose kernels take no TensorIterator promotion (masked_fill writes a Scalar through
# a bool mask: aten/src/ATen/native/TensorAdvancedIndexing.cpp masked_fill_impl_cpu).
_NO_PROMOTION = frozenset({aten.masked_fill.Scalar, aten.masked_fill_.Scalar})


@scratch_rule("cpu", aten.isinf.default)
def _isinf(args: tuple, kwargs: dict, out: Any) -> int:
    """aten/src/ATen/native/TensorCompare.cpp isinf: integral inputs give zeros_like; otherwise
    `self.abs() == std::numeric_limits<double>::infinity()`: the abs, plus a wrapped double converted
    to the input's dtype (eq.Scalar)."""
    self = args[0]
    if not (self.is_floating_point() or self.is_complex()):
        return 0
    real = self.abs().dtype if self.is_complex() else self.dtype
    conversion = 0 if real == torch.float64 else _itemsize(real)
    return self.numel() * _itemsize(real) + 8 + conversion


# --------------------------------------------------------------------------------------------------
# Reductions


def _reduction_input_copy(self: torch.Tensor, in_dtype: torch.dtype) -> int:
    """aten/src/ATen/native/ReduceOpsUtils.h make_reduction: on the CPU the input is reduced in the
    output's dtype (make_reduction_from_out_ty: `in_dtype = out_dtype` unless complex or CUDA), through
    a full copy `self.to(in_dtype)` when its own dtype differs."""
    if self.is_complex() and not in_dtype.is_complex:
        in_dtype = _promote_types(in_dtype, torch.complex64)
    return 0 if self.dtype == in_dtype else self.numel() * _itemsize(in_dtype)


# at::internal::GRAIN_SIZE: the fewest elements a CPU kernel splits between threads
_GRAIN_SIZE = 32768


def _two_pass_buffer(numel: int, out: torch.Tensor, dtype: torch.dtype) -> int:
    """aten/src/ATen/TensorIteratorReduce.cpp parallel_reduce: reducing GRAIN_SIZE elements or more to
    one, on more than one thread, runs two_pass_reduction, which keeps one partial result per thread in
    `at::empty({max_threads}, dst.options())` (dst: the reduction's output, in `dtype`)."""
    threads = torch.get_num_threads()
    if numel < _GRAIN_SIZE or threads == 1 or out.numel() != 1:
        return 0
    return threads * _itemsize(dtype)


@scratch_rule("cpu", aten.sum.dim_IntList, aten.sum.default, aten.nansum.default, aten.prod.default,
              aten.prod.dim_int)
def _sum(args: tuple, kwargs: dict, out: Any) -> int:
    """ReduceOps.cpp sum_out/nansum_out/prod_out -> make_reduction_from_out_ty(self, result, ...,
    result.scalar_type()): the input's copy in the output dtype (a bf16 tensor summed with
    dtype=float32, a bool mask summed into int64), and the two-pass buffer of a reduction to one
    element."""
    return _reduction_input_copy(args[0], out.dtype) + _two_pass_buffer(args[0].numel(), out, out.dtype)


@scratch_rule("cpu", aten.sum.dim_IntList)
def _sum_over_dims(args: tuple, kwargs: dict, out: Any) -> int:
    """As _sum, except that a bf16/fp16 sum whose reduced dimensions stay two or more after
    TensorIterator coalesces them (a per-channel gradient, over (0, 2, 3) of NCHW) sums a float32 copy
    of the input into a float32 result, then copies that into the output (sum_out: should_use_acc_buffer)."""
    self = args[0]
    if self.dtype == out.dtype and _sums_into_float(self, args[1] if len(args) > 1 else None, out):
        return 4 * (self.numel() + out.numel()) + _two_pass_buffer(self.numel(), out, torch.float32)
    return _sum(args, kwargs, out)


def _sums_into_float(self: torch.Tensor, dims: Any, out: torch.Tensor) -> bool:
    """ReduceOps.cpp should_use_acc_buffer: a reduced-precision sum whose iterator keeps two reduced
    dimensions innermost. TensorIterator moves every reduced dimension to the front, ordered by the
    input's strides, and coalesces neighbours that are contiguous in memory (size-1 dimensions vanish)."""
    if out.dtype not in _REDUCED or self.dim() == 0:
        return False
    reduced = set(range(self.dim())) if not dims else {d % self.dim() for d in dims}
    order = [d for d in reversed(range(self.dim())) if d in reduced and self.shape[d] != 1]
    order.sort(key=lambda d: self.stride(d))
    groups, stride, size = 0, None, 1
    for d in order:
        if stride is None or stride * size != self.stride(d):
            groups, stride, size = groups + 1, self.stride(d), self.shape[d]
        else:
            size *= self.shape[d]
    return groups >= 2


@scratch_rule("cpu", aten.mean.dim, aten.mean.default)
def _mean(args: tuple, kwargs: dict, out: Any) -> int:
    """ReduceOps.cpp TORCH_IMPL_FUNC(mean_out), CPU branch: bf16/fp16 results are computed in a
    float32 `result_temp = result.to(kFloat)`; `at::sum_out(result_temp, self, ..., sum_out_dtype)`
    copies the input to that dtype if it differs (freed when the sum is done, with the two-pass
    buffer of a reduction to one element); then `.div_(dim_prod)` divides by a wrapped int64, which
    TensorIterator converts to the sum dtype."""
    self = args[0]
    half = out.dtype in _REDUCED
    sum_dtype = torch.float32 if half else out.dtype
    temp = out.numel() * 4 if half else 0
    divide = 8 + (0 if sum_dtype == torch.int64 else _itemsize(sum_dtype))
    summing = _reduction_input_copy(self, sum_dtype) + _two_pass_buffer(self.numel(), out, sum_dtype)
    return temp + max(summing, divide)


@scratch_rule("cpu", aten.all.default, aten.all.dim, aten.all.dims, aten.any.default, aten.any.dim,
              aten.any.dims)
def _all_any(args: tuple, kwargs: dict, out: Any) -> int:
    """ReduceOps.cpp allany_impl: one element -> `self.view_as(result).to(kBool)`; otherwise on the
    CPU get_allany_iter -> make_reduction_from_out_ty(..., result.scalar_type()): a bool copy of a
    non-bool input."""
    self = args[0]
    if self.numel() == 0 or self.dtype == out.dtype:
        return 0
    return self.numel() * _itemsize(out.dtype)


# --------------------------------------------------------------------------------------------------
# Normalization


def _opmath(dtype: torch.dtype) -> torch.dtype:
    """at::opmath_type: float32 for the reduced floating types."""
    return torch.float32 if dtype in _REDUCED else dtype


def _channels_last_kernel(x: torch.Tensor) -> bool:
    """aten/src/ATen/native/cpu/batch_norm_kernel.cpp batch_norm_cpu_*_kernel: NCHW-contiguous input
    with image_size == 1 ("NC11 is also channels last") or channels-last input take the
    channels-last implementation."""
    image_size = x.numel() // (x.shape[0] * x.shape[1]) if x.numel() else 0
    if x.is_contiguous():
        return image_size == 1
    return x.dim() in (4, 5) and x.is_contiguous(
        memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d)


def _dense(x: torch.Tensor) -> bool:
    """Normalization.cpp is_contiguous: contiguous, channels-last or channels-last-3d."""
    return x.is_contiguous() or (x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last)) or (
        x.dim() == 5 and x.is_contiguous(memory_format=torch.channels_last_3d))


def _is_mixed(x: torch.Tensor, *params: Any) -> bool:
    """ATen/native/cpu/mixed_data_type.h is_mixed_type: reduced-precision input, float32 parameters."""
    return x.dtype in _REDUCED and any(isinstance(p, torch.Tensor) and p.dtype == torch.float32 for p in params)


@scratch_rule("cpu", aten.native_batch_norm.default, aten._native_batch_norm_legit.default)
def _batch_norm(args: tuple, kwargs: dict, out: Any) -> int:
    """aten/src/ATen/native/Normalization.cpp batch_norm_cpu -> batch_norm_cpu_update_stats_template
    (training, contiguous input): `_mean` and `_var_sum` (C each, in float32 for a mixed-type call or
    an fp16 input, whatever its parameters' dtype, else the input dtype: measured) while batch_norm_cpu_collect_stats_kernel runs, whose channels-last
    implementation (batch_norm_kernel.cpp batch_norm_cpu_collect_stats_channels_last_internal) adds a
    {num_threads, C} float buffer: always for reduced precision, for float32/64 when
    N*H*W > num_threads. Then batch_norm_cpu_transform_input_template -> batch_norm_cpu_kernel:
    `alpha` and `beta` (C each, opmath dtype). Inference (or a non-contiguous input) keeps only these."""
    x, weight, bias, running_mean, running_var, training = args[:6]
    channels = x.shape[1] if x.dim() > 1 else 1
    mixed = _is_mixed(x, weight, bias, running_mean, running_var)
    stat = 4 if mixed or x.dtype == torch.float16 else _itemsize(x.dtype)  # fp16's in float32 even unmixed
    alpha_beta = 2 * channels * _itemsize(_opmath(x.dtype))
    if not training or not _dense(x):
        return alpha_beta if _dense(x) else 0
    collect = 2 * channels * stat
    if _channels_last_kernel(x):
        threads = torch.get_num_threads()
        n = x.numel() // channels
        if x.dtype in _REDUCED:
            collect += threads * channels * 4
        elif n > threads:
            collect += threads * channels * _itemsize(x.dtype)
    return max(collect, alpha_beta)


@scratch_rule("cpu", aten.native_batch_norm_backward.default)
def _batch_norm_backward(args: tuple, kwargs: dict, out: Any) -> int:
    """Normalization.cpp batch_norm_backward_cpu_template: with input and grad_output dense and
    suggesting the same memory format (`input.suggest_memory_format() == grad_out.suggest_memory_format()`:
    the strides of size-1 dimensions count), grad_input is allocated a second time (`grad_input = at::empty_like(input,
    suggest_memory_format_contig(input))`) before the first is released; then the channels-last
    kernel (batch_norm_kernel.cpp batch_norm_cpu_backward_channels_last_impl/_internal) allocates a
    {2, num_threads, C} opmath buffer, plus float32 weight/mean/invstd copies for reduced precision
    (float32: `invstd` in inference, `weight_` when weight is undefined). The contiguous kernel
    allocates nothing. Otherwise the generic path reduces `at::sum(grad_out)` (C)."""
    grad_out, x, weight = args[:3]
    train, mask = args[7], args[9]
    channels = x.shape[1] if x.dim() > 1 else 1
    same_format = _dense(x) and _dense(grad_out) and suggest_memory_format(x) == suggest_memory_format(grad_out)
    if not same_format:
        return channels * _itemsize(x.dtype)
    second_grad_input = x.numel() * _itemsize(x.dtype) if mask[0] else 0
    kernel = 0
    if _channels_last_kernel(x):
        threads = torch.get_num_threads()
        size = _itemsize(_opmath(x.dtype))
        kernel = 2 * threads * channels * size
        if x.dtype in _REDUCED:
            kernel += 3 * channels * 4
        else:
            kernel += (0 if train else channels * size) + (0 if weight is not None else channels * size)
    return max(second_grad_input, kernel)


@scratch_rule("cpu", aten._ctc_loss_backward.default, aten._ctc_loss_backward.Tensor)
def _ctc_loss_backward(args: tuple, kwargs: dict, out: Any) -> int:
    """aten/src/ATen/native/LossCTC.cpp ctc_loss_backward_cpu_template: `log_beta =
    at::empty_like(log_alpha)` (batch x T x (2 * max target length + 1)), freed inside; the gradient
    is the output."""
    log_alpha = args[6] if len(args) > 6 else kwargs["log_alpha"]
    return log_alpha.numel() * _itemsize(log_alpha.dtype)


@scratch_rule("cpu", aten.native_layer_norm.default)
def _layer_norm(args: tuple, kwargs: dict, out: Any) -> int:
    """aten/src/ATen/native/layer_norm.cpp layer_norm_cpu: `input.expect_contiguous()`,
    `weight.expect_contiguous()` and `bias.expect_contiguous()` copy non-contiguous operands (a
    LayerNorm over a transposed convolution output), before Y, mean and rstd are allocated."""
    x = args[0]
    weight = args[2] if len(args) > 2 else kwargs.get("weight")
    bias = args[3] if len(args) > 3 else kwargs.get("bias")
    copies = 0
    for t in (x, weight, bias):
        if t is not None and not t.is_contiguous():
            copies += t.numel() * _itemsize(t.dtype)
    return copies


@scratch_rule("cpu", aten.roll.default)
def _roll(args: tuple, kwargs: dict, out: Any) -> int:
    """aten/src/ATen/native/TensorTransformations.cpp roll_common: several dims roll the first one,
    then `at::roll` the result over the rest (recursively): one input-sized intermediate per extra
    dim, all live at the innermost call. No dims: a flattened roll (`flatten()` copies a
    non-contiguous input)."""
    x = args[0]
    dims = args[2] if len(args) > 2 else kwargs.get("dims", ())
    dims = [dims] if isinstance(dims, int) else list(dims)
    nbytes = x.numel() * _itemsize(x.dtype)
    if not dims:
        return 0 if x.is_contiguous() else nbytes
    return (len(dims) - 1) * nbytes


@scratch_rule("cpu", aten.native_layer_norm_backward.default)
def _layer_norm_backward(args: tuple, kwargs: dict, out: Any) -> int:
    """aten/src/ATen/native/layer_norm.cpp layer_norm_backward_cpu: `input.expect_contiguous()` and
    `weight.expect_contiguous()` copy non-contiguous operands; cpu/layer_norm_kernel.cpp
    LayerNormBackwardKernelImpl passes `dY.contiguous()` and, when dgamma or dbeta is wanted,
    LayerNormBackwardKernelImplInternal zeroes a {2, num_threads, N} buffer of the input dtype."""
    grad_out, x, normalized_shape, _mean, _rstd, weight, _bias, mask = args[:8]
    n = math.prod(normalized_shape)
    size = _itemsize(x.dtype)
    copies = 0 if x.is_contiguous() else x.numel() * size
    if weight is not None and not weight.is_contiguous():
        copies += weight.numel() * _itemsize(weight.dtype)
    if not grad_out.is_contiguous():
        copies += grad_out.numel() * _itemsize(grad_out.dtype)
    buffer = 2 * torch.get_num_threads() * n * size if (mask[1] or mask[2]) else 0
    return copies + buffer


@scratch_rule("cpu", aten.native_group_norm_backward.default)
def _group_norm_backward(args: tuple, kwargs: dict, out: Any) -> int:
    """aten/src/ATen/native/cpu/group_norm_kernel.cpp GroupNormBackwardKernelImplInternal (and its
    channels-last variant): the per-(sample, channel) sums `ds` and `db`, two {N, C} buffers of the
    input's opmath type (float32 for bf16/fp16), whichever gradients the mask asks for."""
    x, n, c = args[1], args[5], args[6]
    return 2 * n * c * _itemsize(_opmath(x.dtype))


@scratch_rule("cpu", aten.embedding_dense_backward.default)
def _embedding_dense_backward(args: tuple, kwargs: dict, out: Any) -> int:
    """aten/src/ATen/native/Embedding.cpp embedding_dense_backward_cpu: `indices.contiguous()`,
    `grad_.contiguous().view({numel, grad_.size(-1)})` (a copy when the incoming gradient is not
    contiguous, e.g. behind a transpose), and with scale_grad_by_freq a `counts` vector of
    num_weights indices."""
    grad, indices, num_weights, _padding_idx, scale_grad_by_freq = args[:5]
    extra = 0 if grad.is_contiguous() else grad.numel() * _itemsize(grad.dtype)
    if not indices.is_contiguous():
        extra += indices.numel() * _itemsize(indices.dtype)
    if scale_grad_by_freq:
        extra += num_weights * _itemsize(indices.dtype)
    return extra


# EmbeddingBag (aten/src/ATen/native/EmbeddingBag.cpp). The forward builds offset2bag through
# temporaries (`ones_like(offsets)`, a wrapped-number `offset2bag[0] -= 1`, a cumsum into a second
# n + 1 tensor), mean mode divides through `max(bag_size, ones_like(bag_size)).to(dtype)`, and the
# non-fast half/bfloat16 paths accumulate in float32 buffers; the backward sorts the indices
# (values, indices and an arange), index_selects offset2bag (and the per-sample weights) by the
# sort, rebuilds offset2bag when the forward skipped it (mode sum on the fast path), and for mode
# max gathers the non-empty bags (nonzero + index_select). Which of these run depends on the mode,
# dtype, strides, padding_idx and per-sample weights, so the kernel is run (shapes only decide the
# sizes; the probe's zero-filled operands are valid indices and offsets).


def _bags_non_empty(bag_size_index: int) -> Callable[[tuple, dict], tuple[tuple, dict]]:
    """Mode max's backward keeps `bag_size.nonzero()` rows: with zero-filled bag sizes that would be
    none. Every bag counts as non-empty (exact unless some bag is empty; then an upper bound)."""

    def prepare(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        args = list(args)
        args[bag_size_index] = torch.ones_like(args[bag_size_index])
        return tuple(args), kwargs

    return prepare


def _embedding_bag_probe(func: Any, bag_size_index: int | None = None, mode_index: int | None = None) -> ScratchFormula:
    def formula(args: tuple, kwargs: dict, out: Any) -> int:
        prepare = None
        if bag_size_index is not None:
            mode = args[mode_index] if len(args) > mode_index else kwargs.get("mode", 0)
            prepare = _bags_non_empty(bag_size_index) if mode == 2 else None
        return probe_scratch(func, args, kwargs, prepare=prepare)

    return formula


for _op in (aten._embedding_bag.default, aten._embedding_bag_forward_only.default,
            aten._embedding_bag_per_sample_weights_backward.default):
    scratch_rule("cpu", _op)(_embedding_bag_probe(_op))
scratch_rule("cpu", aten._embedding_bag_backward.default)(
    _embedding_bag_probe(aten._embedding_bag_backward.default, bag_size_index=4, mode_index=8))
scratch_rule("cpu", aten._embedding_bag_dense_backward.default)(
    _embedding_bag_probe(aten._embedding_bag_dense_backward.default, bag_size_index=3, mode_index=7))


@scratch_rule("cpu", aten.gelu_backward.default)
def _gelu_backward(args: tuple, kwargs: dict, out: Any) -> int:
    """aten/src/ATen/native/Activation.cpp gelu_backward_out_cpu: the exact (erf) GELU goes to oneDNN's
    eltwise_backward when use_mkldnn(self) holds, whose itensor views need one layout: when the input
    and the incoming gradient are laid out differently (GELU over a permuted einsum or bmm output)
    both are reordered into temporaries. Which layouts oneDNN accepts as they are is its own choice,
    so a mismatch is measured; matching layouts take the TensorIterator kernel (no scratch)."""
    grad, self = args[0], args[1]
    approximate = args[2] if len(args) > 2 else kwargs.get("approximate", "none")
    if approximate == "none" and grad.stride() != self.stride():
        return probe_scratch(aten.gelu_backward.default, args, kwargs)
    return _generic_cpu(aten.gelu_backward.default, args, kwargs, out)


@scratch_rule("cpu", aten._softmax.default, aten._log_softmax.default)
def _softmax_cpu(args: tuple, kwargs: dict, out: Any) -> int:
    """aten/src/ATen/native/SoftMax.cpp softmax_cpu_out / log_softmax_cpu_out: `input_.contiguous()`
    (a copy when the input is transposed, e.g. log_softmax over a (T, B, C) view for CTC)."""
    x = args[0]
    copy = 0 if x.is_contiguous() else x.numel() * _itemsize(x.dtype)
    return copy + _generic_cpu(aten._softmax.default, args, kwargs, out)


@scratch_rule("cpu", aten._softmax_backward_data.default, aten._log_softmax_backward_data.default)
def _softmax_backward_cpu(args: tuple, kwargs: dict, out: Any) -> int:
    """SoftMax.cpp softmax_backward_cpu_out / log_softmax_backward_cpu_out: `grad.contiguous()` and
    `output.contiguous()` (copies of a transposed incoming gradient)."""
    return sum(t.numel() * _itemsize(t.dtype) for t in args[:2] if not t.is_contiguous())


@scratch_rule("cpu", aten._safe_softmax.default)
def _safe_softmax(args: tuple, kwargs: dict, out: Any) -> int:
    """aten/src/ATen/native/transformers/attention.cpp _safe_softmax: `at::softmax(self, dim, dtype)`
    (converting the input first when a dtype is given, freed after), then the -inf mask
    `self.eq(neg_inf)` (bool, input-sized), the fully-masked rows `all(masked, dim, true)` and a
    0-dim `zero` of the output dtype for the final where."""
    self, dim = args[0], args[1]
    dtype = args[2] if len(args) > 2 else kwargs.get("dtype")
    converted = self.numel() * _itemsize(dtype) if dtype is not None and dtype != self.dtype else 0
    rows = self.numel() // self.shape[dim] if self.dim() and self.shape[dim] else self.numel()
    return max(converted, self.numel() + rows + _itemsize(out.dtype))


def _flash_split(q_len: int) -> int:
    """cpu/FlashAttentionKernel.cpp flash_attention_kernel_impl: the query block size by length."""
    return 256 if q_len >= 768 else 64 if q_len >= 192 else 32


_KV_SPLIT = 512


@scratch_rule("cpu", aten._scaled_dot_product_flash_attention_for_cpu.default)
def _flash_attention(args: tuple, kwargs: dict, out: Any) -> int:
    """cpu/FlashAttentionKernel.cpp cpu_flash_attention: per-thread buffers, allocated once for the
    call: `buf` {num_threads, qSplit*kvSplit + 2*qSplit + qSplit*headSize} in the accumulation type
    and, for bf16/fp16, `buf_reduced` {num_threads, qSplit, kvSplit}. (float16 on CPUs where oneDNN
    packs (could_pack) pads the blocks and packs through oneDNN: measured instead.)"""
    query, key = args[0], args[1]
    if query.dtype == torch.float16:
        return probe_scratch(aten._scaled_dot_product_flash_attention_for_cpu.default, args, kwargs)
    q_len, kv_len, head = query.shape[2], key.shape[2], query.shape[3]
    q_split = min(_flash_split(q_len), q_len)
    kv_split = min(_KV_SPLIT, kv_len)
    threads = torch.get_num_threads()
    accum = _itemsize(_opmath(query.dtype))
    buf = threads * (q_split * kv_split + 2 * q_split + q_split * head) * accum
    reduced = threads * q_split * kv_split * _itemsize(query.dtype) if query.dtype in _REDUCED else 0
    return buf + reduced


@scratch_rule("cpu", aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
def _flash_attention_backward(args: tuple, kwargs: dict, out: Any) -> int:
    """cpu/FlashAttentionKernel.cpp flash_attention_backward_kernel_impl: `grad_out.contiguous()` in
    the kernel's (B, L, H, D) layout; cpu_flash_attention_backward: `buf` {num_threads,
    2*qSplit*kvSplit} in the accumulation type, for bf16/fp16 `buf_reduced` of the same shape, and a
    `dsum` of qSplit per thread allocated inside the parallel region (the profiler sees the calling
    thread's). bf16/fp16 blocks then run cpublas::gemm into reduced-precision gradients, which goes
    to oneDNN (mkldnn_bf16_gemm) with a scratchpad of its own per call: those are measured."""
    grad_out, query, key = args[0], args[1], args[2]
    if query.dtype in _REDUCED:
        return probe_scratch(aten._scaled_dot_product_flash_attention_for_cpu_backward.default, args, kwargs)
    q_len, kv_len = query.shape[2], key.shape[2]
    q_split = min(_flash_split(q_len), q_len)
    kv_split = min(_KV_SPLIT, kv_len)
    threads = torch.get_num_threads()
    accum = _itemsize(_opmath(query.dtype))
    copy = 0 if grad_out.transpose(1, 2).is_contiguous() else grad_out.numel() * _itemsize(grad_out.dtype)
    return copy + threads * 2 * q_split * kv_split * accum + q_split * accum


def rnn_workspace_bytes(args: tuple, kwargs: dict) -> int:
    """The bytes of the oneDNN workspace that aten.mkldnn_rnn_layer returns as its 4th output when
    grad mode is on (mkldnn/RNN.cpp: `at::empty(pd.workspace_desc().get_size(), kByte)`), kept for
    the backward. The meta kernel (torch/_meta_registrations.py mkldnn_rnn_layer) returns an empty
    one, so the tracer needs this to size it: measured from oneDNN like the scratch. Cached."""
    key = ("workspace",) + tuple((tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else repr(t)
                                 for t in tree_flatten((args, kwargs))[0]) + (torch.get_num_threads(),)
    if key not in _PROBED:
        with _disable_current_modes(), torch.autocast("cpu", enabled=False), torch.enable_grad():
            real = tree_map(lambda t: torch.zeros(t.shape, dtype=t.dtype) if isinstance(t, torch.Tensor) else t,
                            (args, kwargs))
            _PROBED[key] = aten.mkldnn_rnn_layer.default(*real[0], **real[1])[3].untyped_storage().nbytes()
    return _PROBED[key]


# --------------------------------------------------------------------------------------------------
# Other CPU kernels


@scratch_rule("cpu", aten.native_dropout.default)
def _native_dropout(args: tuple, kwargs: dict, out: Any) -> int:
    """aten/src/ATen/native/Dropout.cpp native_dropout_cpu, training: a bool `mask` (an output),
    `output = input.mul(mask).mul_(scale)`: TensorIterator converts the bool mask to the input's
    dtype for the mul (input-sized), then mul_ wraps the double scale (8 bytes, converted)."""
    x = args[0]
    train = args[2] if len(args) > 2 else kwargs.get("train")
    if x.numel() == 0 or train is False:
        return 0
    size = _itemsize(x.dtype)
    return max(x.numel() * size, 8 + (0 if x.dtype == torch.float64 else size))


def _channels_last_kernel_2d(x: torch.Tensor, out: torch.Tensor) -> bool:
    """UpSampleKernel.cpp _use_vectorized_kernel_cond_2d: a channels-last input of more than 3 channels,
    or an output with H + W <= 128."""
    return (x.is_contiguous(memory_format=torch.channels_last) and x.shape[1] > 3) or out.shape[-2] + out.shape[-1] <= 128


def _channels_last_kernel_3d(x: torch.Tensor, out: torch.Tensor) -> bool:
    """The 3-d kernels' condition on this build: a channels-last-3d input of more than 3 channels."""
    return x.is_contiguous(memory_format=torch.channels_last_3d) and x.shape[1] > 3


def _upsample(interp_size: int, spatial: int,
              channels_last_kernel: Callable[[torch.Tensor, torch.Tensor], bool] | None = None) -> ScratchFormula:
    """aten/src/ATen/native/cpu/UpSampleKernel.cpp upsample_*_kernel_impl over `spatial` dimensions.
    Where `channels_last_kernel` holds, the channels-last kernel runs on `input_.contiguous(ChannelsLast)`
    into `output_.contiguous(ChannelsLast)` and copies back: a copy of each that is not channels-last
    already. Otherwise (always, for 1-d and bicubic) upsample_generic_Nd_kernel_impl builds, per
    spatial dimension and interpolation tap, an int64 index and a weight of the input dtype over the
    output size."""
    layout = torch.channels_last if spatial == 2 else torch.channels_last_3d

    def formula(args: tuple, kwargs: dict, out: Any) -> int:
        x = args[0]
        if x.dim() != spatial + 2:
            return 0
        if channels_last_kernel is not None and channels_last_kernel(x, out):
            copies = 0 if x.is_contiguous(memory_format=layout) else x.numel() * _itemsize(x.dtype)
            if not out.is_contiguous(memory_format=layout):
                copies += out.numel() * _itemsize(out.dtype)
            return copies
        return sum(interp_size * size * (8 + _itemsize(x.dtype)) for size in out.shape[-spatial:])

    return formula


scratch_rule("cpu", aten.upsample_nearest1d.default, aten._upsample_nearest_exact1d.default)(_upsample(1, 1))
scratch_rule("cpu", aten.upsample_linear1d.default)(_upsample(2, 1))
scratch_rule("cpu", aten.upsample_nearest2d.default, aten._upsample_nearest_exact2d.default)(
    _upsample(1, 2, _channels_last_kernel_2d))
scratch_rule("cpu", aten.upsample_bilinear2d.default)(_upsample(2, 2, _channels_last_kernel_2d))
scratch_rule("cpu", aten.upsample_bicubic2d.default)(_upsample(4, 2))
scratch_rule("cpu", aten.upsample_nearest3d.default, aten._upsample_nearest_exact3d.default)(
    _upsample(1, 3, _channels_last_kernel_3d))
scratch_rule("cpu", aten.upsample_trilinear3d.default)(_upsample(2, 3, _channels_last_kernel_3d))

# CPU foreach kernels for these ops run per tensor (ForeachOpsKernels.cpp
# foreach_tensor_<op>_scalar_kernel_slow_: `t.<op>_(scalar)`), which wraps the Scalar like the
# .Scalar overloads do: 8 bytes, converted to each tensor's dtype, one tensor at a time.
_FOREACH_WRAPPING = ("add", "sub", "mul", "div")


def _foreach_scalar(args: tuple, kwargs: dict, out: Any) -> int:
    tensors, scalars = args[0], args[1]
    if not isinstance(scalars, (list, tuple)):
        scalars = [scalars] * len(tensors)
    worst = 0
    for t, scalar in zip(tensors, scalars):
        wrapped = _wrapped_dtype(scalar) if _is_number(scalar) else torch.float64
        common = _result_type([(t.dtype, t.dim(), False), (wrapped, 0, True)])
        worst = max(worst, _itemsize(wrapped) + (0 if common == wrapped else _itemsize(common)))
    return worst


for _name in _FOREACH_WRAPPING:
    for _suffix in ("", "_"):
        _packet = getattr(aten, f"_foreach_{_name}{_suffix}")
        for _overload in ("Scalar", "ScalarList"):
            if _overload in _packet.overloads():
                scratch_rule("cpu", getattr(_packet, _overload))(_foreach_scalar)


# --------------------------------------------------------------------------------------------------
# Sorting and selection, scatter/gather, losses (found by `benchmarks/scratch_calibration.py sweep:opinfo`)


def _argument(args: tuple, kwargs: dict, position: int, name: str, default: Any) -> Any:
    return args[position] if len(args) > position else kwargs.get(name, default)


@scratch_rule("cpu", aten.logsumexp.default)
def _logsumexp(args: tuple, kwargs: dict, out: Any) -> int:
    """ReduceOps.cpp logsumexp (integral inputs copied to the default dtype first) ->
    logsumexp_out_impl: `maxes = at::amax(self, dims, true)`; `maxes.abs() == INFINITY` (the abs, a
    wrapped double converted to the dtype, a bool result) for masked_fill_; then
    `at::sum_out(result, (self - maxes).exp_(), ...)`: an input-sized difference, summed into the
    result (allocated there) with the two-pass buffer of a reduction to one element."""
    self = args[0]
    if self.numel() == 0:
        return 0
    dtype = torch.get_default_dtype() if not (self.is_floating_point() or self.is_complex()) else self.dtype
    size = _itemsize(dtype)
    copy = 0 if dtype == self.dtype else self.numel() * size
    maxes, result = out.numel() * size, out.numel() * _itemsize(out.dtype)
    wrapped = 8 + (0 if dtype == torch.float64 else size)
    masking = 2 * maxes + wrapped + out.numel()
    summing = maxes + self.numel() * size + result + _two_pass_buffer(self.numel(), out, out.dtype)
    return copy + max(masking, summing) - result


def _sort(dim_position: int | None) -> ScratchFormula:
    """Sorting.cpp sort_stable_out -> cpu/SortingKernel.cpp sort_kernel: `_fill_indices` writes each
    position into the indices through an int64 `at::arange(dim_size)` (a 0-dim input zeroes them).
    `dim_position`: the dim's position among the arguments, None where it is keyword-only."""

    def formula(args: tuple, kwargs: dict, out: Any) -> int:
        self = args[0]
        dim = kwargs.get("dim", -1) if dim_position is None else _argument(args, kwargs, dim_position, "dim", -1)
        return 0 if self.dim() == 0 else self.shape[dim] * 8

    return formula


scratch_rule("cpu", aten.sort.default)(_sort(1))
scratch_rule("cpu", aten.sort.stable)(_sort(None))


@scratch_rule("cpu", aten.kthvalue.default)
def _kthvalue(args: tuple, kwargs: dict, out: Any) -> int:
    """Sorting.cpp kthvalue_out_impl_cpu: selects in `self.clone(Contiguous)` with an int64 index of the
    same shape (a 0-dim input is copied into the outputs instead)."""
    self = args[0]
    return 0 if self.dim() == 0 else self.numel() * (_itemsize(self.dtype) + 8)


@scratch_rule("cpu", aten.median.default, aten.nanmedian.default)
def _median_of_all(args: tuple, kwargs: dict, out: Any) -> int:
    """Sorting.cpp median_impl over all elements: selects the middle one (nth_element) in a clone of the
    input, made before the output."""
    self = args[0]
    return self.numel() * _itemsize(self.dtype)


# ... along a dimension (median_with_indices_impl): a copy of the input unless the values along `dim`
# are laid out as the kernel walks them; measured.
for _op in (aten.median.dim, aten.nanmedian.dim):
    scratch_rule("cpu", _op)(_probe(_op))


@scratch_rule("cpu", aten.dist.default)
def _dist(args: tuple, kwargs: dict, out: Any) -> int:
    """Distance.cpp dist: `at::norm(self - other, p)`: the difference, broadcast (the norm's kernel
    allocates nothing more)."""
    shape = torch.broadcast_shapes(args[0].shape, args[1].shape)
    return math.prod(shape) * _itemsize(out.dtype)


@scratch_rule("cpu", aten.binary_cross_entropy_with_logits.default)
def _binary_cross_entropy_with_logits(args: tuple, kwargs: dict, out: Any) -> int:
    """Loss.cpp binary_cross_entropy_with_logits: `log_sigmoid_input = at::log_sigmoid(input)`
    (log_sigmoid_forward's CPU kernel also fills an input-sized buffer, freed on return); with
    pos_weight, `log_weight = (pos_weight - 1).mul(target).add_(1)` (a wrapped 1 for each, converted)
    multiplied into it; `loss = (1 - target).mul_(input).sub_(log_sigmoid_input)`; then the reduction
    of the loss (the mean's or sum's own scratch), or the loss itself is the output."""
    self, target = args[0], args[1]
    pos_weight = _argument(args, kwargs, 3, "pos_weight", None)
    reduction = _argument(args, kwargs, 4, "reduction", 1)  # at::Reduction::Mean
    weight = _argument(args, kwargs, 2, "weight", None)
    if any(t is not None and t.dtype != self.dtype for t in (target, weight, pos_weight)):
        # mixed dtypes (a float32 weight made in forward beside bf16 logits): each in-place product with
        # promotion computes in copies of its own: measured
        return probe_scratch(aten.binary_cross_entropy_with_logits.default, args, kwargs)
    size = _itemsize(self.dtype)
    wrapped = 8 + (0 if self.dtype == torch.float64 else size)
    log_sigmoid = self.numel() * size
    loss = target.numel() * _itemsize(target.dtype)  # `1 - target`, then multiplied in place
    phases = [2 * log_sigmoid]
    if pos_weight is not None:
        minus_one = pos_weight.numel() * size
        log_weight = math.prod(torch.broadcast_shapes(pos_weight.shape, target.shape)) * size
        phases.append(log_sigmoid + minus_one + log_weight + wrapped)
    if reduction == 0:  # none: the loss is the output
        phases.append(log_sigmoid + loss)
        return max(phases) - loss
    reduce = _mean if reduction == 1 else _sum
    result = out.numel() * _itemsize(out.dtype)
    phases.append(log_sigmoid + loss + result + reduce((target,), {}, out))  # the loss is laid out as target
    return max(phases) - result


# aten/src/ATen/native/cpu/ScatterGatherKernel.cpp. cpu_scatter_gather_base_kernel converts an index
# that is not int64 (`index.to(kLong)`) and, for a reduced-precision (bf16, fp16) result, works on a
# float32 copy of it (create_acc_buffer: gather's output, scatter's self), copied back. The "expanded
# index" fast paths (TensorAdvancedIndexingUtils.h can_use_expanded_index_path) take neither copy;
# scatter_add's and scatter_reduce's accumulate reduced precision in a float32 (threads, K) buffer.
_SCATTERS = (aten.scatter.src, aten.scatter.value, aten.scatter.reduce, aten.scatter.value_reduce,
             aten.scatter_.src, aten.scatter_.value, aten.scatter_.reduce, aten.scatter_.value_reduce)
_SCATTER_ADDS = (aten.scatter_add.default, aten.scatter_add_.default)
_SCATTER_REDUCES = (aten.scatter_reduce.two, aten.scatter_reduce_.two)


def _expanded_index_path(self: torch.Tensor, dim: int, index: torch.Tensor, src: Any, scatter_like: bool) -> bool:
    """can_use_expanded_index_path (radix sort taken as available, as on x86 builds)."""
    if not isinstance(src, torch.Tensor) or not self.is_floating_point() or self.dtype == torch.float16:
        return False
    if 0 in (self.numel(), index.numel(), src.numel()) or 0 in (self.dim(), index.dim(), src.dim()):
        return False
    if any(src.shape[d] != index.shape[d] for d in range(1, index.dim())):
        return False
    if scatter_like and index.numel() // index.shape[0] < 16:
        return False
    strides = index.stride()
    expanded = strides[0] == 1 and all(stride <= 1 for stride in strides[1:])
    return dim % self.dim() == 0 and expanded and src.is_contiguous() and self.is_contiguous()


def _index_to_int64(index: torch.Tensor) -> int:
    return 0 if index.dtype == torch.int64 else index.numel() * 8


def _float_copy(result: torch.Tensor) -> int:
    return result.numel() * 4 if result.dtype in _REDUCED else 0


@scratch_rule("cpu", aten.gather.default)
def _gather(args: tuple, kwargs: dict, out: Any) -> int:
    self, dim, index = args[0], args[1], args[2]
    if index.numel() == 0:
        return 0
    if _expanded_index_path(out, dim, index, self, scatter_like=False):
        return _index_to_int64(index)
    return _index_to_int64(index) + _float_copy(out)


def _scatter(accumulates: bool) -> ScratchFormula:
    def formula(args: tuple, kwargs: dict, out: Any) -> int:
        self, dim, index = args[0], args[1], args[2]
        src = args[3] if len(args) > 3 else kwargs.get("src")
        if index.numel() == 0:
            return 0
        if accumulates and _expanded_index_path(self, dim, index, src, scatter_like=True):
            buffer = torch.get_num_threads() * (index.numel() // index.shape[0]) * 4 if self.dtype in _REDUCED else 0
            return _index_to_int64(index) + buffer
        return _index_to_int64(index) + _float_copy(self)

    return formula


for _op in _SCATTERS:
    scratch_rule("cpu", _op)(_scatter(accumulates=False))
# scatter_reduce's "mean" also counts and divides, which is not modelled (its figure is a lower bound)
for _op in (*_SCATTER_ADDS, *_SCATTER_REDUCES):
    scratch_rule("cpu", _op)(_scatter(accumulates=True))


@scratch_rule("cpu", aten.abs.default, aten.angle.default)
@scratch_rule("cuda", aten.abs.default, aten.angle.default)
def _complex_to_float(args: tuple, kwargs: dict, out: Any) -> int:
    """UnaryOps.cpp unary_op_impl_with_complex_to_float (any device): of a complex input (an STFT's
    magnitude), the kernel writes a complex result first and copies its real part into the output."""
    self = args[0]
    return self.numel() * _itemsize(self.dtype) if self.is_complex() else 0


# FFTs through MKL (aten/src/ATen/native/mkl/SpectralOps.cpp, this build's CPU backend)


def _merges(sizes: list[int], strides: list[int]) -> bool:
    """Whether dimensions of these sizes and strides collapse into one without a copy (reshape's view)."""
    kept = [(size, stride) for size, stride in zip(sizes, strides) if size != 1]
    return all(outer[1] == inner[1] * inner[0] for outer, inner in itertools.pairwise(kept))


def _exec_fft(shape: torch.Size, strides: tuple[int, ...], dims: list[int],
              out_sizes: list[int]) -> tuple[bool, list[int]]:
    """SpectralOps.cpp _exec_fft: the input is permuted (batch dimensions first, by decreasing stride,
    then the transformed ones) and its batch dimensions collapsed by `reshape`, a copy unless they
    merge; the output is computed contiguous in that order and strided back. An input with a
    dimension of stride 0 (expanded, as the gradient of a sum is) is copied as well (measured on
    this build). (Copies the input?, the output's strides.)"""
    ndim = len(shape)
    batch = sorted((d for d in range(ndim) if d not in dims), key=lambda d: -strides[d])
    expanded = any(stride == 0 and size > 1 for size, stride in zip(shape, strides))
    copies = expanded or not _merges([shape[d] for d in batch], [strides[d] for d in batch])
    signal = [out_sizes[d] for d in dims]
    signal_strides = list(make_contiguous_strides_for(signal)) if signal else []
    out_strides = [0] * ndim
    batch_numel = math.prod(signal)
    for d in reversed(batch):
        out_strides[d] = batch_numel
        batch_numel *= out_sizes[d]
    for d, stride in zip(dims, signal_strides):
        out_strides[d] = stride
    return copies, out_strides


def _fft_input_copy(x: torch.Tensor, dims: list[int], out_sizes: list[int]) -> int:
    dims = [d % x.dim() for d in dims]
    return x.numel() * _itemsize(x.dtype) if _exec_fft(x.shape, x.stride(), dims, out_sizes)[0] else 0


@scratch_rule("cpu", aten._fft_r2c.default, aten._fft_c2c.default)
def _fft_r2c_c2c(args: tuple, kwargs: dict, out: Any) -> int:
    """_fft_r2c_mkl / _fft_c2c_mkl: the output, then _exec_fft's copy of the input if its batch
    dimensions do not merge (an FFT over a dimension other than the last, a transposed input). A
    two-sided r2c fills the other half in place."""
    if not torch.backends.mkl.is_available():
        return 0  # pocketfft: not modelled
    return _fft_input_copy(args[0], list(args[1]), list(out.shape))


@scratch_rule("cpu", aten._fft_c2r.default)
def _fft_c2r(args: tuple, kwargs: dict, out: Any) -> int:
    """_fft_c2r_mkl: over more than one dimension, a c2c over all but the last first (its complex
    output, input-sized, and that transform's own input copy), then the c2r over the last dimension
    of that output, with _exec_fft's copy of it where needed."""
    if not torch.backends.mkl.is_available():
        return 0  # pocketfft: not modelled
    x, dims = args[0], [d % args[0].dim() for d in args[1]]
    result = out.numel() * _itemsize(out.dtype)
    if len(dims) == 1:
        return _fft_input_copy(x, dims, list(out.shape))
    size = x.numel() * _itemsize(x.dtype)
    first_copies, strides = _exec_fft(x.shape, x.stride(), dims[:-1], list(x.shape))
    last_copies, _ = _exec_fft(x.shape, tuple(strides), dims[-1:], list(out.shape))
    peak = max(size + (size if first_copies else 0), size + result + (size if last_copies else 0))
    return peak - result


@scratch_rule("cpu", aten.native_dropout_backward.default)
def _native_dropout_backward(args: tuple, kwargs: dict, out: Any) -> int:
    """Dropout.cpp native_dropout_backward: `grad_output * mask * scale`: the bool mask converted to the
    gradient's dtype (freed after the first product), then the scale a wrapped double, converted."""
    grad = args[0]
    size = _itemsize(grad.dtype)
    return grad.numel() * size + 8 + (0 if grad.dtype == torch.float64 else size)


# --------------------------------------------------------------------------------------------------
# CUDA


@scratch_rule("cuda", aten.sum.dim_IntList, aten.sum.default, aten.nansum.default, aten.prod.default,
              aten.prod.dim_int, aten.mean.dim, aten.mean.default)
def _cuda_reduction_input_copy(args: tuple, kwargs: dict, out: Any) -> int:
    """ReduceOpsUtils.h make_reduction_from_out_ty, which CUDA reductions take too (ReduceOps.cpp
    sum_out, mean_out's non-CPU branch): the input is reduced in the output dtype through
    `self.to(in_dtype)`, except fp16/bf16 reduced into float32 (gpu_lowp_to_f32). This is the copy
    only: the reduce kernel's own staging buffer (Reduce.cuh, for reductions it splits across blocks)
    is not stated here."""
    self = args[0]
    if self.dtype in _REDUCED and out.dtype == torch.float32:
        return 0
    return _reduction_input_copy(self, out.dtype)


# --------------------------------------------------------------------------------------------------
# Linear algebra (LAPACK through MKL: aten/src/ATen/native/BatchLinearAlgebra.cpp,
# BatchLinearAlgebraKernel.cpp; matrix_exp and pinv: LinearAlgebra.cpp). `batch` is the product of the
# batch dimensions (1 for a 2-D input). LAPACK's workspaces are `at::empty({lwork})` sized by LAPACK's
# own workspace query, which MKL answers by its blocking (sgeev asks for far more than dgeev): they are
# measured once per (op, n, dtype) on an n x n identity (_lapack_workspace).


def _matrices(a: torch.Tensor) -> tuple[int, int, int]:
    """(batch, rows, columns) of a batch of matrices."""
    return a.numel() // max(1, a.shape[-2] * a.shape[-1]), a.shape[-2], a.shape[-1]


def _real_itemsize(dtype: torch.dtype) -> int:
    return _itemsize(dtype.to_real()) if dtype.is_complex else _itemsize(dtype)


@scratch_rule("cpu", aten._linalg_check_errors.default)
def _linalg_check_errors(args: tuple, kwargs: dict, out: Any) -> int:
    """BatchLinearAlgebra.cpp _linalg_check_errors: `infos.any().item<bool>()`: the bool result and
    the bool copy of the int32 infos (ReduceOps.cpp allany_impl)."""
    return 1 + args[0].numel()


def _pivots_checks(batch: int, n: int) -> int:
    """BatchLinearAlgebraKernel.cpp lu_solve_kernel checks the pivots' range (`pivots > 0`, `pivots <= n`
    and `.all()`), one after the other: a wrapped int64 bound and its int32 copy, a bool per pivot."""
    return 8 + 4 + batch * n


@scratch_rule("cpu", aten._linalg_solve_ex.default)
def _linalg_solve_ex(args: tuple, kwargs: dict, out: Any) -> int:
    """_linalg_solve_ex_out factors A into the LU output and runs linalg_lu_solve into the result: the
    pivots' checks only."""
    batch, _, n = _matrices(args[0])
    return _pivots_checks(batch, n)


@scratch_rule("cpu", aten.linalg_inv_ex.default)
def _linalg_inv_ex(args: tuple, kwargs: dict, out: Any) -> int:
    """linalg_inv_ex_out: the identity in the result, then linalg_solve_ex_out(result, A, result), whose
    LU (a copy of A) and int32 pivots are its own; then the pivots' checks (and _linalg_check_errors'
    few bytes once they are freed)."""
    a = args[0]
    batch, _, n = _matrices(a)
    return a.numel() * _itemsize(a.dtype) + 4 * batch * n + _pivots_checks(batch, n)


@scratch_rule("cpu", aten.lu_unpack.default)
def _lu_unpack(args: tuple, kwargs: dict, out: Any) -> int:
    """lu_unpack_out with unpack_pivots: `perm = at::arange(m, kLong).expand(batch + (m,)).contiguous()`:
    the arange, and its batched copy while both live (no copy without a batch of more than one)."""
    lu, unpack_pivots = args[0], _argument(args, kwargs, 3, "unpack_pivots", True)
    if not unpack_pivots:
        return 0
    batch, m, _ = _matrices(lu)
    return 8 * m + (8 * batch * m if lu.shape[:-2].numel() > 1 else 0)


@scratch_rule("cpu", aten._linalg_svd.default)
def _linalg_svd(args: tuple, kwargs: dict, out: Any) -> int:
    """linalg_svd_out -> svd_stub (apply_svd, gesdd): it works on `cloneBatchedColumnMajor(A)` and
    writes one int32 info per matrix (gesdd's work and iwork are std::vectors, not the allocator's)."""
    a = args[0]
    batch, _, _ = _matrices(a)
    return a.numel() * _itemsize(a.dtype) + 4 * batch


def _one_matrix_scratch(func: Any, like: torch.Tensor, *flags: Any) -> int:
    """The scratch of `func(eye(n), *flags)` for one n x n matrix of `like`'s dtype, measured once
    (probe_scratch): LAPACK's workspace (batch-independent: allocated once for the batch) plus the
    per-matrix buffers of one matrix."""
    n = like.shape[-1]

    def identity(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return (torch.eye(n, dtype=like.dtype), *args[1:]), kwargs

    return probe_scratch(func, (like.new_empty((n, n)), *flags), {}, prepare=identity)


@scratch_rule("cpu", aten._linalg_eigh.default)
def _linalg_eigh(args: tuple, kwargs: dict, out: Any) -> int:
    """_linalg_eigh_out -> linalg_eigh_stub (apply_lapack_eigh, syevd): one work and one iwork buffer
    for the batch (sized by LAPACK's query) and an int32 info per matrix; without eigenvectors the
    kernel works on a column-major copy of A instead of in the eigenvectors output."""
    a = args[0]
    uplo, compute_v = _argument(args, kwargs, 1, "UPLO", "L"), _argument(args, kwargs, 2, "compute_v", True)
    batch, _, n = _matrices(a)
    if a.numel() == 0:
        return 0
    per_matrix = 4 + (0 if compute_v else n * n * _itemsize(a.dtype))
    return _one_matrix_scratch(aten._linalg_eigh.default, a, uplo, compute_v) + (batch - 1) * per_matrix


def _geev_per_matrix(a: torch.Tensor, vectors: bool) -> int:
    """BatchLinearAlgebra.cpp linalg_eig_out_info for a real A: a column-major copy of A, the real and
    imaginary parts of the eigenvalues (`real_imag_values`, 2n real), with vectors the real eigenvectors
    (`maybe_complex_vectors`, n x n) before they are made complex, and an int32 info."""
    _, _, n = _matrices(a)
    size = _itemsize(a.dtype)
    return 4 + 2 * n * size + n * n * size * (2 if vectors else 1)


def _eig(func: Any, vectors: bool) -> ScratchFormula:
    """linalg_eig / linalg_eigvals (geev): geev's work buffer once for the batch, the rest per matrix
    (the input's isfinite check before it is smaller than the outputs). Complex inputs are measured
    for one matrix and scaled (not read off the source)."""

    def formula(args: tuple, kwargs: dict, out: Any) -> int:
        a = args[0]
        batch, _, _ = _matrices(a)
        if a.numel() == 0:
            return 0
        one = _one_matrix_scratch(func, a)
        per_matrix = one if a.is_complex() else _geev_per_matrix(a, vectors)
        return one + (batch - 1) * per_matrix

    return formula


scratch_rule("cpu", aten.linalg_eig.default)(_eig(aten.linalg_eig.default, vectors=True))
scratch_rule("cpu", aten.linalg_eigvals.default)(_eig(aten.linalg_eigvals.default, vectors=False))


@scratch_rule("cpu", aten.linalg_pinv.atol_rtol_tensor)
def _linalg_pinv(args: tuple, kwargs: dict, out: Any) -> int:
    """LinearAlgebra.cpp linalg_pinv: get_atol_rtol makes 0-dim double tolerances for those not given;
    `[U, S, V] = input.svd()` (or `linalg_eigh` when hermitian, with `S.abs()` and its amax); `tol =
    max(atol.unsqueeze(-1), rtol.unsqueeze(-1) * max_val)` (promoted with the 1-dim tolerances: double
    by default); `where(S > tol, S.reciprocal(), zeros({}))` (S converted to tol's dtype for the
    comparison, a bool mask); then `matmul(V * S_pseudoinv.unsqueeze(-2), U.mH())`: the scaled V and
    the result, with the factors still alive."""
    a = args[0]
    atol, rtol = _argument(args, kwargs, 1, "atol", None), _argument(args, kwargs, 2, "rtol", None)
    hermitian = _argument(args, kwargs, 3, "hermitian", False)
    if a.numel() == 0:
        return 0
    batch, m, n = _matrices(a)
    k = min(m, n)
    size, real = _itemsize(a.dtype), _real_itemsize(a.dtype)
    tolerances = sum(8 for t in (atol, rtol) if t is None)
    tol_dtype = a.dtype.to_real() if a.dtype.is_complex else a.dtype
    for t in (atol, rtol):
        tol_dtype = _promote_types(tol_dtype, torch.float64 if t is None else t.dtype)
    tol = batch * _itemsize(tol_dtype)
    values = batch * k * real
    if hermitian:
        factors = batch * n * n * size + values  # eigenvectors U, eigenvalues S
        decomposing = factors + _linalg_eigh((a, "L", True), {}, None)
        factors += values + batch * real  # S.abs(), its amax
    else:
        factors = batch * (m * k + k * n) * size + values  # U, Vh, S
        decomposing = factors + _linalg_svd((a,), {}, None)
    comparison = batch * k * _itemsize(tol_dtype) if tol_dtype != a.dtype else values
    selecting = factors + tol + real + values + comparison + batch * k
    result = batch * n * m * size
    multiplying = factors + tol + values + batch * n * k * size + result
    return tolerances + max(decomposing, selecting, multiplying) - result


@scratch_rule("cpu", aten.linalg_matrix_exp.default)
def _linalg_matrix_exp(args: tuple, kwargs: dict, out: Any) -> int:
    """LinearAlgebra.cpp mexp_impl. A batch of more than one matrix always takes the degree-18 Taylor
    approximation with scaling and squaring (compute_T18_scale_square): the 1-norms, `s` and `2^-s`
    (one real each per matrix), the scaled input, compute_T18's five powers `As` and
    `_compute_linear_combination(As, bs)`'s five (the peak, before the squarings). One matrix picks its
    degree by its norm, which a trace does not know: the largest branch is counted (an upper bound),
    degree 18 on `index_select`ed copies, below `res` (the NaN-filled result): two matrices more, and
    the large-norm indices (int64) and norms."""
    a = args[0]
    batch, _, n = _matrices(a)
    if n <= 1 or batch == 0:  # a clone, or exp()
        return 0
    matrix_bytes = batch * n * n * _itemsize(a.dtype)
    real = _real_itemsize(a.dtype)
    if batch > 1:
        return 10 * matrix_bytes + 3 * batch * real
    return 12 * matrix_bytes + 8 + 4 * real
