"""Plan activation checkpoints: the cheapest set of recompute segments whose step fits a budget.

    trace -> candidates (modules at every depth, runs of chained siblings, with cost-model numbers)
    -> solver -> Plan -> replay it from the unplanned trace (memplan.replay)
    -> tighten and solve again if it does not fit; bisect for a cheaper plan that still fits
       (the closed loop, memplan.closed_loop, which the selective planner runs too)
    -> the estimator on the cheapest plan that fits by replay (re-traced under fake tensors); where it
       does not fit, search again with the replays' peaks raised by the difference.

The exact solvers search the nested candidates (`nested_candidates`); the baselines checkpoint the
outermost blocks (`candidate_blocks`), as a user would.

The prediction a plan reports is always the estimator's on the checkpointed model, never the
solver's cost model.
"""

from __future__ import annotations

import random
import time
from bisect import bisect_left
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import cache, partial

from memplan.closed_loop import (
    Candidate,
    ClosedLoop,
    EstimateCache,
    Outcome,
    Replays,
    refusing_failures,
    verified_search,
)
from memplan.devices import DeviceModel, device_model
from memplan.estimate import Estimate, eager_events, estimate, in_place_sums, opened_workspace
from memplan.plan import Plan, Segment
from memplan.replay import Timeline, estimate_replayed
from memplan.solvers import SOLVERS, Block, ChainProblem, Solution, Span
from memplan.step import StepConfig
from memplan.timing import TimeModel, op_seconds, recompute_seconds, time_model_for
from memplan.trace import ModuleCall, Op, Trace, drawn
from memplan.workload import Workload

CONTAINERS = ("ModuleList", "Sequential")
CLOSED_LOOP_ROUNDS = 8
BISECTION_ROUNDS = 12
VERIFICATIONS = 4  # searches, each checked by the estimator (memplan.closed_loop.verified_search)
BASELINES = ("every-block", "sqrt-n", "uniform-k")
EXACT_METHODS = ("optimal-dp", "milp")  # these search modules at every depth; the baselines, the outermost blocks


@dataclass(frozen=True)
class Excluded:
    path: str
    reason: str


@dataclass(frozen=True)
class Candidates:
    blocks: tuple[Block, ...]
    excluded: tuple[Excluded, ...]


def candidate_blocks(
    trace: Trace,
    block_bytes: Callable[[int], int] = lambda n: n,
    seconds_of: Callable[[Op], float] = lambda op: 0.0,
    writers: dict[int, list[int]] | None = None,
    refused: Mapping[str, str] | None = None,
) -> Candidates:
    """The chain of blocks to choose from, in forward order: the outermost children of nn.Sequential /
    nn.ModuleList containers (blocks called in a loop), and the model's direct children that hold none.
    Cost-model numbers come from the first forward of the trace; `seconds_of(op)` times
    one op's recomputation (memplan.timing: the target's time model), summed over the block. `writers`:
    in_place_writers(trace), where the caller has it already; `refused`: see unsafe_reason."""
    first_forward = [c for c in trace.calls if c.phase == "forward" and c.step == 0]
    calls_per_path = forward_calls_per_path(trace)
    seen: set[str] = set()
    first_calls = []
    for call in sorted(first_forward, key=lambda c: c.opened):  # enclosing calls first
        if call.path not in seen:
            seen.add(call.path)
            first_calls.append(call)

    def parent(path: str) -> str:
        return path.rpartition(".")[0]

    in_containers = [c for c in first_calls if c.path and trace.module_types.get(parent(c.path)) in CONTAINERS]
    # the model's own children complete the chain where they hold no container block (a CNN's stem)
    top_level = [
        c for c in first_calls
        if c.path and "." not in c.path and c not in in_containers
        and not any(b.path.startswith(c.path + ".") for b in in_containers)
    ]
    chosen = sorted(in_containers + top_level, key=lambda c: c.opened)
    outermost = []
    for call in chosen:  # in the order they open: an enclosing block comes before what it contains
        if not any(call.path.startswith(kept.path + ".") for kept in outermost):
            outermost.append(call)

    forward_end = max((c.end_op for c in first_forward), default=0)
    writers = in_place_writers(trace) if writers is None else writers
    blocks, excluded = [], []
    previous: ModuleCall | None = None  # the call of the last block kept
    for call in outermost:
        before, previous = previous, None  # an excluded block breaks any run
        ops = trace.ops[call.first_op : call.end_op]
        if calls_per_path[call.path] > forward_passes(trace):
            excluded.append(Excluded(call.path, "called more than once per forward"))
            continue
        reason = unsafe_reason(trace, writers, call, forward_end, refused=refused)
        if reason:
            excluded.append(Excluded(call.path, reason))
            continue
        saved = sum(_activation_bytes(trace, op.allocates, block_bytes) for op in ops)
        group = ""
        if trace.module_types.get(parent(call.path)) in CONTAINERS:
            # a run may join this block to the one before only if the parent feeds one's output
            # straight into the next (`x = block(x)`); otherwise it starts a run of its own
            chained = before is not None and parent(before.path) == parent(call.path) and _chained(before, call)
            group = blocks[-1].group if chained else f"{parent(call.path)}@{call.path}"
        spared = trace.ops[trace.early_stop(call.first_op, call.end_op, call.closed) + 1 : call.end_op]
        blocks.append(Block(call.path, _input_bytes(trace, call, block_bytes), saved, sum(op.flops for op in ops),
                            sum(seconds_of(op) for op in ops), group, sum(op.flops for op in spared),
                            sum(seconds_of(op) for op in spared)))
        previous = call
    return Candidates(tuple(blocks), tuple(excluded))


