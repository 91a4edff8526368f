"""Trace a training step under fake tensors: every aten op, every storage it allocates, and the
moment eager PyTorch frees it.

The step of memplan/step.py runs for real under `FakeTensorMode`, so no weight or activation memory
is allocated. A dispatch mode above the fake mode sees each aten op; an output storage that no input
shares is a new allocation, and a weak reference to it fires exactly when eager PyTorch would free it
(when the last Python or autograd reference goes). That is what makes the trace match the allocator:
outputs that Python holds (logits, the loss) live as long as they really do, not merely until their
last use in the graph.

What the trace cannot see, the rules of the target device add: scratch that kernels allocate inside
themselves (`memplan.devices`), CUDA's optimizer defaults and autocast op lists.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import random
import sys
import types
import weakref
import zlib
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any
from unittest import mock

import networkx as nx
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch._prims_common import is_non_overlapping_and_dense_or_false
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, _BypassDispatchCache
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten
from torch.utils.checkpoint import SAC_IGNORED_OPS
from torch.utils.flop_counter import flop_registry
from torch.utils.weak import WeakTensorKeyDictionary

from memplan.eager_backward import EAGER_BACKWARDS
from memplan.errors import BadInput
from memplan.scratch import as_saved_number
from memplan.step import PreparedStep, StepConfig, memory_parts, model_caches_emptied_after, prepare_step, run_steps
from memplan.workload import Workload

ROLES = ("weights", "gradients", "optimizer_state", "activations", "temporaries", "inputs")

# Metadata queries (prim.device, aten.size, ...): a fake tensor, being a tensor subclass, sends them through
# the mode where a plain tensor answers them in C++. They allocate and compute nothing, and torch's selective
# checkpointing ignores them too, so they are answered and not recorded (two in three dispatches of a step).
_METADATA_QUERIES = SAC_IGNORED_OPS - {torch.ops.aten.detach.default}

# torch.unique and unique_consecutive: over unknown values, every element (or slice along `dim`) is taken
# to be distinct (an upper bound)
_UNIQUE = {torch.ops.aten._unique2.default, torch.ops.aten._unique.default, torch.ops.aten.unique_dim.default,
           torch.ops.aten.unique_consecutive.default, torch.ops.aten.unique_dim_consecutive.default}
# Ops whose output shape depends on data. Exact where their operands' values are known (see
# `_Recorder.known`); otherwise every element is selected (an upper bound), the selection's values are
# known where the operands' are (nonzero's: every index of its input, in order), and the estimate is
# marked approximate, naming the op. bincount, an exception to the upper bound, takes `minlength`
# bins (or one per element without it); repeat_interleave without `output_size`, another, repeats each
# index once, as each unknown count reads 1.
_DATA_DEPENDENT = {torch.ops.aten.nonzero.default, torch.ops.aten.masked_select.default,
                   torch.ops.aten.bincount.default, torch.ops.aten.repeat_interleave.Tensor, *_UNIQUE}
# Kernels whose internal scratch depends on the values, for the calls where it does (op -> the test):
# one matrix's exponential takes its Taylor degree by the matrix's norm, which a trace does not know
# (a batch takes degree 18 whatever the norm; parametrizations.orthogonal runs one). The scratch rule
# counts the largest branch, so the estimate says approximate and names the op (an upper bound).
_SCRATCH_BY_VALUES: dict[Any, Callable[[tuple], bool]] = {
    torch.ops.aten.linalg_matrix_exp.default: lambda args: args[0].shape[:-2].numel() <= 1,
}
# Kernels whose internal scratch follows an integer operand's values, which their scratch rule is
# handed as a real tensor where the trace knows them (else the rule bounds it, and the estimate says
# approximate): _grouped_mm's groups end at `offs` (one matmul per expert).
_SCRATCH_READS_VALUES = {torch.ops.aten._grouped_mm.default}
# Advanced indexing by a bool (or uint8) mask, `x[mask]` and `x[mask] = v`: eager's kernels replace each mask
# by the indices of its true elements (aten/src/ATen/native/IndexingUtils.h expandTensors: `mask.nonzero()`,
# held for the op), which the fake kernels do too, below the recorder, where a data-dependent shape fails.
# The recorder does that replacement itself, through `_data_dependent`'s nonzero.
_MASK_INDEXED = {torch.ops.aten.index.Tensor, torch.ops.aten.index_put.default, torch.ops.aten.index_put_.default,
                 torch.ops.aten._index_put_impl_.default}
# Backward formulas (torch/csrc/autograd/FunctionsManual.cpp) that write the gradient into a fresh zeros
# tensor in place, but out of place when any operand is a tensor subclass (`areAnyTensorSubclassLike`, as
# fake tensors are): value_selecting_reduction_backward (sort, topk, kthvalue, median, max.dim: `scatter_`),
# gather_backward (`scatter_add_`), index_backward (advanced indexing: `_index_put_impl_`) and
# index_select_backward (`index_add_`).
_BACKWARD_IN_PLACE = {torch.ops.aten.scatter.src, torch.ops.aten.scatter_add.default, torch.ops.aten.index_put.default,
                      torch.ops.aten.index_add.default}
# Elements of a traced tensor whose values the recorder keeps (integer and bool tensors only)
_KNOWN_LIMIT = 1 << 16
# elements a build draws on stand-ins to move the generators on (_RealValues.advance): all draws, and one
ADVANCE_LIMIT, ADVANCE_DRAW_LIMIT = 1 << 26, 1 << 24


def _ctc_loss_outputs(log_probs: torch.Tensor, targets: torch.Tensor, input_lengths: Any, target_lengths: Any,
                      *_: Any, known: Callable[[Any], Any], **__: Any) -> tuple[tuple[torch.Tensor, torch.Tensor], bool]:
    """aten._ctc_loss: (neg_log_likelihood (batch,), log_alpha (batch, T, 2 * max_target_length + 1)),
    as LossCTC.cpp and LossCTC.cu allocate them. Fake tensors refuse it: the longest target is read
    from the lengths, for padded 2-D targets as for concatenated 1-D ones (LossCTC.cpp takes the
    largest length, not the padded width): integer-list lengths and tensor lengths whose values are
    known (`known`) give it exactly; other tensor lengths are bounded by the padded width (2-D) or by
    all the targets (1-D)."""
    lengths = known(target_lengths) if isinstance(target_lengths, torch.Tensor) else None
    if isinstance(target_lengths, (list, tuple)):
        longest, exact = max(target_lengths, default=0), True
    elif lengths is not None:
        with _disable_current_modes():
            longest, exact = int(lengths.max()) if lengths.numel() else 0, True
    else:
        longest, exact = targets.shape[-1], False
    batch = log_probs.shape[1]
    nll = torch.empty((batch,), dtype=log_probs.dtype, device=log_probs.device)
    log_alpha = torch.empty((batch, log_probs.shape[0], 2 * longest + 1), dtype=log_probs.dtype, device=log_probs.device)
    return (nll, log_alpha), exact


def _grouped_mm_outputs(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor | None = None,
                        bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                        **_: Any) -> tuple[torch.Tensor, bool]:
    """aten._grouped_mm (transformers' mixture-of-experts layers, forward and backward): its meta
    kernel holds CUDA's checks and refuses any dtype but bf16, while the CPU kernel takes fp32 too.
    The output as both allocate it (torch's own _create_grouped_mm_output_tensor: CPU builds do not
    pad the rows); bf16 still goes through the fake kernel, checks included."""
    if mat_a.dtype == torch.bfloat16 and mat_b.dtype == torch.bfloat16:
        return torch.ops.aten._grouped_mm.default(mat_a, mat_b, offs, bias, out_dtype), True
    from torch._meta_registrations import _create_grouped_mm_output_tensor

    return _create_grouped_mm_output_tensor(mat_a, mat_b, offs, out_dtype), True


def _pack_padded_sequence_outputs(input: torch.Tensor, lengths: torch.Tensor, batch_first: bool, *,
                                  known: Callable[[Any], Any]) -> tuple[tuple[torch.Tensor, torch.Tensor], bool]:
    """aten._pack_padded_sequence: (data (Σ lengths, *features), batch_sizes (longest,) int64 on the CPU).
    The packed RNNs and their backward read batch_sizes through its data pointer (RNN.cpp,
    PackedSequence.cpp), which a fake tensor has not, so batch_sizes is a real tensor: exact from
    known lengths, else every sequence at full length (an upper bound)."""
    values = known(lengths)
    batch, steps = (input.shape[0], input.shape[1]) if batch_first else (input.shape[1], input.shape[0])
    with _disable_current_modes():
        lengths_of = values.tolist() if values is not None else [steps] * batch
        batch_sizes = torch.tensor([sum(1 for n in lengths_of if n > t) for t in range(max(lengths_of, default=0))],
                                   dtype=torch.int64)
    return (input.new_empty((sum(lengths_of), *input.shape[2:])), batch_sizes), values is not None


def _lstsq_outputs(input: torch.Tensor, other: torch.Tensor, rcond: float | None = None, *, driver: str | None = None,
                   known: Callable[[Any], Any]) -> tuple[tuple[torch.Tensor, ...], bool]:
    """aten.linalg_lstsq: (solution, residuals, rank, singular_values) as BatchLinearAlgebra.cpp's
    linalg_lstsq_out_info allocates them. The solution is LAPACK's working copy of `other`, batched
    column-major with max(m, n) rows, narrowed to its first n (the rows below hold the raw
    residuals). residuals (*, nrhs), summed from those rows, exist only where m > n and the driver is
    not gelsy (the CPU default; gels is CUDA's): gelsd and gelss compute them only when every matrix
    has full rank n, a value no one knows while tracing: assumed, as almost every real matrix has it,
    and said approximate. rank (*) is set by all drivers but gels, singular_values (*, min(m, n)) by
    gelsd and gelss; each is (0,) otherwise."""
    driver = (driver or ("gels" if input.device.type == "cuda" else "gelsy")).lower()
    vector = other.dim() == 1 or (other.dim() == input.dim() - 1 and other.shape == input.shape[:-1])
    other_2d = other.unsqueeze(-1) if vector else other
    m, n, nrhs = input.shape[-2], input.shape[-1], other_2d.shape[-1]
    batch = tuple(torch.broadcast_shapes(input.shape[:-2], other_2d.shape[:-2]))
    real = input.real.dtype if input.is_complex() else input.dtype
    if vector:
        solution = input.new_empty((*batch, max(m, n))).narrow(-1, 0, n)
    else:
        solution = input.new_empty((*batch, nrhs, max(m, n))).transpose(-2, -1).narrow(-2, 0, n)
    with_residuals = m > n and driver != "gelsy"
    residuals = input.new_empty((*batch, nrhs) if with_residuals else (0,), dtype=real)
    rank = input.new_empty(input.shape[:-2] if driver != "gels" else (0,), dtype=torch.long)
    singular = input.new_empty((*input.shape[:-2], min(m, n)) if driver in ("gelsd", "gelss") else (0,), dtype=real)
    return (solution, residuals, rank, singular), not (with_residuals and driver in ("gelsd", "gelss"))


# Ops whose fake kernel refuses to run (DynamicOutputShapeException, or checks of another device's
# kernel) but whose output shapes the arguments give exactly or bound: (args, kwargs, known=the real
# value of a tensor argument, None where unknown) -> ((outputs), exact). Not exact: the estimate says
# approximate.
_SHAPE_FROM_ARGUMENTS: dict[Any, Callable[..., tuple[Any, bool]]] = {
    torch.ops.aten._ctc_loss.default: _ctc_loss_outputs,
    torch.ops.aten._ctc_loss.Tensor: _ctc_loss_outputs,
    torch.ops.aten._grouped_mm.default: _grouped_mm_outputs,
    torch.ops.aten._pack_padded_sequence.default: _pack_padded_sequence_outputs,
    torch.ops.aten.linalg_lstsq.default: _lstsq_outputs,
}
# Writes to its `found_inf` argument: reading it back (GradScaler) must say "no overflow".
_FOUND_INF_WRITERS = {torch.ops.aten._amp_foreach_non_finite_check_and_unscale_.default}


@dataclass(frozen=True)
class Op:
    """One aten op as eager PyTorch runs it."""

    index: int
    name: str  # "aten.mm.default"
    phase: str  # "forward", "backward", "optimizer"
    step: int
    module: str  # innermost module path running it ("" for the top level)
    flops: int
    reads: tuple[int, ...]  # storage ids of its tensor inputs, in argument order
    writes: tuple[int, ...]  # storage ids its schema says it mutates in place (add_, relu_, copy_, ...)
    allocates: tuple[int, ...]  # storage ids it creates
    scratch_bytes: int  # kernel-internal scratch, allocated and freed inside the op (device rule)
    # an out-of-place op that eager PyTorch does in place into its first operand, which the tracer
    # sees out of place because fake tensors are tensor subclasses: autograd's gradient accumulation
    # (_is_grad_accumulation), the adds of _IN_PLACE_ADDS (_is_in_place_add) and the backward
    # formulas of _BACKWARD_IN_PLACE (_is_backward_in_place)
    accumulates_in_place: bool = False
    variant: str = ""  # a non-tensor argument that changes its cost (see _COST_VARIANTS); "" by default


def _rnn_layer_flops(input: torch.Tensor, w_ih: torch.Tensor, w_hh: torch.Tensor, *_) -> int:
    """One RNN layer's forward: the input and hidden matrix products at every step, 2 FLOPs per multiply-add."""
    return 2 * (input.numel() // input.shape[-1]) * (w_ih.numel() + w_hh.numel())


def _grouped_mm_flops(a: torch.Tensor, b: torch.Tensor, *_) -> int:
    """aten._grouped_mm (mixture-of-experts layers): each group's rows of `a` times its matrix of `b`, 2 FLOPs
    per multiply-add. Both 2-d: the groups split the shared dimension (a weight's gradient), each group
    one (rows, columns) output; both 3-d: a batch of products; otherwise the groups split the rows of
    `a` (2-d) or the columns of `b` (2-d), and every product reaches the output once."""
    if a.dim() == 2 and b.dim() == 2:
        return 2 * a.shape[0] * a.shape[1] * b.shape[1]
    if a.dim() == 3 and b.dim() == 3:
        return 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]
    return 2 * a.shape[-2] * a.shape[-1] * b.shape[-1]


# Keyword arguments that change what an op costs per element, not what it allocates: its Op.variant,
# which memplan.timing prices by ("" for the default). GELU's tanh form is 3.5x its erf form on a CPU.
_COST_VARIANTS: dict[Any, Callable[[dict], str]] = {
    torch.ops.aten.gelu: lambda kwargs: "" if kwargs.get("approximate", "none") == "none" else kwargs["approximate"],
}

# FLOP formulas for ops that torch.utils.flop_counter has none for, by the same convention (its registry first)
MORE_FLOPS = {
    torch.ops.aten.mkldnn_rnn_layer: _rnn_layer_flops,
    # gradients of the input and of both weights: twice the forward's products
    torch.ops.aten.mkldnn_rnn_layer_backward: lambda *args: 2 * _rnn_layer_flops(*args),
    torch.ops.aten._grouped_mm: _grouped_mm_flops,
}


@dataclass(frozen=True)
class Storage:
    id: int
    nbytes: int
    role: str  # one of ROLES
    allocated_by: int | None  # op index; None: live before the step began
    module: str  # module path of the op that allocated it


@dataclass(frozen=True)
class ModuleCall:
    """One forward call of a submodule, as the planner needs it."""

    path: str
    type_name: str
    phase: str
    step: int
    first_op: int  # ops [first_op, end_op) ran inside the call
    end_op: int
    inputs: tuple[int, ...]  # storage ids of its tensor arguments
    outputs: tuple[int, ...]
    # its arguments after the first, as a checkpointed run hands them to each member (memplan.emit):
    # positional ones, then (keyword, value); a tensor by its storage, a plain constant by value, any
    # other object by identity
    arguments: tuple = ()
    # identities of its first positional argument and of its output (0: none): a run's next member
    # must be handed this output itself, not a part of it (`x = layer(x)[0]`)
    first_argument: int = 0
    output_object: int = 0
    # when its forward pre-hook and forward hook ran, counted over all module hooks of the trace: one call
    # is inside another exactly when it opens after and closes before it (op ranges cannot tell where a
    # call that runs no op belongs: an identity Dropout right after its sibling, a wrapper and its child)
    opened: int = 0
    closed: int = 0
    # the type of an argument object (not a tensor) into which the call stored tensors it made: a
    # transformers Cache appending its keys and values ("" where none): recomputed, it would store
    # them again (a cache twice as long), so the call cannot be checkpointed
    stores_into: str = ""
    # the module's own attribute (not a parameter or buffer) that the call set to another object or in
    # which it kept a tensor it made ("" where none): RecurrentGemma's recurrent state, a call counter,
    # a lazily built cache (see Trace.stateful_modules)
    keeps: str = ""
    # the host generator ("random", "numpy.random"; "" where none) the call drew from before it seeded it,
    # if it did (see Trace.host_random_modules)
    draws_from: str = ""


@dataclass(frozen=True)
class Event:
    """One entry of the allocation timeline, in the order eager PyTorch does it."""

    kind: str  # "alloc", "free", "scratch" (an op's kernel-internal bytes, freed inside it), "phase"
    storage: int = -1
    nbytes: int = 0  # scratch bytes
    op: int = -1  # alloc: the op; free: the last op that ran before it
    phase: str = ""
    step: int = -1


@dataclass(frozen=True)
class Trace:
    ops: tuple[Op, ...]
    storages: dict[int, Storage]
    events: tuple[Event, ...]
    calls: tuple[ModuleCall, ...]
    module_types: dict[str, str]  # path -> class name, for every submodule
    approximate_ops: tuple[str, ...]  # ops whose data-dependent results were assumed (see policy)
    # op index -> tensors autograd saved (each passes the saved-tensor hooks once), counted at the op
    # recorded last when they were saved: an op's outputs at itself (or a helper op it ran), its inputs,
    # saved before it runs, at the op before it. Sum over op ranges.
    saved_tensors: dict[int, int] = field(default_factory=dict)
    # op index -> the clock of ModuleCall.opened and .closed at the first of those saves: a save counted
    # at a module's last op is that op's (an output, before the module closes) or the next op's (an input)
    first_save_clock: dict[int, int] = field(default_factory=dict)
    # storage id -> when autograd saved it through the saved-tensor hooks, by the clock of
    # ModuleCall.opened and .closed: a checkpoint around the call saving it would drop and recompute it
    saved_at: dict[int, tuple[int, ...]] = field(default_factory=dict)
    parameters: frozenset[int] = frozenset()  # the storages of the model's parameters (not its buffers)

    def early_stop(self, first_op: int, end_op: int, closed: int) -> int:
        """The last of ops [first_op, end_op), a checkpointed segment's forward whose last module closed at
        `closed`, that recomputation runs again (first_op - 1: none). Non-reentrant checkpointing stops
        at the last tensor the forward saved for backward. An op saves its inputs before it runs (mm: a
        segment ending in a Linear runs its matmul no more) and its outputs after (relu, layer norm's
        statistics: it runs); a save is counted at the op recorded before it, so one counted at the last
        op is that op's own only if made before its module closed."""
        last = end_op - 1
        return max((i for i in range(first_op, end_op) if self.saved_tensors.get(i)
                    and (i < last or self.first_save_clock.get(i, closed) <= closed)), default=first_op - 1)

    @functools.cached_property
    def stateful_modules(self) -> dict[str, str]:
        """Modules that change an attribute of theirs at every call (ModuleCall.keeps), path -> attribute:
        recomputed, such a module would read a state its forward changed. Calls after the first step tell
        them from a cache built once (the first step's first call builds it, later calls only read it)."""
        return {c.path: c.keeps for c in self._last_forward_calls if c.keeps}

    @functools.cached_property
    def host_random_modules(self) -> dict[str, str]:
        """Modules that draw from a host generator (ModuleCall.draws_from) at every call, path -> generator:
        checkpointing restores only torch's generators, so their recomputation would draw other numbers.
        A call that seeds the generator before it draws (BigBird's block-sparse attention:
        `np.random.seed(seed)`) draws the same numbers again and is not counted; nor, as for
        stateful_modules, is a call that draws only in the first step."""
        return {c.path: c.draws_from for c in self._last_forward_calls if c.draws_from}

    @functools.cached_property
    def rerun_in_backward(self) -> frozenset[str]:
        """Modules called again in backward without a plan: the model checkpoints them itself."""
        return frozenset(c.path for c in self.calls if c.phase == "backward")

    @functools.cached_property
    def _last_forward_calls(self) -> tuple[ModuleCall, ...]:
        last = max((c.step for c in self.calls), default=0)
        return tuple(c for c in self.calls if c.phase == "forward" and c.step == last)

    def first_forward_call(self, path: str) -> ModuleCall:
        """The first call of module `path` in step 0's forward (what the planners profile a block by)."""
        return min((c for c in self.calls if c.phase == "forward" and c.step == 0 and c.path == path),
                   key=lambda c: c.first_op)

    def graph(self) -> nx.DiGraph:
        """Ops as nodes, an edge from the op that allocated a storage to each op that reads it."""
        g = nx.DiGraph()
        producer: dict[int, int] = {}
        for op in self.ops:
            g.add_node(op.index, op=op)
            for sid in op.reads:
                if sid in producer and producer[sid] != op.index:
                    g.add_edge(producer[sid], op.index, storage=sid)
            for sid in op.allocates:
                producer[sid] = op.index
        return g


# A device's hooks into tracing: extra scratch bytes per op, and how autocast behaves.
ScratchRule = Callable[[Any, tuple, dict, Any], int]


@dataclass(frozen=True)
class TraceRules:
    scratch: Callable[[Any, tuple, dict, Any], int] = lambda func, args, kwargs, out: 0
    foreach: bool | None = None  # the optimizer's foreach flag (None: torch's default for CPU tensors)
    autocast: Callable[[str, torch.dtype], contextlib.AbstractContextManager] | None = None
    # corrects an op's fake outputs where its fake kernel allocates differently from the real one
    fix_outputs: Callable[[Any, tuple, dict, Any], Any] = lambda func, args, kwargs, out: out
    # a context standing in for device-specific kernel choices (e.g. CUDA's fused attention)
    function_mode: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    # eager's error where the device has no kernel for an op's dtypes (memplan.cpu_kernels), else None
    missing_kernel: Callable[[Any, tuple, dict], str | None] = lambda func, args, kwargs: None


def _eager_view_strides(old_shape: tuple[int, ...], old_stride: tuple[int, ...],
                        new_shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """The strides eager's view gives (aten/src/ATen/TensorUtils.cpp at::detail::computeStride); None
    where it would refuse. Fake mode's view (torch._refs) strides size-1 dimensions its own way, and a
    size-1 dimension's stride decides memory-format choices: eager viewed SegFormer's (1, 16, 64)
    transposed tokens as (1, 16, 8, 8) with strides (16, 1, 128, 16), not channels-last, so its
    convolution wrote a contiguous output where fake mode's (1024, 1, 128, 16) made a channels-last one,
    and the layouts after it, and their copies, parted (20 KB over at SegFormer's forward peak)."""
    if not old_shape or math.prod(old_shape) == 0:
        return None
    new_stride = [0] * len(new_shape)
    view_d = len(new_shape) - 1
    chunk_base_stride, tensor_numel, view_numel = old_stride[-1], 1, 1
    for tensor_d in range(len(old_shape) - 1, -1, -1):
        tensor_numel *= old_shape[tensor_d]
        if tensor_d == 0 or (old_shape[tensor_d - 1] != 1
                             and old_stride[tensor_d - 1] != tensor_numel * chunk_base_stride):
            while view_d >= 0 and (view_numel < tensor_numel or new_shape[view_d] == 1):
                new_stride[view_d] = view_numel * chunk_base_stride
                view_numel *= new_shape[view_d]
                view_d -= 1
            if view_numel != tensor_numel:
                return None
            if tensor_d > 0:
                chunk_base_stride, tensor_numel, view_numel = old_stride[tensor_d - 1], 1, 1
    return tuple(new_stride) if view_d == -1 else None


_EAGER_VIEWS = {torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default}


def _as_eager_views(func: Any, args: tuple, out: Any) -> Any:
    """A view's fake output restrided as eager's (`_eager_view_strides`); anything else as it is."""
    if func not in _EAGER_VIEWS or not isinstance(out, torch.Tensor):
        return out
    strides = _eager_view_strides(tuple(args[0].shape), tuple(args[0].stride()), tuple(out.shape))
    if strides is None or strides == tuple(out.stride()):
        return out
    return torch.ops.aten.as_strided.default(out, out.shape, strides, out.storage_offset())


# what an unknown floating-point value reads as, while building and in the step: it changes no shape
UNKNOWN_FLOAT = 1.0

# Unknown values read back at one line of the program within one module call (a loop) before the
# estimate gives up: a loop that runs until a value says stop (an adaptive ODE solver: `while t < t1`,
# with `t` advanced by a step whose size comes from an error estimate; zuko's CNF rejecting every step
# whose error reads 1.0) never ends when every such value reads 1 or true
UNKNOWN_READS_LIMIT = 256


# The same line of the program reading unknown values back this many times within one module call is a
# loop steered by them (torchdiffeq's dopri5: `while next_t > t1` and `if accept_step` at every step; a
# check once per layer reads once per call): the number of its trips, and what they allocate, is a
# guess, and the estimate says so (approximate)
LOOP_READS = 3


def _reading_site() -> str | None:
    """The innermost frame outside torch and memplan: where the program read a value back. None where
    the step contract itself led to the read (memplan/step.py: the optimizer's step counters, the
    gradient scaler), which no data steers."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.endswith("/memplan/step.py"):
            return None
        if "/torch/" not in name and "/memplan/" not in name and "/contextlib" not in name:
            return f"{name.rsplit('/', 1)[-1]}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


class _Recorder(TorchDispatchMode):
    """Sees every aten op above the fake mode; records storages and their lifetimes."""

    def __init__(self, rules: TraceRules) -> None:
        super().__init__()
        self.rules = rules
        self.ids: weakref.WeakKeyDictionary[torch.UntypedStorage, int] = weakref.WeakKeyDictionary()
        self.counter = itertools.count()
        self.finalizers: dict[int, weakref.finalize] = {}  # storage id -> what records its free
        self.ops: list[Op] = []
        self.storages: dict[int, dict[str, Any]] = {}
        self.events: list[Event] = []
        self.phase, self.step, self.module_stack = "setup", -1, [""]
        self.found_inf: weakref.WeakSet[torch.UntypedStorage] = weakref.WeakSet()
        self.conversions = WeakTensorKeyDictionary()  # see _alias_conversions
        self.approximate: list[str] = []
        self.unknown_integers = 0  # integers read back from unknown values (each read as 1)
        # how many were read at one line of the program within one module call (see LOOP_READS)
        self.read_sites: Counter[tuple[str, str, int, int]] = Counter()  # (site, module, call, phase) -> reads
        self.call_opened = [0]  # the module hook count when each open module call began (module_stack's)
        self.phases_begun = 0  # (backward runs outside module calls: its reads count per phase begun)
        self.saved_numbers: defaultdict[int, list[Any]] = defaultdict(list)  # node's sequence number -> values
        # unknown bool tensors that test floating-point values (isnan, var < 0), and whole-tensor tests of
        # them: any() -> False (see _note_value_test)
        self.value_tests: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
        self.extremes: WeakTensorKeyDictionary = WeakTensorKeyDictionary()  # unknown min() and max(): their op
        self.holding: WeakTensorKeyDictionary = WeakTensorKeyDictionary()  # tests that typically hold (_note_value_test)
        # open calls of _IN_PLACE_ADDS' composites: (its rule, the added tensor's storage, the index of
        # the first op inside the call), innermost last; see _InPlaceScopes
        self.in_place_calls: list[tuple[_InPlaceAdd, torch.UntypedStorage, int]] = []
        self.saved_tensors: Counter[int] = Counter()  # op index -> tensors autograd saved for it
        self.first_save_clock: dict[int, int] = {}  # op index -> module_hooks at the first of them
        self.module_hooks = 0  # module hooks run so far: the clock of ModuleCall.opened and .closed
        self.saved_at: dict[int, set[int]] = defaultdict(set)  # storage id -> module_hooks when saved
        # autograd's sequence number when each op reached the tracer (below autograd: its node is made)
        self.sequence_nrs: list[int] = []
        # the autograd node whose backward ops run now, its adds taken for the engine's sums of gradients
        # so far (output storage -> op index), and the node each backward op ran in (see _engine_sum)
        self.engine_node: tuple[str, int] | None = None
        self.engine_sums: dict[int, int] = {}
        self.op_nodes: dict[int, tuple[str, int]] = {}
        # Values of the small tensors computed from constants and other known values alone (nonzero's
        # assumed selection, its rows, an index compared with a constant, a float mask made from a
        # constant one): reading them back (`if expert_idx == num_experts: continue`, Longformer's
        # `(mask > 0).any().item()`) takes the branch the values say.
        self.known = _RealValues(lambda t: not t.is_complex() and t.numel() <= _KNOWN_LIMIT, selections=True)
        self.sparse = _SparseTensors(self.known, self.approximate, rules, self._in_autograd_engine)

    # -- storages -------------------------------------------------------------------------------

    def register(self, tensor: torch.Tensor, role: str, op: int | None = None) -> int:
        return self._register_storage(tensor.untyped_storage(), role, op)

    def _register_storage(self, storage: torch.UntypedStorage, role: str, op: int | None) -> int:
        sid = self.ids.get(storage)
        if sid is None:
            sid = next(self.counter)
            self.ids[storage] = sid
            self.storages[sid] = {
                "nbytes": storage.nbytes(),
                "role": role,
                "op": op,
                "module": self.module_stack[-1],
            }
            self.finalizers[sid] = weakref.finalize(storage, self._freed, sid)
            if op is not None:
                self.events.append(Event("alloc", sid, op=op))
        return sid

    def _regrow(self, storage: torch.UntypedStorage, op: int) -> int:
        """A storage that op `op` grew (an `out=` tensor too small, `resize_`): eager allocates the new
        size, copies the old bytes over and frees the old block (c10/core/StorageImpl resize_bytes_cpu),
        so the op allocates a new storage and frees the old one after."""
        old = self.ids.pop(storage)
        self.finalizers.pop(old).detach()
        sid = self._register_storage(storage, self.storages[old]["role"], op)
        self.events.append(Event("free", old, op=op))
        return sid

    def register_saved_number(self, tensor: torch.Tensor, sequence_nr: int) -> None:
        """A wrapped number autograd saved for the node numbered `sequence_nr` (_SavedWrappedNumbers):
        allocated with the op that made the node, freed when the node releases it."""
        op = next((i for i in range(len(self.ops) - 1, -1, -1) if self.sequence_nrs[i] <= sequence_nr), -1) + 1
        op = min(op, len(self.ops) - 1)
        sid = self.register(tensor, "activations")
        self.storages[sid]["op"] = op
        with _disable_current_modes():
            self.saved_numbers[sequence_nr].append(tensor.item())
        position = len(self.events)
        while position and self.events[position - 1].op is not None and self.events[position - 1].op > op:
            position -= 1
        self.events.insert(position, Event("alloc", sid, op=op))

    def _freed(self, sid: int) -> None:
        self.events.append(Event("free", sid, op=len(self.ops) - 1))

    def storages_of(self, tensors: list[Any]) -> list[torch.UntypedStorage]:
        """The storages holding `tensors`' memory, in order (a sparse tensor's: its parts'; a functorch
        wrapper's, inside torch.vmap or torch.func.grad: its tensor's)."""
        return [part.untyped_storage() for t in tensors if isinstance(t, torch.Tensor)
                for part in self.sparse.strided(_functorch_unwrapped(t))]

    def set_role(self, tensor: torch.Tensor, role: str) -> None:
        for storage in self.storages_of([tensor]):
            sid = self.ids.get(storage)
            if sid is not None and self.storages[sid]["role"] in ("temporaries", "activations"):
                self.storages[sid]["role"] = role

    def begin_phase(self, phase: str, step: int) -> None:
        self.phase, self.step = phase, step
        self.phases_begun += 1
        self.events.append(Event("phase", op=len(self.ops) - 1, phase=phase, step=step))

    # -- ops --------------------------------------------------------------------------------------

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func in _METADATA_QUERIES:
            return func(*args, **(kwargs or {}))  # allocate, compute and free nothing: not an op of the step
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            return self._scalar(args[0])
        if func is torch.ops.aten.equal.default:  # eager compares in place, allocating nothing
            return self._equal(*args)
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        refusal = _EAGER_REFUSALS[func](args, kwargs, inputs) if func in _EAGER_REFUSALS else None
        if refusal:
            raise RuntimeError(f"{func}: {refusal}")
        missing = self.rules.missing_kernel(func, args, kwargs)
        if missing:
            raise NotImplementedError(f"{func}: {missing}")
        self._alias_conversions(inputs)
        for operand, numel in _RESIZED_OPERANDS[func](args, kwargs) if func in _RESIZED_OPERANDS else ():
            operand.resize_(numel)
        written = _written_arguments(func, args, kwargs)
        sparse = any(t.layout is not torch.strided for t in inputs)
        read_storages = dict.fromkeys(self.storages_of(inputs))  # in argument order
        written_storages = self.storages_of(written)
        data_dependent = func in _DATA_DEPENDENT and kwargs.get("output_size") is None
        if func in _SCRATCH_BY_VALUES and _SCRATCH_BY_VALUES[func](args):
            self.approximate.append(str(func))
        indexed, mask_bytes = self._masks_as_indices(func, args) if func in _MASK_INDEXED else (args, 0)
        if func is torch.ops.aten.split_with_sizes.default:
            indexed = self._balanced_split(args)
        by_sparse_table = _by_sparse_table(func, args, kwargs, sparse)
        if by_sparse_table:
            out, sparse_scratch = _SPARSE_OPS[func](self.sparse, *args, **kwargs)
        elif data_dependent:
            out = self._data_dependent(func, args, kwargs)
        elif func in _SHAPE_FROM_ARGUMENTS:
            out, exact = _SHAPE_FROM_ARGUMENTS[func](*args, **kwargs, known=self.known.value)
            if not exact:
                self.approximate.append(str(func))
        else:
            out = self.rules.fix_outputs(func, indexed, kwargs,
                                         _as_eager_views(func, indexed, func(*indexed, **kwargs)))
        flat_out = tree_flatten(out)[0]
        sparse_out = any(isinstance(t, torch.Tensor) and t.layout is not torch.strided for t in flat_out)
        if (sparse_out or sparse and any(isinstance(t, torch.Tensor) for t in flat_out)) and not by_sparse_table:
            raise NotImplementedError(f"{func} with sparse tensors is not modelled")
        if not (data_dependent or sparse or sparse_out):  # (the sparse table keeps what is known of its parts)
            self.known.run(func, args, kwargs, flat_out, written)
        if func in _LINALG_INFOS and isinstance(flat_out[_LINALG_INFOS[func]], FakeTensor) \
                and flat_out[_LINALG_INFOS[func]] not in self.known:
            info = flat_out[_LINALG_INFOS[func]]
            with _disable_current_modes():
                self.known.keep([info], [torch.zeros(info.shape, dtype=info.dtype)])
        if func in _EXTREMES and isinstance(out, FakeTensor) and out.is_floating_point() and out not in self.known:
            self.extremes[out] = func
        if isinstance(out, FakeTensor) and out.dtype == torch.bool and out not in self.known:
            self._note_value_test(func, inputs, out)
        if func in _FOUND_INF_WRITERS:
            self.found_inf.add(args[1].untyped_storage())
        index = len(self.ops)
        self.sequence_nrs.append(torch._C._autograd._get_sequence_nr())
        reads = tuple(self.ids[s] for s in read_storages if s in self.ids)
        engine_sum = self._engine_sum(func, args, reads, index)
        in_place = engine_sum or self._is_in_place_add(func, args) or self._is_backward_in_place(func)
        writes = tuple(self.ids[s] for s in written_storages if s in self.ids)
        allocates = []
        for part in (p for t in flat_out if isinstance(t, torch.Tensor) for p in self.sparse.strided(t)):
            storage = part.untyped_storage()
            if storage not in self.ids and storage not in read_storages:
                allocates.append(self.register(part, "temporaries", index))
                if _wraps_foreign_memory(func, args):
                    self.storages[allocates[-1]]["nbytes"] = 0
        allocates += [self._regrow(storage, index) for storage in written_storages
                      if storage in self.ids and storage.nbytes() > self.storages[self.ids[storage]]["nbytes"]]
        if by_sparse_table:
            scratch = sparse_scratch
        else:
            operands, named = self._saved_numbers_marked(indexed, kwargs)
            if func in _SCRATCH_READS_VALUES:
                operands, named = self._with_known_integers(func, operands, named)
            scratch = int(self.rules.scratch(func, operands, named, out)) + mask_bytes
        if scratch:
            self.events.append(Event("scratch", op=index, nbytes=scratch))
        flops = 0
        if func._overloadpacket in flop_registry:
            flops = int(flop_registry[func._overloadpacket](*args, **kwargs, out_val=out))
        elif func._overloadpacket in MORE_FLOPS:
            flops = int(MORE_FLOPS[func._overloadpacket](*args))
        self.ops.append(
            Op(
                index=index,
                name=str(func),
                phase=self.phase,
                step=self.step,
                module=self.module_stack[-1],
                flops=flops,
                reads=reads,
                writes=writes,
                allocates=tuple(allocates),
                scratch_bytes=scratch,
                accumulates_in_place=in_place,
                variant=_COST_VARIANTS[func._overloadpacket](kwargs) if func._overloadpacket in _COST_VARIANTS else "",
            )
        )
        if engine_sum and len(allocates) == 1:
            self.engine_sums[allocates[0]] = index
        return out

    def _saved_numbers_marked(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """A backward op's arguments for the scratch rules, with the numbers its node saved in forward
        (`register_saved_number`) marked as such: their tensors are live already, where a number
        wrapped for the call would be allocated with it (MulBackward0's `grad * other`)."""
        node = torch._C._current_autograd_node() if self.saved_numbers else None
        saved = list(self.saved_numbers.get(node._sequence_nr(), ())) if node is not None else []
        if not saved:
            return args, kwargs

        def mark(value: Any) -> Any:
            if isinstance(value, (int, float)) and value in saved:
                saved.remove(value)
                return as_saved_number(value)
            return value

        return tuple(map(mark, args)), {name: mark(value) for name, value in kwargs.items()}

    def _engine_sum(self, func: Any, args: tuple, reads: tuple[int, ...], index: int) -> bool:
        """Whether op `index` is the engine's sum of two gradients of one tensor (_is_grad_accumulation),
        not an add of the backward formula of the node running (lu_factor's adds tril(...) + triu(...),
        pinv's returns a sum), which eager runs out of place as the trace does. The engine sums a
        node's gradient once the node has returned it, into one an earlier node made, or another of
        its own where two of its gradients go to one input (x * x). So an add that a later op of the
        node reads is the formula's (undone here), and so is one of a tensor the node made itself where
        each of its gradients goes elsewhere."""
        if not self._in_autograd_engine():
            return False
        current = torch._C._current_autograd_node()
        node = None if current is None else (current.name(), current._sequence_nr())
        self.op_nodes[index] = node
        if node != self.engine_node:
            self.engine_node, self.engine_sums = node, {}
        for sid in reads:
            if sid in self.engine_sums:
                op = self.ops[self.engine_sums.pop(sid)]
                self.ops[op.index] = replace(op, accumulates_in_place=False)
        if not self._is_grad_accumulation(func, args):
            return False
        first = self.ids.get(args[0].untyped_storage())
        made_by = self.storages[first]["op"] if first is not None else None
        if node is not None and made_by is not None and self.op_nodes.get(made_by) == node:
            edges = [(id(function), number) for function, number in current.next_functions if function is not None]
            return len(set(edges)) < len(edges)
        return True

    def _alias_conversions(self, inputs: list[torch.Tensor]) -> None:
        """A real tensor that the step made (the batch_sizes of _pack_padded_sequence_outputs) reaching a
        fake op is converted by the fake mode into a fake copy: that copy's storage is the real one's.
        The copy is kept while the real tensor lives, so that the fake mode's memo hands out the same one."""
        for t in inputs:
            if not isinstance(t, FakeTensor) and t.layout is torch.strided and t not in self.conversions \
                    and t.untyped_storage() in self.ids:
                from torch._guards import detect_fake_mode

                converted = self.conversions[t] = detect_fake_mode().from_tensor(t)
                self.ids[converted.untyped_storage()] = self.ids[t.untyped_storage()]

    def _is_grad_accumulation(self, func: Any, args: tuple = ()) -> bool:
        """The autograd engine sums two gradients of one tensor with `old.add_(new)` when it holds the
        last reference to `old` and to its storage, and `old` is non-overlapping and dense
        (input_buffer.cpp, can_accumulate_inplace); a fake tensor is a tensor subclass, so under
        tracing the engine takes the out-of-place branch `old + new` instead. Such an add runs in
        backward, outside any module (a recomputed forward runs inside one), with grad mode off.
        A view (the transposed weight gradient of a linear layer tied to an embedding) shares its
        storage with its base, which it keeps alive: eager sums it out of place as well."""
        if not (func is torch.ops.aten.add.Tensor and self._in_autograd_engine()):
            return False
        old = args[0] if args else None
        return not (isinstance(old, torch.Tensor) and (old.layout is not torch.strided or old._is_view()
                                                       or not is_non_overlapping_and_dense_or_false(old)))

    def _is_backward_in_place(self, func: Any) -> bool:
        """One of _BACKWARD_IN_PLACE's ops, run by the autograd engine."""
        return func in _BACKWARD_IN_PLACE and self._in_autograd_engine()

    def _in_autograd_engine(self) -> bool:
        """Backward, outside any module (a recomputed forward runs inside one), with grad mode off."""
        return self.phase == "backward" and self.module_stack == [""] and not torch.is_grad_enabled()

    def _is_in_place_add(self, func: Any, args: tuple) -> bool:
        """An out-of-place add, inside a call of one of _IN_PLACE_ADDS' composites, into a result made
        in that call: eager's in-place add."""
        if func is not torch.ops.aten.add.Tensor or not self.in_place_calls or len(args) < 2:
            return False
        rule, added, first = self.in_place_calls[-1]
        result, operand = args[0], args[1]
        if not isinstance(operand, torch.Tensor) or (
                rule.same_operand and operand.untyped_storage() is not added and not self._cast_in_call(operand, added, first)):
            return False
        return self._made_in_call(result, first)

    def _made_in_call(self, tensor: Any, first: int) -> bool:
        """Whether `tensor`'s storage was allocated by an op from `first` on."""
        sid = self.ids.get(tensor.untyped_storage()) if isinstance(tensor, torch.Tensor) else None
        made_by = self.storages[sid]["op"] if sid is not None else None
        return made_by is not None and made_by >= first

    def _cast_in_call(self, operand: torch.Tensor, added: torch.UntypedStorage, first: int) -> bool:
        """Whether `operand` is a dtype conversion of `added`'s storage made inside the call: autocast casts
        a Linear's bias before the composite runs (fp16 or bf16), and eager still adds the cast bias in
        place into the matrix product (an out-of-place add under tracing was 1,600 B over at a Conformer's
        amp-fp16 forward peak: its output projection over a transposed sequence)."""
        sid, source = self.ids.get(operand.untyped_storage()), self.ids.get(added)
        made_by = self.storages[sid]["op"] if sid is not None else None
        if made_by is None or made_by < first or source is None:
            return False
        op = self.ops[made_by]
        return op.name == str(torch.ops.aten._to_copy.default) and op.reads[:1] == (source,)

    def _note_value_test(self, func: Any, inputs: list[torch.Tensor], out: torch.Tensor) -> None:
        """Mark a test of floating-point values (`isnan(loss)`, `var < 0`, and logical combinations of
        such tests), and `any()` over one: read back, such an `any()` is typically false, as a validity
        check (`if torch.any(var < 0): raise`, F.gaussian_nll_loss's; `assert not loss.isnan().any()`)
        finds in a real step. A test of integer values (`(top_k == expert).any()`: does work follow?)
        still reads true, the larger case. A whole tensor's extreme tested against a bound
        (`_ANY_OF_EXTREMES`: `x.min() < eps` is `(x < eps).any()`) reads as such an `any()`. Over a test
        that typically holds, `any()` reads true: a range (a conjunction of tests; `isfinite(x)` is
        `(x == x) * (x.abs() != inf)`), an inequality of continuous values (`x != c`; `x != x` is a NaN
        test) and the negation of a test that typically fails. Ultralytics' RLE keypoint loss: `if not
        (visibility != 0).any()` and, over the visible ones, `valid = ~(isnan(e) | isinf(e)).any(-1); if
        not valid.any()` return a zero loss; both read false, its flow never ran (the forward 7.3% under
        while flagged a bound). Negated, one of these typically fails again."""
        packet = func._overloadpacket
        if packet in _VALUE_TESTS:
            tested = any(t.is_floating_point() or t.is_complex() for t in inputs)
        else:
            tested = packet in _TEST_COMBINATIONS and any(t in self.value_tests for t in inputs)
        if tested:
            extreme = self.extremes.get(inputs[0]) if inputs else None
            nan_test = len(inputs) == 2 and inputs[0] is inputs[1]  # x == x, x != x
            if packet in _CONJUNCTIONS or (packet in _EQUALITIES and (packet is torch.ops.aten.ne) != nan_test) \
                    or (packet in _KEEPING_CONJUNCTIONS and inputs and inputs[0] in self.holding) \
                    or (packet in _NEGATIONS and inputs and inputs[0] not in self.holding):
                self.holding[out] = True
            # any() over a range test (`(x >= -b) & (x <= b)`: nflows' splines, `if torch.any(inside):`
            # before transforming the inside) typically finds values inside: it reads true (read false,
            # the spline was skipped and the loss lost every parameter)
            inside = packet is torch.ops.aten.any and bool(inputs) and inputs[0] in self.holding
            self.value_tests[out] = out.numel() == 1 and not inside and (packet is torch.ops.aten.any
                                                                         or (extreme, packet) in _ANY_OF_EXTREMES)

    def _equal(self, a: torch.Tensor, b: torch.Tensor) -> bool:
        """aten.equal: exact from known values. Over unknown ones, true where the shapes are equal (as
        checks expect), but single flags compare as `.item()` reads them: C++'s checks test a flag with
        `at::is_scalar_tensor_true(flag)`, `equal(flag, flag.new_ones({}))` (torch.istft's window
        check, `window_envelop.abs().min().lt(1e-11)`, passes in any step that runs; read true, the
        check failed and its message printed the fake flag's data)."""
        known = self.known.compute(torch.ops.aten.equal.default, (a, b), {}, [])
        if known is not None:
            return known
        if a.shape != b.shape or a.numel() != 1 or a.dtype != torch.bool or b.dtype != torch.bool:
            return a.shape == b.shape
        return self._scalar(a) == self._scalar(b)

    def _scalar(self, tensor: torch.Tensor) -> Any:
        # A known value reads as itself. Any other data-dependent scalar: GradScaler's overflow flag
        # reads "no overflow"; any other value (optimizer step counters) reads 1 (True, 1.0), which
        # changes no shape or allocation; counted for split sizes (_balanced_split).
        if tensor in self.known:
            if tensor in self.known.typical:
                self.approximate.append(self.known.typical[tensor])
            return self.known.item(tensor)
        element = self.known.element(tensor)
        if element is not None:  # one element of a many-element draw: its likelier side
            return element
        if tensor.untyped_storage() in self.found_inf:
            return 0.0
        site = _reading_site()
        if site is not None:
            self._count_read(site)
        if self.value_tests.get(tensor):
            return False
        if tensor.dtype == torch.bool:
            return True
        if tensor.is_floating_point():
            return UNKNOWN_FLOAT
        self.unknown_integers += 1
        return 1

    def _count_read(self, site: str) -> None:
        """One unknown value read back at `site`: the third at one line in one module call (and phase)
        flags a loop steered by the data (LOOP_READS); past UNKNOWN_READS_LIMIT the estimate gives up."""
        key = (site, self.module_stack[-1], self.call_opened[-1], self.phases_begun)
        self.read_sites[key] += 1
        if self.read_sites[key] == LOOP_READS:  # a loop steered by the data: its trip count is a guess
            self.approximate.append(f"a loop reading unknown values back ({site})")
        if self.read_sites[key] > UNKNOWN_READS_LIMIT:
            raise BadInput(
                f"the training step read back more than {UNKNOWN_READS_LIMIT:,} values that depend on the data at "
                f"one line ({site}) in one call "
                "(each read as 1 or true under fake tensors): a loop whose end depends on the data, such as an "
                "adaptive ODE solver's step control or an iterative solve to a tolerance, cannot be traced; "
                "use a fixed number of steps (a fixed-step solver, a fixed iteration count)")

    def _masks_as_indices(self, func: Any, args: tuple) -> tuple[tuple, int]:
        """_masks_as_indices's arguments, with each mask's indices exact where its values are known, else
        every element; and the bytes of those indices, which the kernel holds while it runs."""
        nonzero = torch.ops.aten.nonzero.default
        indexed, made = _masks_as_indices(func, args, lambda mask: self._data_dependent(nonzero, (mask,), {}))
        return indexed, sum(where.untyped_storage().nbytes() for where in made)

    def _with_known_integers(self, func: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The arguments, each integer tensor whose values are known replaced by them (a real tensor);
        where one is not known, the scratch is a bound: approximate."""
        def known(value: Any) -> Any:
            if not isinstance(value, FakeTensor) or value.is_floating_point() or value.is_complex():
                return value
            real = self.known.value(value)
            if real is None:
                self.approximate.append(str(func))
            return value if real is None else real

        return tree_map(known, (args, kwargs))

    def _balanced_split(self, args: tuple) -> tuple:
        """split_with_sizes whose sizes do not add up to the dimension, after integers were read back from
        unknown values (each reads 1: a mixture of experts' tokens per expert, `counts.tolist()`): the
        rows shared evenly among the parts (the split's views allocate nothing; what follows takes its
        sizes from them). Without such reads, the sizes are the step's own and fail as in eager."""
        x, sizes, dim = args[0], list(args[1]), args[2] if len(args) > 2 else 0
        if not self.unknown_integers or not sizes or sum(sizes) == x.shape[dim]:
            return args
        rows = x.shape[dim]
        self.approximate.append(str(torch.ops.aten.split_with_sizes.default))
        return (x, [rows // len(sizes) + (i < rows % len(sizes)) for i in range(len(sizes))], *args[2:])

    def _data_dependent(self, func: Any, args: tuple, kwargs: dict) -> torch.Tensor:
        """The output of a data-dependent op (`_DATA_DEPENDENT`): exact from known operands, or assumed."""
        x = args[0]
        bounded = True
        if func is torch.ops.aten.bincount.default:  # one bin per value up to the largest: bound it first
            values = self.known.value(x)
            with _disable_current_modes():
                bounded = values is not None and (values.numel() == 0 or int(values.max()) < _KNOWN_LIMIT)
        real = self.known.compute(func, args, kwargs, []) if bounded else None
        typical = self.known.typical_source(args) if real is not None else None
        if typical is not None:  # exact for a typical draw of the values it selects by
            self.approximate.append(typical)
        assumed = real is None and func in _UNIQUE
        if assumed:  # values all distinct, laid out as x: the most a unique can return
            with _disable_current_modes():
                distinct = torch.arange(x.numel()).reshape(x.shape).to(x.dtype)
                real = func(distinct, *args[1:], **kwargs)
            self.approximate.append(str(func))
        if real is not None:
            return self.known.fakes_of(real, x.device, keep=not assumed, typical=typical)
        self.approximate.append(str(func))
        if func is torch.ops.aten.repeat_interleave.Tensor:  # each index once
            out = torch.empty((x.numel(),), dtype=x.dtype, device=x.device)
            if self.known.keeps(out):
                with _disable_current_modes():
                    self.known.keep([out], [torch.arange(x.numel(), dtype=x.dtype)])
            return out
        if func is torch.ops.aten.nonzero.default:  # every index, in order
            out = torch.empty((x.numel(), x.dim()), dtype=torch.long, device=x.device)
            if self.known.keeps(out):
                with _disable_current_modes():
                    self.known.keep([out], [torch.ones(x.shape, dtype=torch.bool).nonzero()])
            return out
        if func is torch.ops.aten.masked_select.default:  # every element of self, broadcast with the mask
            shape = torch.broadcast_shapes(x.shape, args[1].shape)
            out = torch.empty((shape.numel(),), dtype=x.dtype, device=x.device)
            if x in self.known and self.known.keeps(out):
                with _disable_current_modes():
                    self.known.keep([out], [self.known.real[x].expand(shape).reshape(-1).clone()])
            return out
        return _bincount_output(*args, **kwargs)


def _bincount_output(x: torch.Tensor, weights: torch.Tensor | None = None, minlength: int = 0) -> torch.Tensor:
    """aten.bincount over unknown values: `minlength` bins (all the values below it), or one per element
    without it; its dtype as the CPU and CUDA kernels give it."""
    bins = minlength if minlength > 0 else x.numel()
    dtype = torch.long if weights is None else weights.dtype if weights.dtype == torch.float else torch.double
    return torch.empty((bins,), dtype=dtype, device=x.device)


# The `info` output (its position) of the linear-algebra ops that report failure in a tensor rather than
# raise: 0, success, as in any step that goes on (linear_operator's psd_safe_cholesky: `L, info =
# cholesky_ex(A); if not torch.any(info): return L`, else it retries with jitter and raises NotPSDError;
# read as 1, every GPyTorch model with an exact Cholesky failed to estimate)
_LINALG_INFOS = {torch.ops.aten.linalg_cholesky_ex.default: 1, torch.ops.aten.linalg_inv_ex.default: 1,
                 torch.ops.aten.linalg_lu_factor_ex.default: 2, torch.ops.aten.linalg_ldl_factor_ex.default: 2,
                 torch.ops.aten._linalg_solve_ex.default: 3}

# Ops that test values (a bool result), and ops that combine tests: see _Recorder._note_value_test
_VALUE_TESTS = {getattr(torch.ops.aten, name) for name in (
    "isnan", "isinf", "isposinf", "isneginf", "isfinite", "signbit", "eq", "ne", "lt", "le", "gt", "ge")}
_TEST_COMBINATIONS = {getattr(torch.ops.aten, name) for name in (
    "logical_not", "logical_and", "logical_or", "logical_xor", "bitwise_not", "bitwise_and", "bitwise_or", "mul",
    "any", "view", "reshape", "_unsafe_view", "flatten", "squeeze", "unsqueeze")}
# A conjunction of value tests (a product of bool ones too) is a range (`(x >= a) & (x <= b)`), and views keep
# it one; a disjunction of tests (`(w < a) | (w > b)`: out of range) is not. A negation holds where its
# operand fails (`~isnan(x)`, `~((w < a) | (w > b))`)
_CONJUNCTIONS = {torch.ops.aten.logical_and, torch.ops.aten.bitwise_and, torch.ops.aten.mul}
_NEGATIONS = {torch.ops.aten.logical_not, torch.ops.aten.bitwise_not}
_EQUALITIES = {torch.ops.aten.eq, torch.ops.aten.ne}  # over continuous values `x == c` fails, `x != c` holds

_KEEPING_CONJUNCTIONS = {getattr(torch.ops.aten, name) for name in (
    "view", "reshape", "_unsafe_view", "flatten", "squeeze", "unsqueeze")}
# Reductions of a whole tensor to its extreme, and the tests of one that are tests of every element
# (`x.min() < eps` is `(x < eps).any()`); the others (`x.min() > eps`, an all()) read true already
_EXTREMES = {torch.ops.aten.min.default, torch.ops.aten.max.default}
_ANY_OF_EXTREMES = {(torch.ops.aten.min.default, torch.ops.aten.lt), (torch.ops.aten.min.default, torch.ops.aten.le),
                    (torch.ops.aten.max.default, torch.ops.aten.gt), (torch.ops.aten.max.default, torch.ops.aten.ge)}


def _mixed_dtypes(args: tuple, kwargs: dict, inputs: list[torch.Tensor]) -> str | None:
    """Matrix products and grid samples of mixed dtypes (a float32 tensor made in the forward times bf16
    weights, RAFT's float32 grid over a bf16 volume)."""
    dtypes = [t.dtype for t in inputs]
    return f"operands must have the same dtype, got {', '.join(map(str, dtypes))}" if len(set(dtypes)) > 1 else None


def _index_put_dtypes(args: tuple, kwargs: dict, inputs: list[torch.Tensor]) -> str | None:
    """Values put by index (`out[mask] = expert(x[mask])`) of another dtype than the destination (a bf16
    expert's output into a float32 buffer under autocast); a single value is a fill, which converts."""
    destination, values = args[0], args[2]
    if values.dtype == destination.dtype or values.dim() == 0:
        return None
    return f"Index put requires the source and destination dtypes match, got {destination.dtype} and {values.dtype}"


def _overflowing(value: Any, dtype: torch.dtype) -> str | None:
    """A fill value `dtype` cannot hold (`masked_fill(mask, torch.finfo(torch.float32).min)` on a bf16
    tensor; c10::checked_convert: infinities and NaN pass)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or dtype == torch.bool or dtype.is_complex:
        return None
    info = torch.finfo(dtype) if dtype.is_floating_point else torch.iinfo(dtype)
    if dtype.is_floating_point and not math.isfinite(value):
        return None
    return None if info.min <= value <= info.max else f"value cannot be converted to type {dtype} without overflow"


def _full_dtype(value: Any, kwargs: dict) -> torch.dtype:
    """torch.full's dtype: the one asked for, else the fill value's (bool, int64, the default float)."""
    if kwargs.get("dtype") is not None:
        return kwargs["dtype"]
    return torch.bool if isinstance(value, bool) else torch.int64 if isinstance(value, int) else torch.get_default_dtype()


def _observer_buffers_sized(args: tuple, kwargs: dict) -> list[tuple[torch.Tensor, int]]:
    """fused_moving_avg_obs_fake_quant per channel (quantization-aware training's fused weight
    observers): on the first call its CPU and CUDA kernels size the empty running min and max, and the
    scale and zero point, to the channels (fused_obs_fake_quant.cpp: `running_min.resize_(size)`)."""
    x, running_min, running_max, scale, zero_point = args[0], *args[3:7]
    ch_axis = args[10]
    per_row = args[11] if len(args) > 11 else kwargs.get("per_row_fake_quant", False)
    if not per_row or running_min.numel() != 0:
        return []
    return [(t, x.shape[ch_axis]) for t in (running_min, running_max, scale, zero_point)]


# Kernels that resize some of their mutable operands, which the fake kernels leave as they are (op ->
# (args, kwargs) -> [(operand, its new number of elements)]): the op grows those storages (_regrow)
_RESIZED_OPERANDS: dict[Any, Callable[[tuple, dict], list[tuple[torch.Tensor, int]]]] = {
    torch.ops.aten._fused_moving_avg_obs_fq_helper.default: _observer_buffers_sized,
}


def _observed_not_float32(args: tuple, kwargs: dict, inputs: list[torch.Tensor]) -> str | None:
    """fused_moving_avg_obs_fake_quant's kernels read the input's extremes as float32
    (fused_obs_fake_quant.cpp, FusedObsFakeQuant.cu: `x_min.data_ptr<float>()`; the CPU's only while
    observing, as in training): a quantization-aware model under autocast or in bf16 fails."""
    return None if args[0].dtype == torch.float32 else f"expected scalar type Float but found {args[0].dtype}"


# Checks eager's CPU and CUDA kernels make that the fake kernels skip (op -> (args, kwargs, tensor
# operands) -> what eager raises, or None): without them the estimate would be a step that cannot run
_EAGER_REFUSALS: dict[Any, Callable[[tuple, dict, list[torch.Tensor]], str | None]] = {
    **dict.fromkeys((torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
                     torch.ops.aten.baddbmm.default, torch.ops.aten.addbmm.default, torch.ops.aten.mv.default,
                     torch.ops.aten.addmv.default, torch.ops.aten.dot.default, torch.ops.aten.vdot.default,
                     torch.ops.aten.grid_sampler_2d.default, torch.ops.aten.grid_sampler_3d.default), _mixed_dtypes),
    **dict.fromkeys((torch.ops.aten.fill.Scalar, torch.ops.aten.fill_.Scalar, torch.ops.aten.masked_fill.Scalar,
                     torch.ops.aten.masked_fill_.Scalar),
                    lambda args, kwargs, inputs: _overflowing(args[-1], args[0].dtype)),
    **dict.fromkeys((torch.ops.aten.index_put.default, torch.ops.aten.index_put_.default,
                     torch.ops.aten._index_put_impl_.default), _index_put_dtypes),
    torch.ops.aten._fused_moving_avg_obs_fq_helper.default: _observed_not_float32,
    torch.ops.aten.full.default: lambda args, kwargs, inputs: _overflowing(args[1], _full_dtype(args[1], kwargs)),
    torch.ops.aten.full_like.default:
        lambda args, kwargs, inputs: _overflowing(args[1], kwargs.get("dtype") or args[0].dtype),
}


def _wraps_foreign_memory(func: Any, args: tuple) -> bool:
    """lift_fresh of a real tensor over memory the allocator did not give (a NumPy array's: `x[idx]`
    with NumPy index arrays, `torch.as_tensor(array)`, which wrap the array's buffer, torch.from_numpy;
    its storage cannot be resized): eager allocates nothing, where the fake copy has a storage of its
    own (nflows' LULinear indexes by `np.tril_indices` at every forward: 320 B over). torch.tensor(data)
    copies into the allocator's memory, which resizes, and counts as before."""
    if func is not torch.ops.aten.lift_fresh.default or not args:
        return False
    source = args[0]
    return isinstance(source, torch.Tensor) and not isinstance(source, FakeTensor) \
        and source.layout is torch.strided and not source.untyped_storage().resizable()


def _written_arguments(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors an op mutates, from its schema's alias annotations (Tensor(a!)). `t.set_(source)` where
    source is t's own storage, offset, sizes and strides changes nothing and writes nothing
    (torch.nn.utils.parametrize.register_parametrization sets the original to itself: peft's LoRA on
    parameters registers one at every forward, whose blocks were refused as writing a parameter)."""
    if func is torch.ops.aten.set_.source_Tensor and _same_view(args[0], args[1]):
        return []
    written = []
    for position, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[position] if position < len(args) else kwargs.get(argument.name)
        written.extend(t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor))
    return written


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two strided tensors are the same view of the same storage."""
    return (a.layout is torch.strided and b.layout is torch.strided and a.untyped_storage() is b.untyped_storage()
            and a.storage_offset() == b.storage_offset() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype)


@contextlib.contextmanager
def _module_scopes(recorder: _Recorder, model: nn.Module, calls: list[ModuleCall]) -> Iterator[None]:
    """Track which submodule is running (global hooks: they also see recomputation in backward)."""
    paths = {id(m): name for name, m in model.named_modules(remove_duplicate=False)}
    # (path, first op, input storages, when it opened, its own attributes as the call began (ModuleCall.keeps),
    # the host generators' states then and how many seedings came before (ModuleCall.draws_from))
    open_calls: list[tuple[str, int, tuple[int, ...], int, dict[str, int], tuple[dict[str, int], int]]] = []
    seedings: list[tuple[str, int]] = []  # (generator, its state just before it was seeded), in order

    def hook_run() -> int:
        """When this hook runs, by the count of module hooks run before it."""
        recorder.module_hooks += 1
        return recorder.module_hooks - 1

    def tensor_ids(value: Any) -> tuple[int, ...]:
        return tuple(recorder.ids[s] for s in recorder.storages_of(tree_flatten(value)[0]) if s in recorder.ids)

    def value_of(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return ("tensor", recorder.ids.get(recorder.storages_of([value])[-1], id(value)))
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if type(value) in (tuple, list):  # (cos, sin) position embeddings
            return tuple(map(value_of, value))
        return ("object", id(value))

    def arguments(args: Any, kwargs: Any) -> tuple:
        return (*map(value_of, args[1:]), *((name, value_of(v)) for name, v in (kwargs or {}).items()))

    def made_since(first_op: int) -> Callable[[torch.Tensor], bool]:
        """Whether a tensor was made by op `first_op` or a later one."""
        def made(t: torch.Tensor) -> bool:
            sid = recorder.ids.get(recorder.storages_of([t])[-1])
            op = recorder.storages[sid]["op"] if sid is not None else None
            return op is not None and op >= first_op

        return made

    def stores_into(args: Any, kwargs: Any, first_op: int) -> str:
        """The type of the first argument object (a cache, a list, a dict: anything not a tensor) that now
        holds a tensor this call made: its forward stored it there."""
        made = made_since(first_op)
        return next((holder for value in (*args, *(kwargs or {}).values()) for holder in [_holder_of(value, made)]
                     if holder), "")

    def own_attributes(module: nn.Module) -> dict[str, Any]:
        return {name: value for name, value in vars(module).items() if name not in _MODULE_ATTRIBUTES}

    def identities(module: nn.Module) -> dict[str, int]:
        """What the module's own attributes are bound to, by identity: holding the objects themselves would
        keep a tensor alive that eager frees during the call (the weight old-style weight_norm replaces)."""
        return {name: id(value) for name, value in own_attributes(module).items()}

    def keeps(module: nn.Module, first_op: int, before: dict[str, int]) -> str:
        """The first attribute of `module` (not one nn.Module itself sets) that the call set to another
        object (a counter, a new state) or that holds a tensor the call made (a list it appends to)."""
        made = made_since(first_op)
        return next((name for name, value in own_attributes(module).items()
                     if before.get(name) != id(value)
                     or (made(value) if isinstance(value, torch.Tensor) else _holder_of(value, made))), "")

    def draws_from(start: dict[str, int], seeded_before: int) -> str:
        """The first host generator whose state the call changed other than by seeding it first: where its
        first seeding inside the call found the state the call began with, nothing was drawn before it."""
        for name, state in _host_generator_states().items():
            first_seeding = next((before for generator, before in seedings[seeded_before:] if generator == name), None)
            if state != start[name] and first_seeding != start[name]:
                return name
        return ""

    def pre(module: nn.Module, args: Any, kwargs: Any = None) -> None:
        path = paths.get(id(module))
        if path is not None:
            recorder.module_stack.append(path)
            opened = hook_run()
            recorder.call_opened.append(opened)
            open_calls.append((path, len(recorder.ops), tensor_ids((args, kwargs)), opened, identities(module),
                               (_host_generator_states(), len(seedings))))

    def post(module: nn.Module, args: Any, kwargs: Any, output: Any = None) -> None:
        path = paths.get(id(module))
        if path is not None and open_calls and open_calls[-1][0] == path:
            recorder.module_stack.pop()
            recorder.call_opened.pop()
            _, first, inputs, opened, attributes, generators = open_calls.pop()
            # global pre-hooks get no keyword arguments: the tensors passed by keyword (an attention
            # mask, encoder states) are added here, after the positional ones
            inputs = inputs + tuple(sid for sid in tensor_ids(kwargs) if sid not in inputs)
            calls.append(
                ModuleCall(
                    path, type(module).__name__, recorder.phase, recorder.step, first, len(recorder.ops), inputs,
                    tensor_ids(output), arguments(args, kwargs), id(args[0]) if args else 0, id(output),
                    opened, hook_run(), stores_into(args, kwargs, first), keeps(module, first, attributes),
                    draws_from(*generators),
                )
            )

    def seeding(name: str, seed: Callable[..., Any]) -> Callable[..., Any]:
        """`seed` of a host generator, which first notes the state it found (see draws_from)."""
        def seeded(*args: Any, **kwargs: Any) -> Any:
            seedings.append((name, _host_generator_states()[name]))
            return seed(*args, **kwargs)

        return seeded

    seeds = [(random, "random"), (np.random, "numpy.random")]
    originals = [(module, module.seed) for module, _ in seeds]
    for module, name in seeds:
        module.seed = seeding(name, module.seed)
    handles = [
        nn.modules.module.register_module_forward_pre_hook(lambda m, a: pre(m, a)),
        # always_call: checkpointing stops a recomputation by raising inside a module; its scope still ends
        nn.modules.module.register_module_forward_hook(lambda m, a, k, o=None: post(m, a, k, o), with_kwargs=True,
                                                       always_call=True),
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for module, seed in originals:
            module.seed = seed


def _host_generator_states() -> dict[str, int]:
    """Hashes of the states of the host's global generators that a model's Python code may draw from:
    Python's `random` and NumPy's legacy `numpy.random` (wav2vec 2.0 draws its time masks there, BigBird
    its random attention blocks)."""
    _, keys, position, *_ = np.random.get_state()
    return {"random": hash(random.getstate()), "numpy.random": hash((position, keys.tobytes()))}


_MODULE_ATTRIBUTES = frozenset(vars(nn.Module())) | {"forward"}  # nn.Module's own, and a checkpoint's wrapper
_CONSTANT_TYPES = (bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size, types.ModuleType)
_HOLDER_NODES = 1000  # objects looked into per argument, at most: an argument may reach a whole config


def _holder_of(value: Any, made_since: Callable[[torch.Tensor], bool]) -> str:
    """The type name of `value` where it holds, itself or through the containers and object attributes it
    reaches, a tensor for which `made_since` holds; "" where it holds none. A tensor that is the argument,
    or an element of a tuple argument, is an input of the call, not something it stored. Modules, classes
    and callables are not looked into: what they hold is no state of the value."""
    seen: set[int] = set()

    def holds(node: Any, depth: int) -> bool:
        if isinstance(node, torch.Tensor):
            return made_since(node)
        if (depth > 4 or node is None or isinstance(node, _CONSTANT_TYPES) or callable(node) or id(node) in seen
                or len(seen) > _HOLDER_NODES):
            return False
        seen.add(id(node))
        if isinstance(node, dict):
            items = list(node.values())
        elif isinstance(node, (list, tuple, set, frozenset)):
            items = list(node)
        else:
            items = list(getattr(node, "__dict__", {}).values())
        return any(holds(item, depth + 1) for item in items)

    if isinstance(value, tuple):  # (cos, sin): its tensors are inputs; what else it holds may be mutable
        return next((found for item in value if not isinstance(item, torch.Tensor)
                     for found in [_holder_of(item, made_since)] if found), "")
    if isinstance(value, torch.Tensor) or not holds(value, 0):
        return ""
    return type(value).__name__


@dataclass(frozen=True)
class _InPlaceAdd:
    """A composite that adds one of its arguments into a result it has just made: in place in eager,
    out of place under tracing (aten's `areAnyTensorSubclassLike` holds for fake tensors, and whenever
    a Python dispatch mode is on)."""

    position: int  # the added argument, by position
    keyword: str  # or by name
    same_operand: bool  # the add's operand is that argument itself; else anything (it may be converted first)


_IN_PLACE_ADDS = {
    # aten/src/ATen/native/Linear.cpp linear: without a fused path (an input of 3 or more dims that is
    # not contiguous, e.g. a Linear over a transposed sequence) `output = at::matmul(input, weight.t())`
    # then `output.add_(bias)`, or `at::add(output, bias)` for subclasses
    torch._C._nn.linear: _InPlaceAdd(2, "bias", same_operand=True),
    # aten/src/ATen/native/transformers/attention.cpp _scaled_dot_product_attention_math (the CPU's path
    # where the flash kernel declines, e.g. for a mask that needs a gradient, as BEiT's learnt relative
    # position bias does): `attn.add_(attn_mask)` into its scores, or `attn = attn.add(attn_mask)`
    torch._C._nn.scaled_dot_product_attention: _InPlaceAdd(3, "attn_mask", same_operand=False),
}


class _InPlaceScopes(torch.overrides.TorchFunctionMode):
    """Marks the calls of _IN_PLACE_ADDS' composites for the recorder (`_Recorder._is_in_place_add`).
    A call made while a dispatch mode other than the tracer's own is on (a selective checkpoint's
    policy) adds out of place in eager too, and is not marked."""

    def __init__(self, recorder: _Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        rule = _IN_PLACE_ADDS.get(func)
        if rule is None:
            return func(*args, **kwargs)
        added = args[rule.position] if len(args) > rule.position else kwargs.get(rule.keyword)
        if (not isinstance(added, torch.Tensor) or _foreign_dispatch_modes()
                or torch._C._functorch.is_functorch_wrapped_tensor(added)):  # subclass-like: out of place in eager too
            return func(*args, **kwargs)
        self.recorder.in_place_calls.append((rule, added.untyped_storage(), len(self.recorder.ops)))
        try:
            return func(*args, **kwargs)
        finally:
            self.recorder.in_place_calls.pop()


class _SavedWrappedNumbers(torch.overrides.TorchFunctionMode):
    """A Python number passed where an op takes a Tensor (`x * 0.5`, `scores / math.sqrt(d)`) is made a
    0-dim CPU "wrapped number" tensor by the argument parser, below the tracer (which sees a number
    and counts it as scratch of the op: memplan/scratch.py). When autograd saves it for backward
    (MulBackward0 and DivBackward0 keep `other`, MaximumBackward0 both operands), it lives in the node
    until the backward releases it: 8 bytes per op in eager's forward peak. Autograd applies no saved
    tensor hooks to wrapped numbers (torch/csrc/autograd/saved_variable.cpp), so the tracer's pack hook
    never sees them: after each call, the nodes it made (sequence numbers from before the call on) are
    read for tensors saved without a hook that are real (not fake), 0-dim and unknown to the recorder,
    and each is registered as an allocation of the op that made its node."""

    def __init__(self, recorder: _Recorder) -> None:
        super().__init__()
        self.recorder = recorder
        self._saved_names: dict[type, tuple[str, ...]] = {}  # node type -> its `_raw_saved_*` attributes

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        start = torch._C._autograd._get_sequence_nr()
        out = func(*args, **kwargs)
        end = torch._C._autograd._get_sequence_nr()
        if end != start and torch.is_grad_enabled():
            for node in self._nodes_made(out, start, end):
                if type(node).__name__ == "CopySlices":
                    self._register_hidden_numbers(node, func, args, kwargs)
                else:
                    self._register_numbers_of(node)
        return out

    @staticmethod
    def _nodes_made(out: Any, start: int, end: int) -> Iterator[Any]:
        """The autograd nodes of `out` numbered from `start` to `end` (made by the call)."""
        nodes = [t.grad_fn for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        seen: set[int] = set()
        while nodes:
            node = nodes.pop()
            if node is None or id(node) in seen or not start <= node._sequence_nr() < end:
                continue
            seen.add(id(node))
            nodes.extend(next_node for next_node, _ in node.next_functions)
            yield node

    def _register_numbers_of(self, node: Any) -> None:
        for value in self._saved_numbers(node):
            if value.untyped_storage() not in self.recorder.ids:
                self.recorder.register_saved_number(value, node._sequence_nr())

    def _saved_numbers(self, node: Any) -> Iterator[torch.Tensor]:
        """The wrapped numbers `node` saved: real (not fake) 0-dim tensors saved without a hook."""
        names = self._saved_names.get(type(node))
        if names is None:
            names = self._saved_names[type(node)] = tuple(n for n in dir(node) if n.startswith("_raw_saved_"))
        for name in names:
            try:
                raw = getattr(node, name)
            except RuntimeError:
                continue
            for saved in raw if isinstance(raw, (list, tuple)) else (raw,):
                # `data` is the tensor saved as it is, None for one a hook packed (reading it
                # unpacks nothing: a checkpointed segment is not recomputed)
                value = getattr(saved, "data", None)
                # (a meta one is an operand's stand-in (`_numbers_saved_outside_a_view`): a tensor the
                # step holds already, as `x[..., 0::2] /= size[1]` saves `size[1]`, no number of its own)
                if isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor) and value.dim() == 0 \
                        and value.device.type != "meta" \
                        and not torch._C._functorch.is_functorch_wrapped_tensor(value):  # (inside torch.func.grad)
                    yield value

    def _register_hidden_numbers(self, copy_slices: Any, func: Any, args: tuple, kwargs: dict) -> None:
        """An in-place op on a view (`q.mul_(scale)` on a transposed query, torchtune's Gemma2) puts its
        node inside the base's CopySlices, which Python cannot reach. The op runs again on meta
        stand-ins outside any view: the numbers its node saves there stand for the hidden ones, held
        by a hook of the CopySlices node until backward runs it (or the node dies), as eager's are."""
        numbers = list(self._numbers_saved_outside_a_view(func, args, kwargs))
        if not numbers:
            return
        for value in numbers:
            self.recorder.register_saved_number(value, copy_slices._sequence_nr())
        copy_slices.register_hook(lambda *_: numbers.clear())

    def _numbers_saved_outside_a_view(self, func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        if not args or not isinstance(args[0], torch.Tensor) or not args[0].is_floating_point():
            return []

        def stand_in(value: Any) -> Any:
            if not isinstance(value, torch.Tensor):
                return value
            return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")

        with _disable_current_modes(), torch._C.DisableTorchFunction(), torch.enable_grad():
            target = stand_in(args[0]).requires_grad_().clone()  # a non-leaf, as an in-place op needs
            rest = tree_map(stand_in, (args[1:], kwargs))
            try:
                func(target, *rest[0], **rest[1])
            except Exception:  # noqa: BLE001 - no stand-in run, no numbers: as before
                return []
            return list(self._saved_numbers(target.grad_fn)) if target.grad_fn is not None else []


def _pad_packed_sequence(data: torch.Tensor, batch_sizes: torch.Tensor, batch_first: bool,
                         padding_value: float, total_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """aten/src/ATen/native/PackedSequence.cpp _pad_packed_sequence, op for op: it fills `lengths`
    through a data pointer, which a fake tensor has not. `batch_sizes` is real (_pack_padded_sequence_outputs)."""
    sizes = batch_sizes.tolist()
    longest = max(len(sizes), total_length)
    output = torch.full((longest, sizes[0], *data.shape[1:]), padding_value, dtype=data.dtype, device=data.device)
    lengths = torch.empty(sizes[0], dtype=torch.int64)
    offset, previous_batch, previous_step, values = 0, sizes[0], 0, []
    for step, batch in enumerate([*sizes, 0]):
        if batch != previous_batch:
            count = previous_batch * (step - previous_step)
            chunk = data[offset : offset + count].view(step - previous_step, previous_batch, *data.shape[1:])
            output[previous_step:step, :previous_batch].copy_(chunk)
            offset, previous_step = offset + count, step
        values += [step] * (previous_batch - batch)
        previous_batch = batch
    with _disable_current_modes():
        known = torch.tensor(values[::-1], dtype=torch.int64)
    return (output.transpose(0, 1) if batch_first else output), lengths.copy_(known)


# Composites that eager runs in C++ reading a tensor through its data pointer, which fake tensors have
# not: rewritten with the same ops (so autograd, the allocations and their order are eager's)
def _allclose(input: torch.Tensor, other: torch.Tensor, rtol: float = 1e-05, atol: float = 1e-08,
              equal_nan: bool = False) -> bool:
    """TensorCompare.cpp allclose: `isclose(...).all().item()`, read back as any value is (the fake
    kernel refuses it as data-dependent)."""
    return bool(torch.isclose(input, other, rtol, atol, equal_nan).all())


def _one_hot(tensor: torch.Tensor, num_classes: int = -1) -> torch.Tensor:
    """Onehot.cpp's eager path, `aminmax` (its checks), zeros, `scatter_`: the fake kernel's
    `arange(num_classes) == tensor` holds a bool copy of the result beside it."""
    low, high = torch.aminmax(tensor) if tensor.numel() else (0, num_classes - 1)
    if int(low) < 0:
        raise RuntimeError("Class values must be non-negative.")
    if num_classes == -1:
        num_classes = int(high) + 1
    out = torch.zeros((*tensor.shape, num_classes), dtype=torch.long, device=tensor.device)
    return out.scatter_(-1, tensor.unsqueeze(-1), 1)


def _ctc_loss(log_probs: torch.Tensor, targets: torch.Tensor, input_lengths: Any, target_lengths: Any,
              blank: int = 0, reduction: str = "mean", zero_infinity: bool = False) -> torch.Tensor:
    """LossCTC.cpp ctc_loss. Eager reads tensor lengths into lists (`ilc = input_lengths.to(kCPU,
    kLong).contiguous()`, a copy unless they are already so, held to the end) and runs the list overload,
    whose autograd node keeps the lists, not the tensors; fake tensors take the composite path for tensor
    subclasses, whose node keeps both tensors through backward (wav2vec2's CTC head, lengths made in
    forward: 16 B a sample over in backward). Where the recorder knows their values, they are passed as
    lists too. Reduction "mean" divides by `at::tensor(target_lengths, res.options()).clamp_min(1)`: the
    lengths made anew in the losses' dtype through its data pointer, which a fake tensor has not (lists
    failed the estimate), where the composite path clamps the int64 lengths themselves (4 B a sample
    over at the forward's peak). The same ops as eager's, the lengths' tensor made from Python."""
    held = [t.to("cpu", torch.long).contiguous() for t in (input_lengths, target_lengths)  # noqa: F841 - eager's ilc, tlc
            if isinstance(t, torch.Tensor) and t.device.type == "cpu"]
    listed = _known_lists(input_lengths, target_lengths)
    if listed is not None:
        input_lengths, target_lengths = listed
    if reduction != "mean":
        return F.ctc_loss(log_probs, targets, input_lengths, target_lengths, blank, reduction, zero_infinity)
    losses = F.ctc_loss(log_probs, targets, input_lengths, target_lengths, blank, "none", zero_infinity)
    if isinstance(target_lengths, torch.Tensor):  # the unclamped tensor is a temporary, freed at once
        lengths = target_lengths.to(device=losses.device, dtype=losses.dtype).clamp_min(1)
    else:
        lengths = torch.tensor(list(target_lengths), dtype=losses.dtype, device=losses.device).clamp_min(1)
    return (losses / lengths).mean()


def _tensor_split(input: torch.Tensor, indices_or_sections: Any, dim: int = 0) -> tuple[torch.Tensor, ...]:
    """TensorShape.cpp tensor_split over a tensor of indices (or a 0-dim count of sections) reads it
    through its data pointer: read back here instead (its known values where it has them), as eager reads
    it; the split itself is views, as in eager."""
    if isinstance(indices_or_sections, torch.Tensor):
        values = indices_or_sections.tolist()
        return torch.tensor_split(input, values, dim)
    return torch.tensor_split(input, indices_or_sections, dim)


def _known_lists(*tensors: Any) -> list[list[int]] | None:
    """Integer tensors' values as lists, where the step's recorder knows every one of them (read back as
    eager reads them: a typical draw's flags the estimate approximate); else None."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    recorder = next((m for m in _get_current_dispatch_mode_stack() if isinstance(m, _Recorder)), None)
    if recorder is None or not all(isinstance(t, torch.Tensor) and t.dim() == 1 and t in recorder.known for t in tensors):
        return None
    for t in tensors:
        if t in recorder.known.typical:
            recorder.approximate.append(recorder.known.typical[t])
    with _disable_current_modes():
        return [recorder.known.real[t].tolist() for t in tensors]


def _tensor_of_elements(data: Any, *args: Any, dtype: torch.dtype | None = None, **kwargs: Any) -> torch.Tensor:
    """torch.tensor over (nested) lists that hold one-element tensors (torchtune's Llama3ScaledRoPE:
    `torch.tensor(new_freqs)` of 0-dim tensors) copies each element through its data pointer, which a
    fake tensor has not. Each fake element is read back instead (`.item()`: its known value where there
    is one), and the dtype inferred as tensor_new.cpp's infer_scalar_type does from the elements."""
    elements, layout = tree_flatten(data) if isinstance(data, (list, tuple)) else ([], None)
    if not any(isinstance(e, FakeTensor) for e in elements) \
            or not all(isinstance(e, (torch.Tensor, bool, int, float, complex)) for e in elements):
        return torch.tensor(data, *args, dtype=dtype, **kwargs)
    if dtype is None:
        dtype = functools.reduce(torch.promote_types, map(_element_dtype, elements))
    values = [e.item() if isinstance(e, FakeTensor) else e for e in elements]
    return torch.tensor(tree_unflatten(values, layout), *args, dtype=dtype, **kwargs)


def _element_dtype(element: Any) -> torch.dtype:
    """The dtype torch.tensor infers for one element of its data."""
    if isinstance(element, torch.Tensor):
        return element.dtype
    return torch.tensor(element).dtype  # a Python number: bool, int64, the default float or complex dtype


def _unless_functorch_wrapped(rewrite: Callable[..., Any], original: Callable[..., Any]) -> Callable[..., Any]:
    """`rewrite`, except over functorch's wrapped tensors (vmap, grad), subclass-like in eager too."""

    def call(*args: Any, **kwargs: Any) -> Any:
        wrapped = any(isinstance(t, torch.Tensor) and torch._C._functorch.is_functorch_wrapped_tensor(t)
                      for t in tree_flatten((args, kwargs))[0])
        return (original if wrapped else rewrite)(*args, **kwargs)

    return call


_REWRITTEN_FUNCTIONS = {torch._C._VariableFunctions._pad_packed_sequence: _pad_packed_sequence,
                        torch.allclose: _allclose, torch.Tensor.allclose: _allclose,
                        torch.nn.functional.one_hot: _one_hot, F.ctc_loss: _ctc_loss, torch.tensor: _tensor_of_elements,
                        torch.tensor_split: _tensor_split, torch.Tensor.tensor_split: _tensor_split,
                        # backward formulas with a path for plain tensors (memplan/eager_backward.py)
                        **{f: _unless_functorch_wrapped(rewrite, f) for f, rewrite in EAGER_BACKWARDS.items()}}
# while the factory builds: only what reads values back (the other rewrites are the step's kernels)
_FACTORY_REWRITES = {torch.tensor: _tensor_of_elements}


class _Rewrites(torch.overrides.TorchFunctionMode):
    """Runs the rewrites of `functions` (the step's: _REWRITTEN_FUNCTIONS) in place of the functions."""

    def __init__(self, functions: dict[Any, Callable[..., Any]] = _REWRITTEN_FUNCTIONS) -> None:
        super().__init__()
        self.functions = functions

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        rewrite = self.functions.get(func)
        return (rewrite or func)(*args, **(kwargs or {}))


def _foreign_dispatch_modes() -> bool:
    """Whether a dispatch mode other than the tracer's and fake mode is on (it would be in eager too)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return any(not isinstance(mode, (_Recorder, FakeTensorMode)) for mode in _get_current_dispatch_mode_stack())


# A whole-tensor predicate over values no one can know while building (random init), read back by the
# factory: its typical answer. nn.init.trunc_normal_ rejection-samples (torch 2.13: `while True: mask =
# (w < a) | (w > b); if not mask.any(): break`); "none out of range" ends the loop, as it almost always
# does at the first draw for real. torch.distributions validates its arguments by `_is_all_true` over a
# constraint's test (pyro's AutoNormal runs the model once while the factory builds: `Normal(mean, 0.1)`
# over a random Linear's output); the check passes, as for real. Any other unknown value still raises.
_TYPICAL_PREDICATES = {torch.ops.aten.any.default: False, torch.ops.aten.all.default: True,
                       torch.ops.aten._is_any_true.default: False, torch.ops.aten._is_all_true.default: True}


# The median of a random op's distribution, by op. A single draw reads as it, so a comparison with the
# draw takes its more likely branch, as most real steps do: transformers' layerdrop, `if
# torch.rand([]) < layerdrop: continue`, runs the layer (a draw read as 1 skipped every layer). Many
# draws are left unknown: how many of them pass a test is a count, which no one draw stands for.
def _uniform_median(_self: Any, low: float = 0.0, high: float = 1.0, *_: Any, **__: Any) -> float:
    return (low + high) / 2


def _normal_median(_self: Any, mean: float = 0.0, *_: Any, **__: Any) -> float:
    return mean


def _randint_median(*args: Any, **kwargs: Any) -> int:
    bounds = [a for a in args if isinstance(a, int) and not isinstance(a, bool)]  # (high) or (low, high)
    low = kwargs.get("low", bounds[0] if len(bounds) > 1 else 0)
    high = kwargs.get("high", bounds[-1] if bounds else low + 1)
    return (low + high - 1) // 2


# A single integer draw read back is a value, not a test (`torch.randint(0, 10_000, ()).item()`: the seed
# from which vector-quantize-pytorch's residual quantizers draw how many of them run): no side of it is
# likelier, and a real step draws another. It reads as its median, a typical value, and flags the estimate
# approximate where read (_RealValues.typical); a float draw read as its median stays a test's likelier side.
_TYPICAL_DRAWS = frozenset((torch.ops.aten.randint, torch.ops.aten.randint_like))

_DRAW_MEDIANS: dict[Any, Callable[..., float]] = {
    **dict.fromkeys(_TYPICAL_DRAWS, _randint_median),
    **dict.fromkeys((torch.ops.aten.rand, torch.ops.aten.rand_like), lambda *_, **__: 0.5),
    **dict.fromkeys((torch.ops.aten.uniform, torch.ops.aten.uniform_), _uniform_median),
    **dict.fromkeys((torch.ops.aten.randn, torch.ops.aten.randn_like), lambda *_, **__: 0.0),
    torch.ops.aten.normal_: _normal_median,
}


# ops whose every output element is one element of an operand, moved (views, copies, indexing): per-element
# stand-ins pass through them (`_RealValues._per_element`)
_ELEMENT_MOVES = {getattr(torch.ops.aten, name) for name in (
    "select", "unbind", "slice", "view", "_unsafe_view", "reshape", "expand", "permute", "transpose", "t",
    "squeeze", "unsqueeze", "alias", "clone", "_to_copy", "detach", "copy_", "copy", "index", "index_put_",
    "index_put", "flatten", "contiguous", "lift_fresh", "fill_", "fill", "masked_fill_", "masked_fill")}


# ops that join tensors (their unknown operands are data too), through which a tensor known in part keeps
# the part known (`_RealValues.partial`): `targets = torch.cat((batch_idx, cls, boxes), 1)` over a known
# image index and unknown boxes, then `targets[:, 0]`, a detector's loss counting its objects per image
_JOINS = {torch.ops.aten.cat, torch.ops.aten.stack}
# and the element moves whose every tensor operand is data (no indices, no fill values or sources written
# in, which the known-masks would stand in for), with the splits
_PARTIAL_MOVES = _JOINS | {getattr(torch.ops.aten, name) for name in ("narrow", "split", "split_with_sizes")} | (
    _ELEMENT_MOVES - {getattr(torch.ops.aten, name) for name in (
        "copy_", "copy", "index", "index_put_", "index_put", "fill_", "fill", "masked_fill_", "masked_fill")})

# ops that pick positions by comparing values (a router's top-k experts, Switch Transformers' argmax): over
# values no one knows, their indices are drawn as over independent uniform values, so the selections that
# follow (`torch.where(top_k == e)`, tokens per expert) read a typical routing, balanced in expectation,
# as a freshly initialised router gives; what rests on such a draw flags the estimate approximate
_TYPICAL_SELECTIONS = {torch.ops.aten.topk, torch.ops.aten.argmax, torch.ops.aten.argmin, torch.ops.aten.max,
                       torch.ops.aten.min, torch.ops.aten.sort, torch.ops.aten.kthvalue}


def drawn(op_name: str) -> bool:
    """Whether an op named in Trace.approximate_ops is a selection drawn (_TYPICAL_SELECTIONS) or a random
    integer read as its median (_TYPICAL_DRAWS): its draw repeats when recomputed (a checkpoint restores
    torch's generators), so unlike an assumed shape it does not keep a checkpoint from it."""
    return any(op_name.startswith(f"{packet}.") for packet in (*_TYPICAL_SELECTIONS, *_TYPICAL_DRAWS))


@dataclass
class _CooParts:
    """A sparse COO tensor's parts: its index and value tensors (which hold its memory), and its flag."""

    indices: torch.Tensor
    values: torch.Tensor
    coalesced: bool


class _SparseTensors:
    """The sparse COO tensors of a step (nn.Embedding(sparse=True)'s gradients, and what gradient
    accumulation and the optimizers make of them) as eager's CPU kernels make them. Their fake kernels
    miscount them: a clone or a product comes out with no elements, an in-place sum keeps its old count.
    So the tracer runs these ops (_SPARSE_OPS) on each tensor's parts, kept here, allocating the parts
    eager's kernels allocate and the scratch they hold (measured against the allocator's events).
    Other ops that make or read sparse tensors fail the estimate, named."""

    def __init__(self, known: _RealValues, approximate: list[str], rules: TraceRules | None = None,
                 in_autograd_engine: Callable[[], bool] = lambda: False) -> None:
        self.known = known  # the real values of the parts where known (token ids as indices)
        self.approximate = approximate  # where an op's result is a bound, its name is added
        self.rules = rules
        self.in_autograd_engine = in_autograd_engine
        self.parts: WeakTensorKeyDictionary = WeakTensorKeyDictionary()  # a sparse fake tensor -> _CooParts

    def of(self, tensor: torch.Tensor) -> _CooParts:
        if tensor not in self.parts:  # made outside the step (a sparse input): the fake kernel counted it
            with _disable_current_modes():
                self.parts[tensor] = _CooParts(tensor._indices(), tensor._values(), tensor.is_coalesced())
        return self.parts[tensor]

    def strided(self, tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The strided tensors that hold `tensor`'s memory (a sparse tensor has no storage of its own)."""
        if tensor.layout is torch.strided:
            return (tensor,)
        if tensor.layout is torch.sparse_coo:
            parts = self.of(tensor)
            return (parts.indices, parts.values)
        with _disable_current_modes():  # not ops of the step
            return memory_parts(tensor)

    def make(self, size: Sequence[int], indices: torch.Tensor, values: torch.Tensor, coalesced: bool) -> torch.Tensor:
        """A sparse tensor of `size` over these parts. The fake tensor itself holds stand-ins of them, not
        them: where an in-place op gives it new parts, the old ones die as eager's do."""
        out = torch.ops.aten._sparse_coo_tensor_with_dims_and_tensors(
            indices.shape[0], values.dim() - 1, list(size), torch.empty_like(indices), torch.empty_like(values),
            dtype=values.dtype, layout=torch.sparse_coo, device=values.device, is_coalesced=coalesced)
        self.parts[out] = _CooParts(indices, values, coalesced)
        return out

    def real(self, tensor: torch.Tensor) -> torch.Tensor | None:
        return self.known.real.get(tensor)

    def computed(self, compute: Callable[..., torch.Tensor], *sources: torch.Tensor) -> torch.Tensor | None:
        """`compute` of the sources' real values, None where one is unknown."""
        reals = [self.real(source) for source in sources]
        if any(real is None for real in reals):
            return None
        with _disable_current_modes():  # real tensors: no op of the step
            return compute(*reals)

    def derived(self, fake: torch.Tensor, compute: Callable[..., torch.Tensor], *sources: torch.Tensor) -> torch.Tensor:
        """`fake`, its values known as `compute` of the sources' where theirs are (indices copied, joined)."""
        real = self.computed(compute, *sources)
        if real is not None:
            self.known.keep([fake], [real])
        return fake


def _sparse_constructed(table: _SparseTensors, sparse_dim: int, dense_dim: int, size: list[int],
                        indices: torch.Tensor, values: torch.Tensor, **kwargs: Any) -> tuple[torch.Tensor, int]:
    """torch.sparse_coo_tensor: the sparse tensor holds the index and value tensors given (no copy)."""
    return table.make(size, indices, values, bool(kwargs.get("is_coalesced"))), 0


def _sparse_shared(func: Any) -> Callable[..., tuple[torch.Tensor, int]]:
    """detach and alias: a new tensor over the same parts."""
    def run(table: _SparseTensors, tensor: torch.Tensor, *args: Any) -> tuple[torch.Tensor, int]:
        out = func(tensor, *args)
        table.parts[out] = table.of(tensor)
        return out, 0
    return run


def _sparse_part(name: str) -> Callable[..., tuple[torch.Tensor, int]]:
    """_indices, _values (and the public indices, values): views of the part."""
    def run(table: _SparseTensors, tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
        part = getattr(table.of(tensor), name)
        return table.derived(torch.ops.aten.alias(part), lambda real: real, part), 0
    return run


def _sparse_cloned(table: _SparseTensors, tensor: torch.Tensor, **kwargs: Any) -> tuple[torch.Tensor, int]:
    """A copy of the parts; but autograd's first gradient of a parameter (AccumulateGrad), made fresh by
    backward, is taken over without copying: eager's engine finds no other reference to its parts, the
    tracer's references keep it from seeing that (accumulate_grad.h)."""
    parts = table.of(tensor)
    if table.in_autograd_engine():
        return _sparse_shared(torch.ops.aten.detach.default)(table, tensor)
    indices = table.derived(parts.indices.clone(), lambda real: real, parts.indices)
    return table.make(tensor.shape, indices, parts.values.clone(), parts.coalesced), 0


def _sparse_coalesced(table: _SparseTensors, tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Eager's coalesce allocates its result for every element, then narrows it to the distinct indices;
    it sorts the flattened indices meanwhile ((sparse dims + 2) x 8 B an element of scratch). The
    distinct count comes from the indices' values where known (token ids), else every index is taken
    as distinct (an upper bound, flagged)."""
    parts = table.of(tensor)
    sparse_dim, count = parts.indices.shape
    distinct = table.computed(lambda real: torch.unique(real, dim=1), parts.indices)
    kept = count if distinct is None else distinct.shape[1]
    if distinct is None and count > 1:
        table.approximate.append(str(torch.ops.aten._coalesce.default))
    row = parts.values[0].numel() if parts.values.dim() > 1 else 1
    indices = torch.empty(sparse_dim * count, dtype=parts.indices.dtype, device=parts.indices.device)
    indices = table.derived(indices[: sparse_dim * kept].view(sparse_dim, kept), lambda real: distinct, parts.indices)
    values = torch.empty(count * row, dtype=parts.values.dtype, device=parts.values.device)
    values = values[: kept * row].view(kept, *parts.values.shape[1:])
    return table.make(tensor.shape, indices, values, True), (sparse_dim + 2) * count * 8


def _sparse_concatenated(parts: list[_CooParts], table: _SparseTensors) -> tuple[torch.Tensor, torch.Tensor]:
    """The parts of a sum of sparse tensors: eager's CPU kernel concatenates them (coalescing neither)."""
    indices = table.derived(torch.cat([p.indices for p in parts], dim=1), lambda *reals: torch.cat(reals, dim=1),
                            *(p.indices for p in parts))
    return indices, torch.cat([p.values for p in parts])


def _sparse_added(in_place: bool) -> Callable[..., tuple[torch.Tensor, int]]:
    """A sum of sparse tensors (autograd's gradient accumulation, momentum): their parts concatenated.
    Into a dense tensor (a parameter's update) the fake kernel is right: a dense result."""
    def run(table: _SparseTensors, a: torch.Tensor, b: Any, **kwargs: Any) -> tuple[torch.Tensor, int]:
        if not (isinstance(b, torch.Tensor) and b.layout is torch.sparse_coo and a.layout is torch.sparse_coo):
            op = torch.ops.aten.add_.Tensor if in_place else torch.ops.aten.add.Tensor
            out = op(a, b, **kwargs)
            return out, int(table.rules.scratch(op, (a, b), kwargs, out)) if table.rules else 0
        first, second = table.of(a), table.of(b)
        if first.coalesced and second.coalesced:  # eager merges the two: at most this many
            table.approximate.append(str(torch.ops.aten.add.Tensor))
        indices, values = _sparse_concatenated([first, second], table)
        if not in_place:
            return table.make(a.shape, indices, values, False), 0
        table.parts[a] = _CooParts(indices, values, False)  # the old parts die unless held elsewhere
        return a, 0
    return run


def _sparse_scaled(in_place: bool) -> Callable[..., tuple[torch.Tensor, int]]:
    """A sparse tensor times a scalar (momentum's decay): eager copies the indices and writes new values,
    in place too (the old parts are freed)."""
    def run(table: _SparseTensors, tensor: torch.Tensor, other: Any) -> tuple[torch.Tensor, int]:
        parts = table.of(tensor)
        indices = table.derived(parts.indices.clone(), lambda real: real, parts.indices)
        values = parts.values * other
        if not in_place:
            return table.make(tensor.shape, indices, values, parts.coalesced), 0
        table.parts[tensor] = _CooParts(indices, values, parts.coalesced)
        return tensor, 0
    return run


def _sparse_masked(table: _SparseTensors, dense: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, int]:
    """dense.sparse_mask(mask) (Adagrad's sparse step): the mask's indices copied, the dense rows gathered
    into new values, and a product of the same size and a one-element tensor held while it runs."""
    parts = table.of(mask)
    indices = table.derived(parts.indices.clone(), lambda real: real, parts.indices)
    values = dense.new_empty((parts.values.shape[0], *dense.shape[parts.indices.shape[0]:]))
    return table.make(mask.shape, indices, values, parts.coalesced), (values.numel() + 1) * values.element_size()


def _by_sparse_table(func: Any, args: tuple, kwargs: dict, sparse_inputs: bool) -> bool:
    """Whether the sparse table runs this call: an op of _SPARSE_OPS over sparse tensors, or making one."""
    if func not in _SPARSE_OPS:
        return False
    return sparse_inputs or (func in _SPARSE_CONSTRUCTORS and _SPARSE_CONSTRUCTORS[func](args, kwargs))


def _embedding_bag_backward(table: _SparseTensors, grad: torch.Tensor, indices: torch.Tensor, offsets: torch.Tensor,
                            offset2bag: torch.Tensor, bag_size: torch.Tensor, maximum_indices: torch.Tensor,
                            num_weights: int, scale_grad_by_freq: bool, mode: int, sparse: bool,
                            per_sample_weights: torch.Tensor | None, padding_idx: int = -1) -> tuple[torch.Tensor, int]:
    """nn.EmbeddingBag(sparse=True)'s weight gradient (eager's _embedding_bag_sparse_backward): one row of
    values per index, gathered from its bag's gradient, over the indices themselves (a view); a sum
    recounts which bag each index is in ((indices + 1) x 8 B), a mean scales by the bag sizes.
    Its fake kernel miscounts the rows (a dense gradient is no sparse table's: _SPARSE_CONSTRUCTORS)."""
    if padding_idx >= 0 or scale_grad_by_freq:  # rows dropped or scaled by the indices' values
        table.approximate.append(str(torch.ops.aten._embedding_bag_backward.default))
    count = indices.numel()
    values = grad.new_empty((count, grad.shape[-1]))
    scratch = (count + 1) * 8 if mode == 0 else (2 * offsets.numel() + count) * grad.element_size()
    flat = table.derived(indices.reshape(1, -1), lambda real: real.reshape(1, -1), indices)
    return table.make((num_weights, grad.shape[-1]), flat, values, False), scratch


def _sparse_transposed(table: _SparseTensors, tensor: torch.Tensor, *dims: int) -> tuple[torch.Tensor, int]:
    """A sparse matrix transposed (a sparse product's backward): eager copies the indices, rows swapped,
    and the values, sorting through one index-sized buffer."""
    if tensor.layout is not torch.sparse_coo or tensor.dense_dim():
        raise NotImplementedError(f"a transpose of a {tensor.layout} tensor with dense dimensions is not modelled")
    parts = table.of(tensor)
    first, second = dims or (0, 1)
    size = list(tensor.shape)
    size[first], size[second] = size[second], size[first]
    return table.make(size, parts.indices.clone(), parts.values.clone(), False), parts.indices.shape[1] * 8


def _sparse_product(func: Any, zeros_first: bool) -> Callable[..., tuple[torch.Tensor, int]]:
    """A sparse (COO) matrix times a dense one: a dense result. `zeros_first`: eager's kernel adds the
    product to zeros of the result's size that it makes first (mm, as torch.sparse.mm: _sparse_mm)."""
    def run(table: _SparseTensors, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, int]:
        if any(isinstance(a, torch.Tensor) and a.layout not in (torch.strided, torch.sparse_coo) for a in args):
            raise NotImplementedError(f"{func} on {[a.layout for a in args if isinstance(a, torch.Tensor)]} is not modelled")
        out = func(*args, **kwargs)
        return out, out.numel() * out.element_size() if zeros_first else 0
    return run


def _sparse_flag(table: _SparseTensors, tensor: torch.Tensor) -> tuple[bool, int]:
    return table.of(tensor).coalesced, 0


def _sparse_flagged(table: _SparseTensors, tensor: torch.Tensor, coalesced: bool) -> tuple[torch.Tensor, int]:
    table.of(tensor).coalesced = coalesced
    return tensor, 0


def _sparse_count(table: _SparseTensors, tensor: torch.Tensor) -> tuple[int, int]:
    return table.of(tensor).values.shape[0], 0


_aten = torch.ops.aten
# ops that make sparse tensors from strided ones -> whether a call does (args, kwargs -> bool)
_SPARSE_CONSTRUCTORS: dict[Any, Callable[[tuple, dict], bool]] = {
    _aten._sparse_coo_tensor_with_dims_and_tensors.default: lambda args, kwargs: True,
    _aten._embedding_bag_backward.default: lambda args, kwargs: args[9] if len(args) > 9 else kwargs["sparse"],
}
# op on sparse COO tensors -> (the table, *args, **kwargs) -> (its result, the scratch bytes its kernel holds)
_SPARSE_OPS: dict[Any, Callable[..., tuple[Any, int]]] = {
    _aten._sparse_coo_tensor_with_dims_and_tensors.default: _sparse_constructed,
    _aten.detach.default: _sparse_shared(_aten.detach.default),
    _aten.alias.default: _sparse_shared(_aten.alias.default),
    _aten._indices.default: _sparse_part("indices"),
    _aten.indices.default: _sparse_part("indices"),
    _aten._values.default: _sparse_part("values"),
    _aten.values.default: _sparse_part("values"),
    _aten._nnz.default: _sparse_count,
    _aten.is_coalesced.default: _sparse_flag,
    _aten._coalesced_.default: _sparse_flagged,
    _aten._coalesce.default: _sparse_coalesced,
    _aten.clone.default: _sparse_cloned,
    _aten.add.Tensor: _sparse_added(in_place=False),
    _aten.add_.Tensor: _sparse_added(in_place=True),
    _aten.mul.Tensor: _sparse_scaled(in_place=False),
    _aten.mul_.Tensor: _sparse_scaled(in_place=True),
    _aten.mul.Scalar: _sparse_scaled(in_place=False),
    _aten.mul_.Scalar: _sparse_scaled(in_place=True),
    _aten.sparse_mask.default: _sparse_masked,
    _aten._embedding_bag_backward.default: _embedding_bag_backward,
    _aten.t.default: _sparse_transposed,
    _aten.transpose.int: _sparse_transposed,
    _aten._sparse_addmm.default: _sparse_product(_aten._sparse_addmm.default, zeros_first=False),
    _aten.mm.default: _sparse_product(_aten.mm.default, zeros_first=True),
    _aten.addmm.default: _sparse_product(_aten.addmm.default, zeros_first=False),
}


class _RealValues:
    """Real values kept beside small fake tensors whose values are known: computed by deterministic
    ops from Python constants and other known values alone (or from real tensors, which are their own
    values), by running each op a second time, for real, with the modes disabled. An op that writes a
    known tensor otherwise (random init, an unknown operand) drops the values of every tensor over
    that storage. `keeps` says which fake outputs may be known (size and dtype). `draws`: random integer
    and bool tensors are drawn for real too (token ids, labels: typical values, as a real run has)."""

    def __init__(self, keeps: Callable[[torch.Tensor], bool], draws: bool = False, selections: bool = False) -> None:
        self.keeps = keeps
        self.draws = draws  # random integer and bool tensors too (see `compute`)
        self.selections = selections  # indices of _TYPICAL_SELECTIONS over unknown values too (see `selected`)
        self.real: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
        self.typical: WeakTensorKeyDictionary = WeakTensorKeyDictionary()  # known from a draw: its op's name
        # fake -> per-element stand-ins of a many-element float draw (each element its distribution's
        # median) and of what pointwise ops and element moves make of them: read back one element at a
        # time only (`_Recorder._scalar`), never as a whole (see `_per_element`)
        self.elements: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
        # fake -> (values, known): a tensor whose values are known in part only (a concatenation of known and
        # unknown tensors, and what element moves and pointwise ops make of it), the unknown elements zero
        # in `values`; a part cut from it that is known whole becomes known (`real`, see `_partial`)
        self.partial: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
        self.storages: weakref.WeakSet[torch.UntypedStorage] = weakref.WeakSet()  # those some value is over
        # generator -> (its state before this build's latest run of draws from it, the state they left it in)
        self.drawn: dict[torch.Generator, tuple[torch.Tensor, torch.Tensor]] = {}
        self.advance_budget = ADVANCE_LIMIT  # elements left to draw on stand-ins (`advance`)

    def __contains__(self, tensor: torch.Tensor) -> bool:
        return tensor in self.real

    def item(self, tensor: torch.Tensor) -> Any:
        with _disable_current_modes():  # the fake mode below would take the real tensor for a fake one
            return self.real[tensor].item()

    def value(self, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        if not isinstance(value, FakeTensor):
            return value  # a real tensor (torch.tensor's data before lift_fresh) is its own value
        return self.real.get(value)

    def compute(self, func: Any, args: tuple, kwargs: dict, written: list[torch.Tensor], random: bool = False) -> Any:
        """The op's real outputs, or None where an operand's value is unknown (or the op fails). A random
        op only where `random`: drawn for real, the generators put back when the build ends."""
        draw = torch.Tag.nondeterministic_seeded in func.tags
        if draw and not random:
            return None
        if any(not (isinstance(t, FakeTensor) and t in self.real) for t in written):
            return None  # never write a real tensor that is not ours (a module-level constant)
        flat, spec = tree_flatten((args, kwargs))
        real_flat = []
        for value in flat:
            real = self.value(value)
            if real is None and value is not None:  # (an optional argument left out is no unknown)
                return None
            real_flat.append(real)
        real_args, real_kwargs = tree_unflatten(real_flat, spec)
        generators = ([g for g in real_flat if isinstance(g, torch.Generator)] or [torch.default_generator]) if draw else []
        try:
            with _disable_current_modes(), self._drawing(generators):
                return func(*real_args, **real_kwargs)
        except Exception:  # noqa: BLE001 - no value, no harm: unknown values read as before
            return None

    def advance(self, func: Any, args: tuple, kwargs: dict) -> None:
        """A draw whose values are not kept (a float draw, a parameter's initialization into a tensor of
        unknown values or over `keeps`' size): run it for real on stand-ins of its operands, their
        values where known, so the generator moves on as the real draw moves it and the draws after it
        read as eager's (the token ids and labels a factory draws after building the model: after an
        `nn.Embedding(1000, 32)`, an adaptive softmax's targets fell in other clusters than the real
        step's, its forward 4,568 B short). Within ADVANCE_LIMIT elements a build and ADVANCE_DRAW_LIMIT
        a draw (a 70B-parameter configuration is not initialized for real); past them the generator is
        left where it is from there on, and later draws differ from eager's, as they did before."""
        flat, spec = tree_flatten((args, kwargs))
        tensors = [v for v in flat if isinstance(v, torch.Tensor)]
        numel = sum(t.numel() for t in tensors)
        if numel > min(self.advance_budget, ADVANCE_DRAW_LIMIT) or any(t.layout is not torch.strided for t in tensors):
            self.advance_budget = 0  # one draw skipped: the generator is off from here on, so draw no more
            return
        self.advance_budget -= numel

        def stand_in(value: Any) -> Any:
            if not isinstance(value, torch.Tensor):
                return value
            real = self.value(value)
            if real is not None:
                return real.clone()  # a copy: the draw may write it, and its known value stays the fake's
            if not is_non_overlapping_and_dense_or_false(value):
                return torch.zeros(value.shape, dtype=value.dtype)
            return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype).zero_()  # laid out as eager's

        generators = [g for g in flat if isinstance(g, torch.Generator)] or [torch.default_generator]
        with _disable_current_modes():
            real_args, real_kwargs = tree_unflatten([stand_in(v) for v in flat], spec)
            # a stand-in the draw refuses leaves the generator where it is (as before)
            with self._drawing(generators), contextlib.suppress(Exception):
                func(*real_args, **real_kwargs)

    @contextlib.contextmanager
    def _drawing(self, generators: list[torch.Generator]) -> Iterator[None]:
        """Draw from the generators themselves, so that two draws in a row differ as in a real run (an
        edge index's two rows of `randint`: drawn from one state, every edge was a self-loop) and a
        reseed between them counts; remember where each run of draws began (`put_generators_back`)."""
        befores = [g.get_state() for g in generators]
        try:
            yield
        finally:
            for g, before in zip(generators, befores):
                began, left = self.drawn.get(g, (None, None))
                continued = left is not None and torch.equal(left, before)  # nothing else moved it since
                self.drawn[g] = (began if continued else before, g.get_state())

    def put_generators_back(self) -> None:
        """Undo the draws: a generator that the program has not moved since the last of them returns to
        where they began, so tracing consumes none of the program's random numbers."""
        with _disable_current_modes():
            for g, (began, left) in self.drawn.items():
                if torch.equal(g.get_state(), left):
                    g.set_state(began)
        self.drawn.clear()

    def median(self, func: Any, args: tuple, kwargs: dict, out: torch.Tensor) -> torch.Tensor:
        """A single draw's stand-in value (`_DRAW_MEDIANS`)."""
        with _disable_current_modes():
            return torch.full(out.shape, _DRAW_MEDIANS[func._overloadpacket](*args, **kwargs), dtype=out.dtype)

    def selected(self, func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor | None]:
        """A _TYPICAL_SELECTIONS op's integer outputs (its indices, flattened) over uniform stand-ins for
        the values no one knows; its other outputs None (still unknown)."""
        flat, spec = tree_flatten((args, kwargs))
        unknown = tuple(tuple(v.shape) for v in flat if isinstance(v, FakeTensor) and v not in self.real)
        # one draw per op and shapes: every call of it selects alike (each layer's router), and a
        # checkpoint's recomputation selects as its forward did
        stand_ins = torch.Generator().manual_seed(zlib.crc32(repr((str(func), unknown)).encode()))
        with _disable_current_modes():
            reals = [torch.rand(v.shape, generator=stand_ins) if isinstance(v, FakeTensor) and v not in self.real
                     else self.value(v) for v in flat]
            real_args, real_kwargs = tree_unflatten(reals, spec)
            try:
                out = func(*real_args, **real_kwargs)
            except Exception:  # noqa: BLE001 - no value, no harm: unknown values read as before
                return []
        return [o if isinstance(o, torch.Tensor) and not o.is_floating_point() else None for o in tree_flatten(out)[0]]

    def element(self, tensor: torch.Tensor) -> Any:
        """A one-element tensor's per-element stand-in (`elements`), or None."""
        if tensor.numel() != 1 or tensor not in self.elements:
            return None
        with _disable_current_modes():
            return self.elements[tensor].item()

    def _per_element(self, func: Any, args: tuple, kwargs: dict, flat_out: list[Any], written: list[torch.Tensor]
                     ) -> bool:
        """Keep per-element stand-ins (`elements`) for a many-element float draw (each element its
        distribution's median, as a single draw reads) and for a pointwise op or an element move over
        them; whether it did. Each element is a draw of its own: its likelier side is what a real step
        reads when it tests that element alone (CaiT's and XCiT's layer dropout: `to_drop =
        torch.zeros(depth).uniform_(0, 1) < p`, then `if not drop` per layer, every layer kept at p <
        0.5). A reduction over them (`mask.sum()`, `nonzero`) is a count, which no one median stands
        for: such values stay unknown (`real`), as before."""
        outputs = [t for t in flat_out if isinstance(t, FakeTensor)]
        if func._overloadpacket in _DRAW_MEDIANS:
            if len(outputs) != 1 or not outputs[0].is_floating_point():
                return False
            self.forget(written)  # a draw in place overwrites every element (`torch.zeros(n).uniform_()`)
            self.elements[outputs[0]] = self.median(func, args, kwargs, outputs[0])
            return True
        if any(t in self.real for t in written):
            return False  # never write a known value with a stand-in
        flat, spec = tree_flatten((args, kwargs))
        if not any(isinstance(v, FakeTensor) and v in self.elements for v in flat):
            return False
        if torch.Tag.pointwise not in func.tags and func._overloadpacket not in _ELEMENT_MOVES:
            return False
        if any(isinstance(v, FakeTensor) and v not in self.elements and v not in self.real for v in flat):
            return False
        real_args, real_kwargs = tree_unflatten(
            [self.elements.get(v, self.real.get(v)) if isinstance(v, FakeTensor) else v for v in flat], spec)
        try:
            with _disable_current_modes():
                real_out = tree_flatten(func(*real_args, **real_kwargs))[0]
        except Exception:  # noqa: BLE001 - no stand-ins, no harm: the values stay unknown
            return False
        for fake, real in zip(flat_out, real_out):
            if isinstance(fake, FakeTensor) and isinstance(real, torch.Tensor) and fake.shape == real.shape:
                self.elements[fake] = real
        return True

    def _partial(self, func: Any, args: tuple, kwargs: dict, flat_out: list[Any]) -> None:
        """Keep what is known of the outputs of an element move (`_PARTIAL_MOVES`) or a pointwise op whose
        operands are known, known in part (`partial`) or, for a concatenation, unknown: the known elements'
        values, and each output known whole is known (`real`). A pointwise op knows an element where each
        operand knows the one it reads; a move moves the operands' known-masks as it moves their values."""
        pointwise = torch.Tag.pointwise in func.tags
        if func._overloadpacket not in _PARTIAL_MOVES and not pointwise:
            return
        flat, spec = tree_flatten((args, kwargs))
        tensors = [v for v in flat if isinstance(v, FakeTensor)]
        joins = func._overloadpacket in _JOINS  # a join may take unknown operands; other ops, none
        if not any(v in self.partial for v in tensors) and not (joins and any(v in self.real for v in tensors)):
            return
        if not joins and not all(v in self.real or v in self.partial for v in tensors):
            return
        with _disable_current_modes():
            values, masks = [], []
            for v in flat:
                if not isinstance(v, FakeTensor):
                    values.append(v)
                    masks.append(v)
                elif v in self.real:
                    values.append(self.real[v])
                    masks.append(torch.ones(v.shape, dtype=torch.bool))
                elif v in self.partial:
                    values.append(self.partial[v][0])
                    masks.append(self.partial[v][1])
                else:  # (a concatenation's unknown part)
                    values.append(torch.zeros(v.shape, dtype=v.dtype))
                    masks.append(torch.zeros(v.shape, dtype=torch.bool))
            try:
                real_args, real_kwargs = tree_unflatten(values, spec)
                real_out = tree_flatten(func(*real_args, **real_kwargs))[0]
                if pointwise:
                    out_masks = [functools.reduce(torch.logical_and, [m for v, m in zip(flat, masks)
                                                                      if isinstance(v, FakeTensor)])]
                else:
                    mask_args, mask_kwargs = tree_unflatten(masks, spec)
                    mask_kwargs = {k: v for k, v in mask_kwargs.items() if k != "dtype"}
                    out_masks = tree_flatten(func(*mask_args, **mask_kwargs))[0]
            except Exception:  # noqa: BLE001 - nothing known, no harm: the values stay unknown
                return
            outputs = [(f, r) for f, r in zip(flat_out, real_out) if isinstance(f, FakeTensor)]
            if len(out_masks) == 1 and len(outputs) > 1:
                return
            for (fake, real), mask in zip(outputs, out_masks):
                if not isinstance(real, torch.Tensor) or real.shape != fake.shape or real.dtype != fake.dtype:
                    continue
                mask = mask.to(torch.bool).broadcast_to(fake.shape)
                if bool(mask.all()):
                    self.keep([fake], [real])
                elif bool(mask.any()):
                    self.partial[fake] = (real, mask)
                    self.storages.add(fake.untyped_storage())

    def typical_source(self, values: Any) -> str | None:
        """The selection whose draw the first of `values` (flattened) known from one rests on."""
        return next((self.typical[t] for t in tree_flatten(values)[0] if isinstance(t, FakeTensor) and t in self.typical),
                    None)

    def keep(self, fakes: list[Any], reals: list[Any], typical: str | None = None) -> None:
        """Pair the fake outputs with their real values (both flattened); `typical`: the selection whose
        draw they rest on."""
        for fake, real in zip(fakes, reals):
            if isinstance(fake, FakeTensor) and isinstance(real, torch.Tensor) and fake.shape == real.shape \
                    and fake.dtype == real.dtype:
                self.real[fake] = real
                self.storages.add(fake.untyped_storage())
                if typical is not None:
                    self.typical[fake] = typical

    def fakes_of(self, real: Any, device: torch.device, keep: bool = True, typical: str | None = None) -> Any:
        """Fake tensors laid out as a data-dependent op's real outputs (a tensor or a tuple), made in the
        fake mode running; their values kept where `keep` and `keeps` allow."""
        reals = [real] if isinstance(real, torch.Tensor) else list(real)
        fakes = [torch.empty_strided(r.shape, r.stride(), dtype=r.dtype, device=device) for r in reals]
        if keep and all(self.keeps(f) for f in fakes):
            self.keep(fakes, reals, typical)
        return fakes[0] if isinstance(real, torch.Tensor) else tuple(fakes)

    def forget(self, written: list[torch.Tensor]) -> None:
        """`written` got values no one knows: so did every tensor over their storages."""
        for t in written:
            storage = t.untyped_storage()
            if storage in self.storages:
                for key in [k for k in self.real if k.untyped_storage() is storage]:
                    del self.real[key]
                for key in [k for k in self.partial if k.untyped_storage() is storage]:
                    del self.partial[key]

    def run(self, func: Any, args: tuple, kwargs: dict, flat_out: list[Any], written: list[torch.Tensor]) -> None:
        """After the fake op ran (its outputs flattened): keep their real values if they can be known."""
        real_out = None
        typical = self.typical_source((args, kwargs))
        outputs = [t for t in flat_out if isinstance(t, FakeTensor)]
        kept = (outputs or written) and all(self.keeps(t) for t in outputs)
        random = self.draws and all(not t.is_floating_point() and not t.is_complex() for t in (*outputs, *written))
        if kept:
            real_out = self.compute(func, args, kwargs, written, random)
        if self.draws and torch.Tag.nondeterministic_seeded in func.tags and not (random and real_out is not None):
            # a draw whose values stay unknown (a float draw: the node features drawn before the edges; a
            # parameter's initialization): the generator moves on as the real draw moves it, so the
            # integer draws after it read as eager's
            self.advance(func, args, kwargs)
        if kept:
            if real_out is None and func._overloadpacket in _DRAW_MEDIANS and len(outputs) == 1 \
                    and outputs[0].numel() == 1:
                real_out = self.median(func, args, kwargs, outputs[0])
                if func._overloadpacket in _TYPICAL_DRAWS:
                    typical = str(func)
            if real_out is None and self.selections and func._overloadpacket in _TYPICAL_SELECTIONS:
                real_out, typical = self.selected(func, args, kwargs), str(func)
            # (the step's values only, as selections: the factory's float draws stay unknown)
            if real_out is None and self.selections and self._per_element(func, args, kwargs, flat_out, written):
                return
        for t in written:
            self.elements.pop(t, None)
        if real_out is None:
            if written and self.storages:
                self.forget(written)
            if not written and outputs and all(self.keeps(t) for t in outputs):
                self._partial(func, args, kwargs, flat_out)
        else:
            self.keep(flat_out, tree_flatten(real_out)[0], typical)


class _Lineage:
    """How the factory's fake tensors whose values `_RealValues` does not keep (over its size limit, or
    drawn at random in floating point) were made: each out-of-place op, its operands and, for a draw,
    its generator's state before it. A value read back while building (`.item()`) is computed for real
    from them, on demand (e3nn's `normalize2mom`: `moment(f, 2)` over a million float64 samples drawn
    from a generator of its own, `.pow(-0.5).item()`: a constant a real build computes alike). Operands
    written in place after an op read them (or after they were made) have no lineage to replay: their
    values stay unknown, as before. Values made uninitialized (`torch.empty`) have none either."""

    LIMIT = 1 << 26  # elements computed for one read, all ops together
    _UNINITIALIZED = frozenset(getattr(torch.ops.aten, n) for n in (
        "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_permuted"))

    def __init__(self) -> None:
        # fake output -> (op, args, kwargs, which output, generator states, the operands' and output's versions)
        self.made: WeakTensorKeyDictionary = WeakTensorKeyDictionary()

    @staticmethod
    def states(func: Any, args: tuple, kwargs: dict) -> list[tuple[torch.Generator, torch.Tensor]] | None:
        """A draw's generators and their states before it (None: not a draw)."""
        if torch.Tag.nondeterministic_seeded not in func.tags:
            return None
        generators = [g for g in tree_flatten((args, kwargs))[0] if isinstance(g, torch.Generator)]
        with _disable_current_modes():
            return [(g, g.get_state()) for g in generators or [torch.default_generator]]

    def record(self, func: Any, args: tuple, kwargs: dict, flat_out: list[Any], states: Any, values: _RealValues) -> None:
        if func._overloadpacket in self._UNINITIALIZED or not flat_out:
            return
        operands = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if any(isinstance(t, FakeTensor) and t not in values and t not in self.made for t in operands) \
                or any(t.layout is not torch.strided for t in operands):
            return
        versions = tuple(t._version for t in operands)
        for index, out in enumerate(flat_out):
            if isinstance(out, FakeTensor) and out not in values and out.layout is torch.strided:
                self.made[out] = (func, args, kwargs, index, states, versions, out._version)

    def realize(self, tensor: Any, values: _RealValues) -> torch.Tensor | None:
        """The real value of a fake tensor made by the factory, or None where it cannot be known."""
        budget = [self.LIMIT]
        memo: dict[int, torch.Tensor | None] = {}
        try:
            with _disable_current_modes():
                return self._realize(tensor, values, memo, budget)
        except (RecursionError, RuntimeError, ValueError, TypeError, IndexError):
            return None

    def _realize(self, tensor: Any, values: _RealValues, memo: dict, budget: list[int]) -> torch.Tensor | None:
        if not isinstance(tensor, FakeTensor):
            return tensor
        if tensor in values:
            return values.real[tensor]
        if id(tensor) in memo:
            return memo[id(tensor)]
        memo[id(tensor)] = None
        entry = self.made.get(tensor)
        if entry is None:
            return None
        func, args, kwargs, index, states, versions, version = entry
        flat, spec = tree_flatten((args, kwargs))
        operands = [t for t in flat if isinstance(t, torch.Tensor)]
        if tensor._version != version or tuple(t._version for t in operands) != versions:
            return None  # written in place since: the recorded ops no longer make its value
        budget[0] -= sum(t.numel() for t in operands) + tensor.numel()
        if budget[0] < 0:
            return None
        reals = []
        for value in flat:
            real = self._realize(value, values, memo, budget) if isinstance(value, torch.Tensor) else value
            if real is None and value is not None:
                return None
            reals.append(real)
        real_args, real_kwargs = tree_unflatten(reals, spec)
        with contextlib.ExitStack() as stack:
            for generator, state in states or ():
                now = generator.get_state()
                stack.callback(generator.set_state, now)
                generator.set_state(state)
            out = tree_flatten(func(*real_args, **real_kwargs))[0][index]
        if not isinstance(out, torch.Tensor) or out.shape != tensor.shape or out.dtype != tensor.dtype:
            return None
        memo[id(tensor)] = out
        return out


class _ConstantShadows(TorchDispatchMode):
    """While the factory builds the model under fake tensors, small tensors computed from constants
    alone (`torch.linspace(0, drop_path_rate, depth).tolist()`, `int(torch.tensor(sizes).prod())`)
    are also computed for real (`_RealValues`), so that reading their values back (`.item()`,
    `.tolist()`) gives the real numbers instead of failing as data-dependent. The inputs it makes that
    are small integer tensors (token ids, labels, drawn for real) pass their values on to the recorder
    (`_Recorder.known`), so that the step's checks on them (`labels.max() >= vocab_size`) read as in a
    real run; nothing else reaches the traced step."""

    LIMIT = 1 << 14  # elements per tensor

    def __init__(self) -> None:
        super().__init__()
        self.values = _RealValues(lambda t: t.numel() <= self.LIMIT, draws=True)
        self.guessed: WeakTensorKeyDictionary = WeakTensorKeyDictionary()  # predicate -> its typical value
        self.approximate: list[str] = []
        self.sparse = _SparseTensors(self.values, self.approximate)  # a sparse input (a graph's adjacency)
        self.lineage = _Lineage()  # how the tensors whose values are not kept were made

    def __exit__(self, *exc: object) -> None:
        self.values.put_generators_back()
        self.lineage = _Lineage()
        super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default and args[0] in self.values:
            return self.values.item(args[0])
        if func is torch.ops.aten._local_scalar_dense.default and args[0] in self.guessed:
            return self.guessed[args[0]]
        if func is torch.ops.aten._local_scalar_dense.default:
            real = self.lineage.realize(args[0], self.values)
            if real is not None:  # a constant made by sampling (e3nn's normalize2mom): as the ops that made it say
                with _disable_current_modes():
                    return real.item()
            if args[0].is_floating_point():
                # a factory that runs the model once to set it up (pyro's AutoNormal traces the model
                # and guide, and Trace_ELBO reads each site's log-probability back with `.item()`): an
                # unknown float reads as the step's recorder reads it (UNKNOWN_FLOAT); integers, which
                # size things, still raise
                return UNKNOWN_FLOAT
        states = self.lineage.states(func, args, kwargs)
        if func in (torch.ops.aten.allclose.default, torch.ops.aten.equal.default):
            # a check of values made at random (parametrizations.orthogonal's right_inverse): it passes
            real = self.values.compute(func, args, kwargs, [])
            return True if real is None else real
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        sparse = any(t.layout is not torch.strided for t in inputs)
        if _by_sparse_table(func, args, kwargs, sparse):
            return _SPARSE_OPS[func](self.sparse, *args, **kwargs)[0]
        if func in _DATA_DEPENDENT and kwargs.get("output_size") is None:
            real = self.values.compute(func, args, kwargs, [])
            if real is not None:  # from known values (timm's RegNet: torch.unique over widths): as the values say
                return self.values.fakes_of(real, inputs[0].device)
        if func in _MASK_INDEXED:
            args = _masks_as_indices(func, args, self._nonzero)[0]
        out = func(*args, **kwargs)
        flat_out = tree_flatten(out)[0]
        if sparse or any(isinstance(t, torch.Tensor) and t.layout is not torch.strided for t in flat_out):
            return out  # no values kept for sparse tensors outside the sparse table (a CSR input)
        written = _written_arguments(func, args, kwargs)
        self.values.run(func, args, kwargs, flat_out, written)
        if not written:
            self.lineage.record(func, args, kwargs, flat_out, states, self.values)
        if func in _TYPICAL_PREDICATES and isinstance(out, FakeTensor) and out not in self.values:
            self.guessed[out] = _TYPICAL_PREDICATES[func]
        return out

    def _nonzero(self, mask: torch.Tensor) -> torch.Tensor:
        """A mask's indices: exact where its values are known (peft's FRoD: `indices[indices[:, 0] !=
        indices[:, 1]]` over a meshgrid of aranges; UniLoRA: `x[counts > 0]` over a bincount of indices
        drawn for real), else every element, as the step's recorder assumes (approximate)."""
        real = self.values.compute(torch.ops.aten.nonzero.default, (mask,), {}, [])
        if real is None:  # every element, in order
            self.approximate.append(str(torch.ops.aten.nonzero.default))
            with _disable_current_modes():
                real = torch.ones(mask.shape, dtype=torch.bool).nonzero()
        return self.values.fakes_of(real, mask.device)


def _functorch_unwrapped(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor inside functorch's wrappers (torch.vmap's batched tensors, torch.func.grad's tracking
    ones), which have no storage of their own."""
    while torch._C._functorch.is_functorch_wrapped_tensor(tensor):
        tensor = torch._C._functorch.get_unwrapped(tensor)
    return tensor


def _masks_as_indices(func: Any, args: tuple, nonzero: Callable[[torch.Tensor], torch.Tensor]
                      ) -> tuple[tuple, list[torch.Tensor]]:
    """`_MASK_INDEXED`'s arguments with each bool or uint8 index replaced by the indices of its true
    elements (`nonzero(mask)`), as eager's kernels do and the fake kernels cannot (a data-dependent
    nonzero); and those indices. `x[mask] = scalar` is a masked fill, run as it is, and makes none
    (TensorAdvancedIndexing.cpp _index_put_impl_: canDispatchToMaskedFill)."""
    indices = args[1]
    if not any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices):
        return args, []
    accumulate = len(args) > 3 and args[3]
    masks = [i for i in indices if i is not None]
    if func is not torch.ops.aten.index.Tensor and not accumulate and len(masks) == 1 \
            and masks[0].dtype == torch.bool and args[2].numel() == 1:
        return args, []
    expanded, made = [], []
    for index in indices:
        if isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8):
            where = nonzero(index)
            made.append(where)
            expanded.extend(where.select(1, d) for d in range(index.dim()))
        else:
            expanded.append(index)
    return (args[0], expanded, *args[2:]), made


def _unpacked(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _without_graph(tensor: torch.Tensor) -> torch.Tensor:
    """What the tracer's pack hook hands autograd to keep: the saved tensor without its autograd node.
    An op that saves its own output (tanh, softmax, exp) would otherwise keep, in its node, a tensor
    that holds the node: a cycle that outlives a branch no backward runs through (a pooler's output
    that no loss reads), where eager, which saves outputs without their node, frees it."""
    with _disable_current_modes():  # not an op of the step
        return tensor.detach()


@contextlib.contextmanager
def _function_modes_kept_through_backward() -> Iterator[None]:
    """`loss.backward()` passes through each TorchFunctionMode's handler, which switches its mode off
    while it runs: the tracer's modes (those entered before this) would miss what backward runs from
    Python, a checkpointed segment's recomputation above all (a Linear's in-place bias add traced out of
    place there was an activation too many). The engine starts with them switched back on."""
    modes = torch.overrides._get_current_function_mode_stack()
    run = torch.autograd._engine_run_backward

    def run_with_modes(*args: Any, **kwargs: Any) -> Any:
        if torch._C._len_torch_function_stack():
            return run(*args, **kwargs)
        with contextlib.ExitStack() as entered:
            for mode in modes:
                entered.enter_context(mode)
            return run(*args, **kwargs)

    with mock.patch.object(torch.autograd, "_engine_run_backward", run_with_modes):
        yield


@contextlib.contextmanager
def _hooks_lifted_for_function_transforms(pack: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[None]:
    """torch.func's grad, vjp, jacrev and hessian refuse to run while any saved-tensor hooks are on
    (functorch's `doesnt_support_saved_tensors_hooks`), and the tracer's own always are: x-transformers'
    NonAutoregressiveWrapper weights its loss by a schedule's derivative, `vmap(grad_and_value(fn))`,
    and the estimate failed where eager, which has no hooks, runs. The tracer's hooks are lifted while
    such a transform runs; what it saves is still counted, as temporaries of its ops."""
    original = torch.autograd.graph.disable_saved_tensors_hooks

    @contextlib.contextmanager
    def disable_saved_tensors_hooks(error_message: str) -> Iterator[None]:
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        ours = top is not None and top[0] is pack
        if ours:
            torch._C._autograd._pop_saved_tensors_default_hooks()
        try:
            with original(error_message):
                yield
        finally:
            if ours:
                torch._C._autograd._push_saved_tensors_default_hooks(*top)

    with mock.patch.object(torch.autograd.graph, "disable_saved_tensors_hooks", disable_saved_tensors_hooks):
        yield


@contextlib.contextmanager
def _checkpoint_inputs_unhooked(pack: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[None]:
    """Saved-tensor hooks (the tracer's, which label saved storages as activations) make autograd
    unpack a new tensor object for each saved one. torch.utils.checkpoint saves a segment's inputs
    that way and recomputes the segment on the unpacked ones, so inputs that were one object (the
    query, key and value of nn.MultiheadAttention's self-attention, tested with `is`) become three,
    the recomputation takes another path, and checkpoint's determinism check raises. Eager has no
    hooks there: the inputs are saved with the tracer's hooks lifted (and labelled all the same)."""
    from torch.utils import checkpoint as torch_checkpoint

    frame = getattr(torch_checkpoint, "_CheckpointFrame", None)
    original = getattr(frame, "save_inputs", None)
    if original is None:
        yield
        return

    def save_inputs(self: Any, *args: Any) -> None:
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        ours = top is not None and top[0] is pack
        if ours:
            torch._C._autograd._pop_saved_tensors_default_hooks()
        try:
            original(self, *args)
        finally:
            if ours:
                torch._C._autograd._push_saved_tensors_default_hooks(*top)
        if ours:
            for arg in args:
                if isinstance(arg, torch.Tensor):
                    pack(arg)

    frame.save_inputs = save_inputs
    try:
        yield
    finally:
        frame.save_inputs = original


class _NotFake(torch.Tensor):
    """What `torch._subclasses.FakeTensor` names for code outside torch while a step is traced: a
    tensor class no tensor belongs to."""


# Packages that see fake tensors as what they are: fake mode itself, the meta kernels, memplan.
_SEES_FAKE = frozenset({"torch", "functorch", "memplan"})


@contextlib.contextmanager
def _fake_tensors_unseen() -> Iterator[None]:
    """A real step has no fake tensors, so code that asks whether a tensor is one before reading its
    values must be told no: the step then takes the branch a real step takes, and reads the values by
    the rules of `_Recorder._scalar`. transformers' `is_tracing(t)` is `isinstance(t,
    torch._subclasses.FakeTensor)` (utils/import_utils.py `is_fake_tensor`); told yes,
    `find_packed_sequence_indices` kept a packed-sequence mask over the position ids, so SDPA
    attention got a materialised causal mask and `repeat_kv` copies instead of `is_causal=True` and
    `enable_gqa` (one to three attention-sized tensors over at the forward peak). While the step runs,
    `torch._subclasses.FakeTensor` names a class no tensor belongs to for callers outside torch and
    memplan (torch.compiler.is_compiling() and torch.jit.is_tracing() are False under fake tensors
    already); `torch._subclasses.fake_tensor.FakeTensor`, what fake mode itself uses, stays."""
    package = torch._subclasses
    real = vars(package).get("FakeTensor")
    if real is None:
        yield
        return
    previous = vars(package).get("__getattr__")

    def __getattr__(name: str) -> Any:
        if name == "FakeTensor":
            caller = sys._getframe(1).f_globals.get("__name__", "")
            return real if caller.partition(".")[0] in _SEES_FAKE else _NotFake
        if previous is not None:
            return previous(name)
        raise AttributeError(f"module {package.__name__!r} has no attribute {name!r}")

    del package.FakeTensor  # a module's __getattr__ answers only the names its dict lacks
    package.__getattr__ = __getattr__  # type: ignore[attr-defined]
    try:
        yield
    finally:
        package.FakeTensor = real  # type: ignore[attr-defined]
        if previous is not None:
            package.__getattr__ = previous  # type: ignore[attr-defined]
        else:
            del package.__getattr__


@contextlib.contextmanager
def _fake_scalars_format_as_values() -> Iterator[None]:
    """`f"{t}"` of a 0-dim tensor formats its value in eager (`Tensor.__format__`: `self.item()`),
    but only where `type(self) is Tensor`; a fake tensor (a subclass) formats as its repr.
    transformers' SwitchTransformers picks an expert by `self[f"expert_{expert_idx[0]}"]`: under
    tracing the key read "expert_FakeTensor(..., size=(), dtype=torch.int64)" and the estimate failed
    with a KeyError. While a step is traced, a 0-dim fake tensor standing for a plain tensor formats
    as its value, read by the recorder's rules (`_Recorder._scalar`: a known value as itself)."""
    original = torch.Tensor.__format__

    def __format__(self: torch.Tensor, format_spec: str) -> str:
        if type(self) is FakeTensor and self.dim() == 0:
            return self.detach().item().__format__(format_spec)
        return original(self, format_spec)

    with mock.patch.object(torch.Tensor, "__format__", __format__):
        yield


@contextlib.contextmanager
def _fake_tensors_to_numpy(recorder: _Recorder) -> Iterator[None]:
    """`Tensor.numpy()` (and NumPy's `np.asarray(t)`, which calls it) refuses tensor subclasses, so a
    step that hands a tensor to NumPy or SciPy failed under tracing where the real step runs:
    transformers' DETR/YOLOS loss matches predictions to targets with
    `scipy.optimize.linear_sum_assignment(cost.cpu())`. A fake tensor converts to its real values
    where the recorder knows them, else to zeros of its shape and dtype: values unknown, as
    `_Recorder._scalar` reads an unknown scalar; what NumPy returns then has the shape it would have
    (an assignment's size is min(rows, columns) whatever the costs)."""
    original = torch.Tensor.numpy

    def numpy(self: torch.Tensor, *, force: bool = False) -> Any:
        if not isinstance(self, FakeTensor):
            return original(self, force=force)
        real = recorder.known.value(self)
        with _disable_current_modes():
            if real is None:
                real = torch.zeros(self.shape, dtype=self.dtype)
            return original(real.detach().cpu(), force=force)

    with mock.patch.object(torch.Tensor, "numpy", numpy):
        yield


@contextlib.contextmanager
def _deepcopy_shares_fake_mode() -> Iterator[None]:
    """`copy.deepcopy` of a fake tensor (nn.TransformerEncoder cloning its layer, an EMA copy of a
    model) deep-copies the tensor's `fake_mode` attribute too, and with it the mode's memo of weak
    storage references (raw pointers): both copies later free the same references, which corrupts
    the heap (segfaults mid-trace). The mode is shared state, never data: copies keep the original.
    A real tensor is copied for real, outside the modes, as eager copies it: a fake tensor made by
    `torch.tensor(0)` (BatchNorm's `num_batches_tracked`) keeps its real value as `constant`, whose copy
    under the fake mode cloned its storage into a fake one and failed (`copy.deepcopy(norm)` per layer,
    as torch_geometric's GCN, GIN and GraphSAGE build their norms)."""
    had = "__deepcopy__" in vars(FakeTensorMode)
    previous = vars(FakeTensorMode).get("__deepcopy__")
    FakeTensorMode.__deepcopy__ = lambda self, memo: self  # type: ignore[attr-defined]
    tensor_deepcopy = torch.Tensor.__deepcopy__

    def deepcopy_real_for_real(tensor: torch.Tensor, memo: dict) -> torch.Tensor:
        if isinstance(tensor, FakeTensor):
            return tensor_deepcopy(tensor, memo)
        with _disable_current_modes():
            return tensor_deepcopy(tensor, memo)

    try:
        with mock.patch.object(torch.Tensor, "__deepcopy__", deepcopy_real_for_real):
            yield
    finally:
        if had:
            FakeTensorMode.__deepcopy__ = previous  # type: ignore[attr-defined]
        else:
            del FakeTensorMode.__deepcopy__  # type: ignore[attr-defined]


@contextlib.contextmanager
def _lazy_parameters_real() -> Iterator[None]:
    """A lazy module's parameters (`nn.LazyLinear`, torch_geometric's `-1` channels, which `to_hetero`
    models take) are made and materialised as real tensors, outside the modes: an uninitialised
    parameter is a tensor subclass made by `_make_subclass`, which refuses a fake tensor, so every
    lazy module failed the build. A factory materialises them with a dry run, as training scripts do;
    they are real while building, as any real parameter handed to the model (converted to fake tensors
    when the step prepares), so these, and only these, take host memory of their size."""

    def outside_modes(function: Callable) -> Callable:
        @functools.wraps(function)
        def run(*args: Any, **kwargs: Any) -> Any:
            with _disable_current_modes():
                return function(*args, **kwargs)

        return run

    made_or_materialised = ((nn.parameter.UninitializedParameter, "__new__"),
                            (nn.parameter.UninitializedBuffer, "__new__"),
                            (nn.parameter.UninitializedTensorMixin, "materialize"))
    with contextlib.ExitStack() as patches:
        for owner, name in made_or_materialised:
            patches.enter_context(mock.patch.object(owner, name, outside_modes(getattr(owner, name))))
        yield


_ABSENT = object()


@contextlib.contextmanager
def _fake_parameters_swap(*tables: Any) -> Iterator[None]:
    """Let nn.Module._apply convert fake parameters (`model.float()`, `.half()`, `.to(dtype)`).

    For a FakeTensor parameter, torch's `Module._apply` always takes the `torch.utils.swap_tensors`
    path (torch 2.13 nn/modules/module.py: `p_should_use_swap_tensors = ... or isinstance(param,
    FakeTensor)`), and `swap_tensors` refuses any tensor that a weak reference points at. Every fake
    tensor an op returns has one: FakeTensorMode memoizes op outputs in a WeakValueDictionary
    (`FakeTensorConverter.from_meta_and_device` -> `tensor_memo`), and `nn.Parameter(fake)` is such
    an output (its `detach`). So under fake tensors any module conversion raised "Couldn't swap",
    for every model. `tables` are memplan's own tables keyed weakly by tensor (`_ConstantShadows`: its
    known values, its guessed predicates, and its lineage, which keys every tensor the factory draws:
    `nn.Parameter(torch.randn(n))` then `self.to(device)` in `__init__`, as imagen-pytorch's Imagen
    does, raised "Couldn't swap" while the lineage was left out).

    Before the swap, the mode's memo entries for the two tensors are dropped (their keys are meta
    tensors gone after the op, or a real tensor whose fake the swap changes: converting it again
    must make a new fake) and the tables' entries are taken out; after it, the tables' entries
    follow the contents they describe. The swap itself is torch's, as in eager: each parameter keeps
    its identity (tied weights stay tied) and takes the converted tensor's dtype and device."""
    original = torch.utils.swap_tensors

    def drop_memo(tensor: torch.Tensor) -> None:
        mode = getattr(tensor, "fake_mode", None) if isinstance(tensor, FakeTensor) else None
        converter = getattr(mode, "fake_tensor_converter", None)
        if converter is None:
            return
        memo = converter.tensor_memo
        for ref in weakref.getweakrefs(tensor):
            if isinstance(ref, weakref.KeyedRef) and memo.data.get(ref.key) is ref:
                del memo[ref.key]

    def swap_tensors(t1: torch.Tensor, t2: torch.Tensor) -> None:
        entries = [(table, table.pop(t1, _ABSENT), table.pop(t2, _ABSENT)) for table in tables]
        drop_memo(t1)
        drop_memo(t2)
        try:
            original(t1, t2)
        except Exception:
            for table, v1, v2 in entries:
                for tensor, value in ((t1, v1), (t2, v2)):
                    if value is not _ABSENT:
                        table[tensor] = value
            raise
        for table, v1, v2 in entries:  # t1 holds what t2 held and the other way round
            for tensor, value in ((t1, v2), (t2, v1)):
                if value is not _ABSENT:
                    table[tensor] = value
            if v2 is _ABSENT and isinstance(v1, torch.Tensor) and v1.shape == t1.shape and v1.dtype != t1.dtype \
                    and v1.is_floating_point() and t1.is_floating_point():
                with _disable_current_modes():  # a known value converted (`model.to(torch.bfloat16)`): as eager's cast
                    table[t1] = v1.to(t1.dtype)

    torch.utils.swap_tensors = swap_tensors
    try:
        yield
    finally:
        torch.utils.swap_tensors = original


class _StorageKeepingFakeMode(FakeTensorMode):
    """FakeTensorMode whose dispatch cache passes over outputs it would rebuild with another storage. A hit
    makes a non-view op's output anew with `empty_strided` (the bytes its strides need, from offset 0),
    so an output cut from a larger buffer (torch.hann_window's 65 samples narrowed to 64) came out
    smaller on every call after the first in a process: the cache is the class's, shared by every trace."""

    def _validate_output_for_cache_entry(self, state: Any, key: Any, func: Any, args: Any, kwargs: Any,
                                         output: Any) -> None:
        super()._validate_output_for_cache_entry(state, key, func, args, kwargs, output)
        if isinstance(output, FakeTensor) and not getattr(func, "is_view", False) and output.layout is torch.strided \
                and (output.storage_offset() or output.untyped_storage().nbytes() != _dense_extent(output)):
            raise _BypassDispatchCache("a storage larger than its output")


def _plain_tensor_attributes(model: nn.Module) -> list[torch.Tensor]:
    """Tensors a module keeps as plain attributes, neither parameters nor buffers, directly or in a list,
    tuple or dict (TabNet's `self.continuous_idx = torch.ones(n, dtype=torch.bool)`, then
    `self.continuous_idx[cat_idxs] = 0`, which its forward iterates over to choose each column's
    embedding): the precision converts none of them, and a real step reads their values as built."""
    found: list[torch.Tensor] = []
    for module in model.modules():
        for name, value in vars(module).items():
            if name in _MODULE_ATTRIBUTES:
                continue
            parts = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else (value,)
            found.extend(t for t in parts if isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter))
    return found


def _dense_extent(tensor: torch.Tensor) -> int:
    """The bytes `empty_strided` gives a tensor of this shape and strides."""
    if tensor.numel() == 0:
        return 0
    return (1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))) * tensor.element_size()


def trace_step(workload: Workload, config: StepConfig, rules: TraceRules = TraceRules(),
               transform: Callable[[nn.Module], nn.Module] | None = None) -> Trace:
    """Run the training step of `config` on `workload` under fake tensors and record it.
    `transform` is applied to the built model first (e.g. a checkpoint plan)."""
    recorder = _Recorder(rules)
    calls: list[ModuleCall] = []
    shadows = _ConstantShadows()
    with model_caches_emptied_after(), _StorageKeepingFakeMode(allow_non_fake_inputs=True), _deepcopy_shares_fake_mode(), \
            _fake_parameters_swap(shadows.values.real, shadows.guessed, shadows.lineage.made), _lazy_parameters_real():
        with shadows, _Rewrites(_FACTORY_REWRITES):
            model, inputs = workload.build()
        if transform is not None:
            model = transform(model)
        prepared = prepare_step(model, inputs, config, "cpu", foreach=rules.foreach, stand_in=True)
        del model, inputs
        recorder.sparse.parts.update(shadows.sparse.parts)
        _register_baseline(recorder, prepared)
        parameters = frozenset(recorder.ids[p.untyped_storage()] for p in prepared.model.parameters())
        # the inputs' known values, and those of the buffers the model made from constants (EnCodec's
        # padded convolutions keep their stride and kernel size as int64 buffers and pad by
        # `(length - kernel_size + padding_total) / stride`; a neural ODE's time points, a float
        # `linspace` from which torchdiffeq's fixed-step solvers size their grid with `.item()`): a real
        # step reads their values
        buffers = list(prepared.model.buffers())
        recorder.approximate.extend(shadows.approximate)
        held = [*_input_tensors(prepared), *buffers, *_plain_tensor_attributes(prepared.model)]
        for value in (part for t in held for part in recorder.sparse.strided(t)):
            if value in shadows.values and recorder.known.keeps(value):
                with _disable_current_modes():  # a buffer the precision converted in place: its value cast as eager's
                    recorder.known.keep([value], [shadows.values.real[value].to(value.dtype)])
        # nothing here may keep a buffer alive through the step: a forward that replaces one
        # (`self.register_buffer(name, new)`, `self.stat = new`) frees the old block in eager
        del buffers, held
        value = None
        del shadows
        module_types = {name: type(m).__name__ for name, m in prepared.model.named_modules()}

        def on_phase(phase: str, step: int) -> None:
            if phase == "optimizer":  # the gradients exist now: name their storages
                for p in _all_params(prepared):
                    if p.grad is not None:
                        recorder.set_role(p.grad, "gradients")
            if phase == "end":
                for tensor in _optimizer_state(prepared):
                    recorder.set_role(tensor, "optimizer_state")
            recorder.begin_phase(phase, step)

        def mark_saved(tensor: torch.Tensor) -> torch.Tensor:
            if recorder.ops:  # autograd saves an op's inputs before it runs, its outputs after: count them near it
                recorder.saved_tensors[len(recorder.ops) - 1] += 1
                recorder.first_save_clock.setdefault(len(recorder.ops) - 1, recorder.module_hooks)
            for sid in (recorder.ids.get(s) for s in recorder.storages_of([tensor])):
                if sid is None:
                    continue
                recorder.saved_at[sid].add(recorder.module_hooks)
                if recorder.storages[sid]["role"] == "temporaries":
                    recorder.storages[sid]["role"] = "activations"
            kept = _without_graph(tensor)
            if tensor in recorder.known:  # backward reads the same values (a mask indexing as in forward)
                recorder.known.keep([kept], [recorder.known.real[tensor]])
            return kept

        run_kwargs = {"autocast": rules.autocast} if rules.autocast else {}
        try:
            with rules.function_mode(), _fake_tensors_unseen(), _fake_scalars_format_as_values(), \
                    _fake_tensors_to_numpy(recorder), _SavedWrappedNumbers(recorder), _InPlaceScopes(recorder), \
                    _Rewrites(), recorder, _module_scopes(recorder, prepared.model, calls), \
                    torch.autograd.graph.saved_tensors_hooks(mark_saved, _unpacked), _checkpoint_inputs_unhooked(mark_saved), \
                    _hooks_lifted_for_function_transforms(mark_saved), \
                    _function_modes_kept_through_backward():
                run_steps(prepared, config, on_phase=on_phase, **run_kwargs)
        finally:
            if hasattr(rules.autocast, "close"):
                rules.autocast.close()  # the emulated autocast kernels stay registered until closed
    storages = {
        sid: Storage(sid, s["nbytes"], s["role"], s["op"], s["module"]) for sid, s in recorder.storages.items()
    }
    events = _cut_after_last_step(tuple(recorder.events))
    return Trace(
        ops=tuple(recorder.ops),
        storages=storages,
        events=events,
        calls=tuple(calls),
        module_types=module_types,
        approximate_ops=tuple(dict.fromkeys(recorder.approximate)),
        saved_tensors=dict(recorder.saved_tensors),
        first_save_clock=recorder.first_save_clock,
        saved_at={sid: tuple(sorted(times)) for sid, times in recorder.saved_at.items()},
        parameters=parameters,
    )


def _cut_after_last_step(events: tuple[Event, ...]) -> tuple[Event, ...]:
    """Drop the frees that happen when the tracer lets go of the step's objects."""
    for i in range(len(events) - 1, -1, -1):
        if events[i].kind == "phase" and events[i].phase == "end":
            return events[: i + 1]
    return events


def _register_baseline(recorder: _Recorder, prepared: PreparedStep) -> None:
    def register(tensors: Iterable[torch.Tensor], role: str) -> None:
        for tensor in tensors:
            for part in recorder.sparse.strided(tensor):  # a sparse input: its index and value tensors
                recorder.register(part, role)

    register(prepared.model.parameters(), "weights")
    register(prepared.model.buffers(), "weights")
    register((master for _, master in prepared.master_pairs), "optimizer_state")  # as in ZeRO
    register(_optimizer_state(prepared), "optimizer_state")  # what the optimizer makes when built (Adagrad's sums)
    register(_input_tensors(prepared), "inputs")


def _input_tensors(prepared: PreparedStep) -> list[torch.Tensor]:
    """Its tensors, nested ones too (DETR/YOLOS take their targets as a list of dicts of tensors)."""
    values = list(prepared.inputs.values()) if isinstance(prepared.inputs, dict) else list(prepared.inputs)
    return [value for value in tree_flatten(values)[0] if isinstance(value, torch.Tensor)]


def _all_params(prepared: PreparedStep) -> Iterator[torch.Tensor]:
    yield from prepared.model.parameters()
    for _, master in prepared.master_pairs:
        yield master


def _optimizer_state(prepared: PreparedStep) -> Iterator[torch.Tensor]:
    for state in prepared.optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                yield value