@dataclass(frozen=True)
class NestedCandidates:
    """Candidates at every depth, as a chain of the finest units with the segments allowed over them."""

    leaves: tuple[Block, ...]  # leaf modules, and the ops a module runs outside its children, in forward order
    spans: tuple[Span, ...]  # every safe module, and every run of chained siblings in a container


def nested_candidates(
    trace: Trace,
    block_bytes: Callable[[int], int] = lambda n: n,
    seconds_of: Callable[[Op], float] = lambda op: 0.0,
    writers: dict[int, list[int]] | None = None,
    refused: Mapping[str, str] | None = None,
) -> NestedCandidates:
    """Submodules at any depth: a module, or a run of consecutive siblings that their parent chains as
    `x = block(x)` (see joins_run), may be one segment, on the same safety rules as `candidate_blocks`.
    The first forward's module calls nest by their op ranges; the leaves of that tree, plus each module's
    own ops outside its children, become the chain the solver sees. A module called more than once per
    forward (a siamese network's shared encoder, ALBERT's shared layer) has a span at each call, safe
    only where every call is; a plan checkpoints it at every call (see plan_segments). `writers`:
    in_place_writers(trace), where the caller has it already; `refused`: see unsafe_reason."""
    root = min(
        (c for c in trace.calls if c.path == "" and c.phase == "forward" and c.step == 0),
        key=lambda c: c.first_op,
        default=None,
    )
    if root is None:
        return NestedCandidates((), ())
    passes = forward_passes(trace)
    calls_per_path = forward_calls_per_path(trace)
    inside = sorted(
        (c for c in trace.calls if c.phase == "forward" and c.step == 0 and c.path
         and root.opened < c.opened and c.closed < root.closed),
        key=lambda c: c.opened,
    )
    writers = in_place_writers(trace) if writers is None else writers
    unsafe: dict[str, str] = {}
    for c in inside:
        unsafe[c.path] = unsafe.get(c.path) or unsafe_reason(trace, writers, c, root.end_op, refused=refused)

    def once(call: ModuleCall) -> bool:  # a run's members are called once (emit's runs pass outputs on by call)
        return calls_per_path[call.path] <= passes

    def activation_bytes(storages) -> int:
        return _activation_bytes(trace, storages, block_bytes)

    allocated_before = [0]  # activation bytes allocated by the ops before each op
    for op in trace.ops:
        allocated_before.append(allocated_before[-1] + activation_bytes(op.allocates))

    def saved_and_cost(ops: list[Op]) -> tuple[int, int, float]:
        saved = sum(activation_bytes(op.allocates) for op in ops)
        return saved, sum(op.flops for op in ops), sum(seconds_of(op) for op in ops)

    leaves: list[Block] = []
    spans: dict[tuple[int, int], Span] = {}
    labels: Counter[str] = Counter()  # a leaf of a module called again is labelled by its call: "path #2"

    def label(name: str) -> str:
        labels[name] += 1
        return name if labels[name] == 1 else f"{name} #{labels[name]}"

    def add_span(first: int, last: int, head: ModuleCall, tail: ModuleCall, paths: tuple[str, ...]) -> None:
        """The segment of modules `paths`, called from `head` to `tail` (leaves first..last). It frees what its ops allocate for backward
        but its outputs, which whatever comes after still holds; it keeps its input, which costs extra only
        where nothing held it for backward already."""
        if first > last:
            return
        allocated = allocated_before[tail.end_op] - allocated_before[head.first_op]
        made_by = {sid: trace.storages[sid].allocated_by for sid in tail.outputs}
        outputs = {sid for sid, op in made_by.items() if op is not None and head.first_op <= op < tail.end_op}
        kept = {sid for sid in head.inputs if trace.storages[sid].role not in ("weights", "inputs", "activations")}
        spared = trace.ops[trace.early_stop(head.first_op, tail.end_op, tail.closed) + 1 : tail.end_op]
        span = Span(first, last, sum(block_bytes(trace.storages[sid].nbytes) for sid in kept), paths,
                    allocated - activation_bytes(outputs), max(1, calls_per_path[head.path] // passes),
                    sum(op.flops for op in spared), sum(seconds_of(op) for op in spared))
        # segments covering the same units (a wrapper and its only child, a module and the run of all its
        # children): keep the one that frees more; on a tie, one module over a run, the outer over the inner
        if (first, last) not in spans or _preference(spans[(first, last)]) < _preference(span):
            spans[(first, last)] = span

    def visit(call: ModuleCall, calls: list[ModuleCall]) -> tuple[int, int]:
        """Add the leaves of `call` (whose nested calls are `calls`, in order) and its spans; its leaf range."""
        first = len(leaves)
        children, ranges = [], []
        index = 0
        while index < len(calls):
            child = calls[index]
            end = index + 1
            while end < len(calls) and calls[end].closed < child.closed:
                end += 1
            children.append(child)
            ranges.append(visit(child, calls[index + 1 : end]))
            index = end
        covered = {i for child in children for i in range(child.first_op, child.end_op)}
        own = [op for op in trace.ops[call.first_op : call.end_op] if op.index not in covered]
        saved, flops, seconds = saved_and_cost(own)
        if call.path and (not children or saved or flops):
            leaves.append(Block(label(f"{call.path} (own ops)" if children else call.path), 0, saved, flops, seconds))
        last = len(leaves) - 1
        if call.path and not unsafe[call.path]:
            add_span(first, last, call, call, (call.path,))
        for start, end in chained_runs(children, once):
            if not unsafe_reason(trace, writers, children[start], root.end_op, children[end], refused):
                paths = tuple(c.path for c in children[start : end + 1])
                add_span(ranges[start][0], ranges[end][1], children[start], children[end], paths)
        return first, last

    visit(root, inside)
    return NestedCandidates(tuple(leaves), tuple(sorted(spans.values(), key=lambda s: (s.first, s.last))))


def _preference(span: Span) -> tuple[int, int, int]:
    return span.saved_bytes - span.input_bytes, -len(span.paths), -len(span.paths[0])


def joins_run(previous: ModuleCall, member: ModuleCall, head: ModuleCall) -> bool:
    """Whether `member` may extend a run that ends with `previous` (emit.py's runs): a sibling that the parent
    calls right after `previous` (no op between) on its output and with the run's other tensor arguments,
    whatever order the parent registered them in (BART's and OPT's layers register `activation_fn` before
    `fc1` and call it between `fc1` and `fc2`)."""
    return (
        member.path.rpartition(".")[0] == head.path.rpartition(".")[0]
        and member.first_op == previous.end_op
        and _chained(previous, member)
        and member.inputs[1:] == head.inputs[1:]
    )


def chained_runs(children: Sequence[ModuleCall | None],
                 usable: Callable[[ModuleCall], bool] = lambda call: True) -> Iterator[tuple[int, int]]:
    """(start, end) of every run of two or more consecutive `children` (in call order), each fed the previous
    one (joins_run). A None child (ops the parent runs between its children) or an unusable one ends a run."""
    for start, head in enumerate(children):
        if head is None or not usable(head):
            continue
        for end in range(start + 1, len(children)):
            member = children[end]
            if member is None or not usable(member) or not joins_run(children[end - 1], member, head):
                break
            yield start, end


def _chained(previous: ModuleCall, call: ModuleCall) -> bool:
    """The parent feeds one call's whole output straight into the next (`x = block(x)`), not a part of
    it (`x = block(x)[0]`), and passes both the same other arguments (`x = block(x, mask)`): a
    checkpointed run hands each member the previous one's output as it is, and the first one's others."""
    return (bool(previous.outputs) and call.inputs[: len(previous.outputs)] == previous.outputs
            and call.first_argument == previous.output_object != 0 and call.arguments == previous.arguments)


# ops that torch.utils.checkpoint recomputes wrongly -> why the segment is left out
UNSAFE_TO_RECOMPUTE = {
    # nn.RReLU in training fills its noise tensor in place (Tensor(b!) noise): checkpointed, its input's
    # gradient comes out as garbage (NaN, 1e38), in plain PyTorch as much as in a plan
    "aten.rrelu_with_noise.default": "it runs nn.RReLU in training, whose noise torch.utils.checkpoint does "
                                     "not recompute faithfully (wrong gradients)",
}


def unsafe_reason(
    trace: Trace, writers: dict[int, list[int]], call: ModuleCall, forward_end: int, last: ModuleCall | None = None,
    refused: Mapping[str, str] | None = None,
) -> str:
    """Why recomputing this call (or the run from it to `last`) is unsafe ("" when it is safe); `writers`
    is in_place_writers(trace); `refused`: modules whose recomputation failed the estimator (path -> its
    error; see memplan.closed_loop.Unrecomputable)."""
    if ".parametrizations." in f".{call.path}.":
        return "a parametrization (torch.nn.utils.parametrize) runs when its weight is read, not as a block"
    if _mutated_after(trace, writers, call, forward_end, last):
        return "its input or output is modified in place later in forward"
    ops = trace.ops[call.first_op : (last or call).end_op]
    if any(trace.parameters.intersection(op.writes) for op in ops):
        return "its forward writes a parameter in place: recomputed, it would write it again"
    if _reads_a_buffer_it_updates(trace, ops):
        return ("its forward updates a buffer in place that another of its ops reads (an EMA codebook): "
                "recomputed, it would read the updated buffer and update it again")
    unsafe = next((op.name for op in ops if op.name in UNSAFE_TO_RECOMPUTE), None)
    if unsafe is not None:
        return UNSAFE_TO_RECOMPUTE[unsafe]
    members = _members(trace, call, last)
    failed = _within(refused or {}, members)
    if failed is not None:
        return f"recomputing {failed} failed the estimate ({refused[failed]})"
    rerun = _within(trace.rerun_in_backward, members)
    if rerun is not None:
        return (f"{rerun or 'the model'} runs again in backward: the model checkpoints it itself (turn that off to let "
                "memplan plan it; transformers, diffusers: model.gradient_checkpointing_disable())")
    stored = next((c.stores_into for c in members if c.stores_into), "")
    if stored:
        # transformers' models hand their layers a cache in training too, unless built with use_cache=False
        hint = " (a transformers model: build it with use_cache=False)" if stored.endswith("Cache") else ""
        return f"its forward stores tensors it makes into its {stored} argument: recomputed, it would store them again{hint}"
    drawing = _within(trace.host_random_modules, members)
    if drawing is not None:
        return (f"{drawing or 'the model'} draws from {trace.host_random_modules[drawing]}'s generator at every call: "
                "checkpointing restores only torch's generators, so its recomputation would draw other numbers")
    stateful = _within(trace.stateful_modules, members)
    if stateful is not None:
        return (f"{stateful or 'the model'} changes its attribute {trace.stateful_modules[stateful]!r} at every "
                "call: recomputed, it would read what its forward left there")
    approximate_ops = {name for name in trace.approximate_ops if not drawn(name)}
    if approximate_ops and any(op.name in approximate_ops for op in ops):
        return "has outputs with data-dependent shapes"
    return ""


def _reads_a_buffer_it_updates(trace: Trace, ops: Sequence[Op]) -> bool:
    """Whether one op of `ops` writes a buffer of the model in place (a storage made before the step that
    is no parameter) that another of them reads: vector-quantize-pytorch's codebooks look codes up in
    `embed` and then move it toward the batch's means (`embed.data.lerp_(...)`), so a recomputation
    would quantize with the moved codebook (other gradients) and move it twice. A buffer only its own
    op reads and writes (BatchNorm's running statistics, which the training forward never uses for
    its output, a step counter's `add_`) does not count."""
    written = {sid for op in ops for sid in op.writes if sid not in trace.parameters
               and sid in trace.storages and trace.storages[sid].role == "weights"}
    return bool(written) and any(sid in written for op in ops if not op.writes for sid in op.reads)


def _within(paths: Iterable[str], members: Sequence[ModuleCall]) -> str | None:
    """The first of `paths` that is one of the segment's members or inside one (None where none is)."""
    return next((path for path in paths for m in members if path == m.path or path.startswith(m.path + ".")), None)


def _members(trace: Trace, head: ModuleCall, last: ModuleCall | None) -> list[ModuleCall]:
    """The calls of the segment from `head` to `last` (siblings, `head` alone by default)."""
    if last is None or last is head:
        return [head]
    parent = head.path.rpartition(".")[0]
    return [c for c in trace.calls if c.phase == head.phase and c.step == head.step and head.opened <= c.opened
            and c.closed <= last.closed and c.path.rpartition(".")[0] == parent]


def _input_bytes(trace: Trace, call: ModuleCall, block_bytes: Callable[[int], int]) -> int:
    return sum(block_bytes(trace.storages[sid].nbytes) for sid in call.inputs if trace.storages[sid].role != "weights")


def _activation_bytes(trace: Trace, storages, block_bytes: Callable[[int], int]) -> int:
    """Bytes of the storages among `storages` that are kept for backward, as the device allocates them."""
    return sum(block_bytes(trace.storages[sid].nbytes) for sid in storages if trace.storages[sid].role == "activations")


def forward_calls_per_path(trace: Trace) -> dict[str, int]:
    """How often each module runs in step 0's forward passes."""
    counts: dict[str, int] = {}
    for call in trace.calls:
        if call.phase == "forward" and call.step == 0:
            counts[call.path] = counts.get(call.path, 0) + 1
    return counts


def _mutated_after(
    trace: Trace, writers: dict[int, list[int]], first: ModuleCall, forward_end: int, last: ModuleCall | None = None
) -> bool:
    """A checkpoint keeps its input to recompute from, and autograd checks its output's version: an in-place
    write to the input of `first`, inside the segment or after it, or to the output of `last` (the segment's
    last module, `first` itself by default) after the segment, breaks the recomputation."""
    last = last or first

    def written(storages: set[int], start: int) -> bool:
        for sid in storages:
            ops = writers.get(sid, ())
            at = bisect_left(ops, start)
            if at < len(ops) and ops[at] < forward_end:
                return True
        return False

    def watched(storages: tuple[int, ...]) -> set[int]:
        return {sid for sid in storages if trace.storages[sid].role != "weights"}

    inputs = watched(first.inputs)
    return written(inputs, first.first_op) or written(watched(last.outputs) - inputs, last.end_op)


def in_place_writers(trace: Trace) -> dict[int, list[int]]:
    """For each storage, the indices of the ops that write it in place, ascending."""
    writers: dict[int, list[int]] = {}
    for op in trace.ops:
        for sid in op.writes:
            writers.setdefault(sid, []).append(op.index)
    return writers


def forward_passes(trace: Trace) -> int:
    """How many forward passes step 0 ran (one per micro-batch)."""
    return max(1, sum(1 for e in trace.events if e.kind == "phase" and e.phase == "forward" and e.step == 0))


@dataclass(frozen=True)
class Floor:
    """A peak that no checkpoint plan goes below (the planner's and the selective ones alike).
    Checkpointing changes neither the backward ops nor the order they run in, only when the activations
    they read are made, so at each backward or optimizer op these are live whatever the plan:
    - its operands, and what lives through the whole step (weights, inputs, optimizer state, the
      parameter gradients made so far, and the library workspaces opened so far);
    - every tensor made in backward or by the optimizer, from its op to the last op that reads it (the
      gradients in flight; a gradient that autograd sums in place ends where the sum begins);
    - every tensor made in forward, up to the last op that reads it, from the latest op at which any
      segment that could drop it has brought it back. A segment (a submodule call, or a run of sibling
      calls) drops what an op inside it saved for backward and made inside it, and recomputes all it
      dropped at once, when backward first unpacks one of those: at the latest, the first read of a
      tensor that only ops inside one of its members saved (a child's dropout mask brings back its
      parent's attention). A tensor that no segment around its op can drop (saved only outside those
      calls and their siblings, or made outside all submodules) is live from when it is made."""

    peak_bytes: int
    op: str  # the backward or optimizer op that sets it
    phase: str = ""  # its phase: backward or optimizer


PERSISTENT_ROLES = ("weights", "inputs", "optimizer_state", "gradients")


def peak_floor(trace: Trace, device: DeviceModel | None = None) -> Floor:
    """The Floor of the step traced, in the block sizes and with the library workspaces of `device` (None:
    bytes as requested, no workspace)."""
    block_bytes = device.block_bytes if device is not None else (lambda n: n)
    n = len(trace.ops)
    freed_after = {e.storage: e.op for e in trace.events if e.kind == "free"}
    change = [0] * (n + 2)  # bytes that become (+) or stop being (-) certainly live before each op
    persistent = set()
    for sid, storage in trace.storages.items():
        if storage.role in PERSISTENT_ROLES:
            persistent.add(sid)
            change[0 if storage.allocated_by is None else storage.allocated_by + 1] += block_bytes(storage.nbytes)
            if sid in freed_after:
                change[freed_after[sid] + 1] -= block_bytes(storage.nbytes)

    first_read: dict[int, int] = {}  # after forward: the first and last op reading each storage
    last_read: dict[int, int] = {}
    for op in trace.ops:
        if op.phase != "forward":
            for sid in (*op.reads, *op.writes):
                first_read.setdefault(sid, op.index)
                last_read[sid] = op.index
    # what backward or the optimizer makes lives until freed, which no plan changes (the same ops free
    # it in the same order), even past its last read (a temporary a Python name holds)
    for sid, storage in trace.storages.items():
        made_by = storage.allocated_by
        if sid not in persistent and made_by is not None and trace.ops[made_by].phase != "forward":
            last_read[sid] = max(last_read.get(sid, made_by), freed_after.get(sid, made_by))
    # sums that eager PyTorch does in place (estimate.in_place_sums): the summand is the sum's own
    # memory, so it stops counting at the sum
    summed_into = in_place_sums(trace)
    for sid, index in summed_into.items():
        last_read[sid] = index - 1

    unit = [-1] * n  # the innermost submodule call running each forward op (-1: outside all of them)
    calls = sorted((c for c in trace.calls if c.phase == "forward" and c.path), key=lambda c: c.opened)
    parent = [-1] * len(calls)  # the innermost call around each call
    innermost_at: dict[int, int] = {}  # module hook clock -> the innermost call open then
    open_calls: list[int] = []
    for number, call in enumerate(calls):
        unit[call.first_op : call.end_op] = [number] * (call.end_op - call.first_op)
        while open_calls and calls[open_calls[-1]].closed < call.opened:
            open_calls.pop()
        parent[number] = open_calls[-1] if open_calls else -1
        open_calls.append(number)
        innermost_at.update(dict.fromkeys(range(call.opened + 1, call.closed + 1), number))

    def around(u: int) -> Iterator[int]:
        while u != -1:
            yield u
            u = parent[u]

    # When a segment around a call recomputes, at the latest: the first read, after forward, of a
    # tensor that only ops inside the call saved (what a segment drops), which unpacks it
    unit_start: dict[int, int] = {}
    for sid, first in first_read.items():
        times = trace.saved_at.get(sid)
        if sid in persistent or not times:
            continue
        savers = [set(around(innermost_at.get(t, -1))) for t in times]
        for u in set.intersection(*savers):  # the calls around every op that saved it
            unit_start[u] = min(unit_start.get(u, first), first)

    never = n + 1

    def recomputed_from(sid: int, u: int) -> int | None:
        """The op from which `sid`, made inside call u, is certainly live under every segment that is u or
        a run of u's siblings with u and that drops it; None where no such segment drops it. A segment
        drops a tensor made inside it that an op inside it saved, and recomputes it when it first unpacks
        what it dropped: by the first such read of what only ops inside any one member saved. (A segment
        that drops a tensor an op outside it also saved recomputes a copy: live from then on too.)"""
        latest = None
        for t in trace.saved_at.get(sid, ()):
            saver_calls = list(around(innermost_at.get(t, -1)))
            if u in saver_calls:
                by = unit_start.get(u, never)
            else:
                sibling = next((d for d in saver_calls if parent[d] == parent[u]), None)
                if sibling is None:
                    continue
                by = min(unit_start.get(u, never), unit_start.get(sibling, never))
            latest = by if latest is None else max(latest, by)
        return latest

    # A forward tensor is live from the op after the one that made it, unless a segment drops it: then
    # from when that segment recomputes it, at the latest. Certainly live from the latest of those over
    # the segments around its op that could drop it.
    certain: dict[int, tuple[int, int]] = {}  # storage -> the ops [start, end] it is certainly live across
    for sid, end in last_read.items():
        made_by = trace.storages[sid].allocated_by
        if sid in persistent or made_by is None:
            continue
        if trace.ops[made_by].phase != "forward":
            start = made_by
        else:
            start = made_by + 1
            for u in around(unit[made_by]):
                recomputed = recomputed_from(sid, u)
                if recomputed is not None:
                    start = max(start, recomputed)
        if start <= end:
            certain[sid] = (start, end)
            change[start] += block_bytes(trace.storages[sid].nbytes)
            change[end + 1] -= block_bytes(trace.storages[sid].nbytes)

    # a library workspace (cuBLAS's, one per thread) opens at its thread's first matrix product: the same
    # op in every plan (a recomputation in backward may open the backward thread's sooner, never later)
    if device is not None and device.workspace_bytes:
        threads: set[str] = set()
        phase = ""
        for event in eager_events(trace):
            if event.kind == "phase":
                phase = event.phase
            elif event.kind == "alloc":
                thread = opened_workspace(device, threads, phase, trace.ops[event.op].name)
                if thread is not None:
                    threads.add(thread)
                    change[event.op] += device.workspace_bytes

    best = Floor(0, "")
    live = 0
    for op in trace.ops:
        live += change[op.index]
        if op.phase == "forward":
            continue
        operands = set(op.reads) | set(op.writes) | set(op.allocates)
        # operands not already counted among the storages certainly live before and through this op
        extra = sum(
            block_bytes(trace.storages[sid].nbytes)
            for sid in operands
            if not (sid in persistent and sid not in op.allocates)
            and not (sid in certain and certain[sid][0] <= op.index <= certain[sid][1])
            and summed_into.get(sid) != op.index
        )
        total = live + extra + op.scratch_bytes
        if total > best.peak_bytes:
            best = Floor(total, op.name, op.phase)
    return best


@dataclass(frozen=True)
class PlanResult:
    plan: Plan
    unplanned: Estimate
    planned: Estimate
    candidates: Candidates
    solution: Solution
    floor: Floor  # a peak no checkpoint plan goes below
    checked: bool = True  # False: the plan as replayed, which the caller's `worth_checking` rejected


def plan_checkpoints(
    workload: Workload,
    config: StepConfig,
    budget_bytes: int,
    device: str = "cuda",
    method: str = "optimal-dp",
    gpu: str | None = None,
    processor: str | TimeModel | None = None,
    time_limit_s: float | None = None,
    cache: EstimateCache | None = None,
    worth_checking: Callable[[Plan], bool] = lambda plan: True,
) -> PlanResult:
    """The cheapest plan (by the solver `method`) whose re-estimated peak fits `budget_bytes`.
    The result's plan has feasible=False, with the smallest peak reached, when none fits. `gpu`: the
    card whose library workspaces the estimator counts; recomputation is priced on `processor` (a name
    or a memplan.timing.TimeModel), else on `gpu`, else on what `device` runs on. Plans are
    searched by replay and checked by the estimator (memplan.closed_loop.verified_search); every
    baseline that fits by replay is a candidate too. `time_limit_s`: once past it, the search stops
    bisecting and searches no further (the plan found is still checked); None: no limit. `cache`: the
    estimator runs, shared with the caller (memplan.selective plans beside this planner).
    `worth_checking(plan)`, on the plan the replays found cheapest: False (the caller already has a plan
    that costs no more) ends the search there, and the result is that plan as replayed, unchecked.
    Modules whose recomputation fails the estimator are left out (memplan.closed_loop.refusing_failures)."""
    cache = cache or EstimateCache()
    return refusing_failures(
        lambda refused, left: _plan_checkpoints(workload, config, budget_bytes, device, method, gpu, processor, left,
                                                cache, worth_checking, refused),
        time_limit_s)


def _plan_checkpoints(
    workload: Workload, config: StepConfig, budget_bytes: int, device: str, method: str, gpu: str | None,
    processor: str | TimeModel | None, time_limit_s: float | None, cache: EstimateCache,
    worth_checking: Callable[[Plan], bool], refused: dict[str, str],
) -> PlanResult:
    started = time.perf_counter()

    def in_time() -> bool:
        return time_limit_s is None or time.perf_counter() - started < time_limit_s

    unplanned, trace = cache.estimate(workload, config, device, gpu)
    clock = time_model_for(device, gpu if processor is None else processor, config.precision)

    def re_estimate(draft: Plan) -> tuple[Plan, Estimate]:
        """The estimator's peak and FLOPs, and the time model's seconds on its trace (as plan_selective's)."""
        planned, planned_trace = cache.realise_checked(workload, config, device, draft, gpu)
        seconds = max(0.0, recompute_seconds(trace, planned_trace, draft, clock))
        return _re_estimated(replace(draft, recompute_seconds=seconds), unplanned, planned)

    allocator = device_model(device, gpu)
    block_bytes = allocator.block_bytes
    seconds_of = partial(op_seconds, trace=trace, model=clock)
    writers = in_place_writers(trace)
    candidates = candidate_blocks(trace, block_bytes, seconds_of, writers, refused)

    def chain(budget: int) -> ChainProblem:
        """The outermost blocks, as the baselines checkpoint them."""
        fixed = max(0, unplanned.peak_bytes - sum(b.saved_bytes for b in candidates.blocks))
        return ChainProblem(candidates.blocks, fixed, max(0, budget))

    problem_at = chain
    if method in EXACT_METHODS:
        nested = nested_candidates(trace, block_bytes, seconds_of, writers, refused)
        nested_fixed = max(0, unplanned.peak_bytes - sum(b.saved_bytes for b in nested.leaves))

        def problem_at(budget: int) -> ChainProblem:
            """Modules at every depth and runs of chained siblings."""
            return ChainProblem(nested.leaves, nested_fixed, max(0, budget), nested.spans)

        # an outermost block that a run may still cover (bn1 inside conv1..maxpool) is not excluded
        in_runs = {path for span in nested.spans for path in span.paths}
        candidates = replace(candidates, excluded=tuple(e for e in candidates.excluded if e.path not in in_runs))

    def candidate(solution: Solution) -> Candidate[Solution]:
        return Candidate(_draft(workload, config, device, solution, budget_bytes, unplanned), solution.feasible, solution)

    timeline = Timeline(trace)

    def replay(draft: Plan) -> tuple[Plan, Estimate]:
        planned, _ = estimate_replayed(workload, config, device, trace, draft, timeline, gpu)
        return replace(draft, predicted_peak_bytes=planned.peak_bytes,
                       recompute_flops=planned.step_flops - unplanned.step_flops), planned

    replays = Replays(replay, budget_bytes)

    def search(correction: int) -> list[Outcome[Solution]]:
        """The closed loop over plans replayed `correction` bytes higher. The setting is the solver's
        budget, one number: lowered by what the replay found over the budget."""
        loop = ClosedLoop(
            solve=lambda setting: candidate(solve_at(setting[0])),
            realise=replays.realise(correction),
            tighten=lambda setting, over, scale: (setting[0] - scale * (over.planned.peak_bytes + correction - budget_bytes),),
        )
        tightened = loop.until_fits((budget_bytes - correction,), CLOSED_LOOP_ROUNDS)
        if tightened.fits and tightened.outcomes[-1].plan.segments:
            # The cost model is only a model: a looser solver budget may still give a plan that really
            # fits, and costs less. Bisect between the solver budget whose plan fits and the last one
            # whose plan did not (or the unplanned peak, where no checkpoint is needed).
            loose = (unplanned.peak_bytes,) if tightened.loose is None else tightened.loose
            loop.bisect(loose, tightened.setting, BISECTION_ROUNDS, in_time)
        if method in EXACT_METHODS and candidates.blocks:
            # The cost model can be pessimistic where a baseline's plan fits: every baseline is a candidate.
            for baseline in BASELINES:
                loop.outcome(candidate(SOLVERS[baseline](chain(budget_bytes))))
        searched.update(loop.realised)
        return list(loop.realised.values())

    solved: dict[int, Solution] = {}  # by solver budget: the searches after the first meet many again

    deadline = None if time_limit_s is None else started + time_limit_s

    def solve_at(budget: int) -> Solution:
        if budget not in solved:
            solved[budget] = SOLVERS[method](problem_at(budget), deadline=deadline)
        return solved[budget]

    searched: dict[tuple[Segment, ...], Outcome[Solution]] = {}
    rejected: Outcome[Solution] | None = None  # the caller's rejection ends the search: at most one

    def worth_verifying(outcome: Outcome[Solution]) -> bool:
        nonlocal rejected
        if worth_checking(outcome.plan):
            return True
        rejected = outcome
        return False

    checked = verified_search(search, re_estimate, lambda o: float(o.plan.recompute_flops), VERIFICATIONS,
                              in_time, worth_verifying=worth_verifying)
    fitting = [o for o in checked if o.plan.feasible]
    if rejected is not None and not fitting:
        return PlanResult(rejected.plan, unplanned, rejected.planned, candidates, rejected.solution,
                          peak_floor(trace, allocator), checked=False)
    if fitting:
        best = min(fitting, key=lambda o: o.plan.recompute_flops)
    else:  # the lowest peak any plan reached (the first of equals), as the estimator sees it
        lowest = min(searched.values(), key=lambda o: o.planned.peak_bytes)
        best = min([*checked, Outcome(*re_estimate(lowest.plan), lowest.solution)],
                   key=lambda o: o.planned.peak_bytes)
        if method in EXACT_METHODS and best.plan.segments and best.planned.peak_bytes >= unplanned.peak_bytes:
            # no plan reached below the step without checkpoints: that is the lowest, and recomputes nothing
            none = candidate(SOLVERS["none"](chain(budget_bytes)))
            best = Outcome(*re_estimate(none.draft), none.solution)
    if best.plan.method != method and best.plan.method in BASELINES:
        best = replace(best, plan=replace(best.plan, method=f"{method} (via {best.plan.method})"))
    return PlanResult(best.plan, unplanned, best.planned, candidates, best.solution, peak_floor(trace, allocator))


def plan_segments(chosen: Sequence[tuple[str, ...]]) -> tuple[tuple[str, ...], ...]:
    """The solver's spans as a plan checkpoints them, by module: a module called more than once per forward
    is checkpointed at every call, so a span at one of its calls takes in the others (one segment for
    all), and one inside a module checkpointed already goes (recomputed with it)."""
    unique = list(dict.fromkeys(tuple(paths) for paths in chosen))
    outer = {path for paths in unique for path in paths}
    return tuple(paths for paths in unique
                 if not any(path.startswith(other + ".") for path in paths for other in outer))


def _draft(
    workload: Workload, config: StepConfig, device: str, solution: Solution, budget_bytes: int, unplanned: Estimate
) -> Plan:
    """The solver's segments as a Plan, before re-estimation (not feasible, no predicted peak yet)."""
    return Plan(
        model=workload.spec,
        batch_size=workload.effective_batch_size,
        precision=config.precision,
        optimizer=config.optimizer,
        grad_accum=config.grad_accum,
        device=device,
        method=solution.method,
        segments=tuple(Segment(paths) for paths in plan_segments(solution.segments)),
        feasible=False,
        budget_bytes=budget_bytes,
        predicted_peak_bytes=0,
        unplanned_peak_bytes=unplanned.peak_bytes,
        recompute_flops=0,
        step_flops=unplanned.step_flops,
        recompute_seconds=solution.recompute_seconds,
        options=dict(workload.options),
    )


def random_plan(workload: Workload, config: StepConfig, device: str, trace: Trace, unplanned: Estimate,
                rng: random.Random, share: float = 0.6) -> Plan:
    """Disjoint segments drawn from nested_candidates (modules at any depth, runs of siblings), each span
    taken with probability `share`, in a random order: a plan the block-level planner could choose, not
    estimated yet (to test what must hold for every plan, such as peak_floor, against)."""
    spans = list(nested_candidates(trace).spans)
    rng.shuffle(spans)
    chosen, covered = [], set()
    for span in spans:
        units = set(range(span.first, span.last + 1))
        if not units & covered and rng.random() < share:
            chosen.append(span.paths)
            covered |= units
    return _draft(workload, config, device, Solution("random", tuple(chosen), True, 0, 0, 0.0, 0.0), 0, unplanned)


def _re_estimated(draft: Plan, unplanned: Estimate, planned: Estimate) -> tuple[Plan, Estimate]:
    """The draft with the peak and FLOPs the estimator gives the checkpointed model (`planned`), and that estimate."""
    plan = replace(
        draft,
        feasible=planned.peak_bytes <= draft.budget_bytes,
        predicted_peak_bytes=planned.peak_bytes,
        recompute_flops=max(0, planned.step_flops - unplanned.step_flops),
    )
    return plan, planned


@dataclass(frozen=True)
class Alternative:
    """A change that makes the step fit without (more) checkpointing, re-estimated."""

    description: str
    batch_size: int | None
    grad_accum: int
    precision: str
    optimizer: str
    peak_bytes: int


# Lighter choices to try when nothing fits, in order of how little they change training.
LOWER_PRECISIONS = {"fp32": "amp-bf16", "tf32": "amp-bf16", "amp-fp16": "fp16-master", "amp-bf16": "bf16", "fp16-master": "fp16"}
LIGHTER_OPTIMIZERS = {"adam": "adamw-8bit", "adamw": "adamw-8bit", "adamw-8bit": "adafactor", "rmsprop": "sgd-momentum", "adagrad": "sgd-momentum", "sgd-momentum": "sgd"}

# What torch raises where a model cannot run a changed step; the estimator passes it on as it is (only
# the model factory's own errors become BadInput): ValueError from its argument checks (BatchNorm at
# micro-batch 1: "Expected more than 1 value per channel when training"), RuntimeError from its ops'
# shape checks (a model that hard-codes its batch size: "shape '[8, 16]' is invalid for input of size 64").
MODEL_CANNOT_RUN = (ValueError, RuntimeError)


def alternatives(
    workload: Workload, config: StepConfig, budget_bytes: int, device: str, gpu: str | None = None
) -> tuple[Alternative, ...]:
    """What would fit instead: a smaller micro-batch with gradient accumulation giving the same
    effective batch, a lower precision, a lighter optimizer — each re-estimated."""
    def estimate_of(changed_workload: Workload, changed_config: StepConfig) -> Estimate | None:
        """The re-estimate; None where the model cannot run that way (see MODEL_CANNOT_RUN)."""
        try:
            return estimate(changed_workload, changed_config, device, gpu=gpu)
        except MODEL_CANNOT_RUN:
            return None

    def peak_of(changed_workload: Workload, changed_config: StepConfig) -> int | None:
        changed = estimate_of(changed_workload, changed_config)
        return None if changed is None else changed.peak_bytes

    found = []
    batch = workload.effective_batch_size
    if batch and batch > 1:
        for divisor in (d for d in range(2, batch + 1) if batch % d == 0):
            smaller = replace(workload, batch_size=batch // divisor)
            accum = replace(config, grad_accum=config.grad_accum * divisor)
            changed = estimate_of(smaller, accum)
            if changed is None:
                continue
            if changed.peak_bytes <= budget_bytes:
                found.append(Alternative(
                    f"micro-batch {batch // divisor} x grad-accum {accum.grad_accum} (same effective batch)",
                    batch // divisor, accum.grad_accum, config.precision, config.optimizer, changed.peak_bytes))
                break
            if _held_by_any_micro_batch(changed) > budget_bytes:
                break  # (and the smaller micro-batches trace longer)
    for description, changed in (
        ("precision", replace(config, precision=LOWER_PRECISIONS[config.precision]) if config.precision in LOWER_PRECISIONS else None),
        ("optimizer", replace(config, optimizer=LIGHTER_OPTIMIZERS[config.optimizer]) if config.optimizer in LIGHTER_OPTIMIZERS else None),
    ):
        if changed is None:
            continue
        peak = peak_of(workload, changed)
        if peak is not None and peak <= budget_bytes:
            what = changed.precision if description == "precision" else changed.optimizer
            found.append(Alternative(f"{description} {what}", batch, changed.grad_accum, changed.precision, changed.optimizer, peak))
    return tuple(found)


def _held_by_any_micro_batch(estimated: Estimate) -> int:
    """The most weights, gradients and optimizer state live at once at a phase's peak: every
    micro-batch size holds as much at its optimizer step."""
    return max(b.weights + b.gradients + b.optimizer_state for b in estimated.simulation.phase_breakdowns.values())


@dataclass(frozen=True)
class MaxBatch:
    without_plan: int  # 0: not even the smallest batch the model runs fits
    with_plan: int
    plan_at_max: Plan | None  # the cheapest plan at `with_plan`


def max_batch(
    workload: Workload,
    config: StepConfig,
    budget_bytes: int,
    device: str,
    limit: int = 1 << 16,
    gpu: str | None = None,
) -> MaxBatch:
    """The largest batch size that fits, without and with an optimal checkpoint plan (binary search:
    memory grows with the batch). A batch whose peak floor is over the budget is not planned: no plan fits.
    The search starts at the smallest of 1, 2, 4, 8 that the model runs (a BatchNorm over a 1x1 map does
    not run batch 1: MODEL_CANNOT_RUN)."""
    allocator = device_model(device, gpu)
    plans: dict[int, Plan] = {}

    @cache
    def fits_plain(batch: int) -> bool:
        return estimate(replace(workload, batch_size=batch), config, device, gpu=gpu).peak_bytes <= budget_bytes

    def fits_planned(batch: int) -> bool:
        sized = replace(workload, batch_size=batch)
        cache = EstimateCache()  # this batch's trace, for its floor and its plan
        if peak_floor(cache.estimate(sized, config, device, gpu)[1], allocator).peak_bytes > budget_bytes:
            return False
        plans[batch] = plan_checkpoints(sized, config, budget_bytes, device, gpu=gpu, cache=cache).plan
        return plans[batch].feasible

    smallest = _smallest_runnable(fits_plain, [b for b in (1, 2, 4, 8) if b <= limit])
    plain = _largest(fits_plain, smallest, limit)
    planned = _largest(fits_planned, max(plain, smallest), limit)
    return MaxBatch(plain, max(plain, planned), plans.get(planned))


def _smallest_runnable(fits: Callable[[int], bool], batches: list[int]) -> int:
    """The first of `batches` at which `fits` runs; the first one's error where none does."""
    errors = []
    for batch in batches:
        try:
            fits(batch)
            return batch
        except MODEL_CANNOT_RUN as error:
            errors.append(error)
    raise errors[0]


def _largest(fits: Callable[[int], bool], low: int, limit: int) -> int:
    """The largest n in [low, limit] with fits(n), for a monotone `fits`; 0 when fits(low) fails."""
    if not fits(low):
        return 0
    high = low
    while high < limit and fits(min(high * 2, limit)):
        high = min(high * 2, limit)
    if high == limit:
        return limit
    bad = min(high * 2, limit)
    while bad - high > 1:
        middle = (high + bad) // 2
        high, bad = (middle, bad) if fits(middle) else (high, middle)
    return high
