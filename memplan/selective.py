"""Selective recompute: per checkpointed block, choose which op calls' outputs to keep.

    trace -> candidate blocks -> per block, the op calls of its forward (bytes, FLOPs, seconds on the target's
    time model, memplan.timing)
    -> a Pareto family of save policies per block (a knapsack over the calls) -> a chain DP (multiple-
    choice knapsack with the transient of recomputing one segment at a time) -> Plan with "selective"
    segments -> re-estimate the planned model under fake tensors (closed loop) -> correct the model and
    solve again; block-level plans (every block kept or fully recomputed) go through the same loop, and
    plans of other planners may be passed in, so the plan returned is never worse than those.

Semantics this models (torch.utils.checkpoint.create_selective_checkpoint_contexts with a policy
function, see memplan.emit._keep_policy): inside a selective segment, each saved op call keeps its
outputs from forward until the segment's backward, whether or not autograd needs them; the segment's
input is kept; every other op of the segment's forward runs again in backward, up to the last tensor the
forward saved for backward (non-reentrant checkpointing's early stop: a segment ending in a Linear does not
run its matmul again, see Trace.early_stop), and ops past that are never offered for keeping. A saved call is named
"aten.addmm.default#2": the third call of addmm in one forward of the block, counting only the ops the
runtime's policy sees (not SAC_IGNORED_OPS, such as detach); a plain "aten.addmm.default" keeps every
call of it. Recomputation costs the ops not saved (views and in-place ops included); on a processor
whose time model counts host time (the CPU), a segment that keeps anything also pays the policy's
per-op dispatch, in forward and in recomputation (memplan.timing).

The memory model, per block j and policy P (bytes rounded as the device allocates them):

    contrib_j    bytes held from block j's forward until its backward: for a kept block, the activations
                 it allocates and its outputs; for a checkpointed one, the outputs of P's calls and its
                 own outputs (its input is the previous block's output, counted there or in `fixed`)
    transient_j  activations the block's recomputation recreates (its activations not already held)
    grads_j      gradients the backward of the blocks after j has allocated when j is recomputed
    residue_j    what a checkpointed forward still holds when the forward ends beyond contrib_j (autocast's
                 weight casts), learnt from the re-estimated plans

    backward peak = max( fixed + Σ_j contrib_j ,  max_j ( recompute_fixed + Σ_{i<=j} contrib_i
                                                           + transient_j + grads_j ) )
    forward peak  = forward_fixed + max_j ( Σ_{i<j} (contrib_i + residue_i) + allocated_j )

`fixed` is the unplanned peak less the blocks' activations; `recompute_fixed` that less the temporaries
the peak holds (the loss's, gone by then); `forward_fixed` the same for the forward phase's peak. A run
of consecutive blocks of one container may also be one fully recomputed segment, so every block-level
plan is in this search space.

Sub-blocks: the chain's units are finer than the blocks. Under each block, its children (one level down)
and the ops it runs outside them (residual adds, kept: only their "keep" policy) partition its forward;
a child, or a run of children it chains (`attn(ln_1(x))`), is a segment with its own family of policies.
A unit holds of its outputs only what the unplanned step holds for backward (attn's output, read by a
residual add only, is freed in forward), so the units' kept bytes add up to the block's and `fixed` is
the same for any mix of whole blocks and sub-blocks. The whole-block options stay, so the search space
is a superset of the blocks'; the model misses more of what a small segment's backward holds (its
output's gradient), which the closed loop corrects.

The model is a model: the estimator's re-run on the planned model is the
reported truth, and where a plan does not fit, the closed loop adds the excess to the fixed bytes of
the phase that peaked.

Optimality: a family is the Pareto set (held bytes, transient bytes, cost) of a 0/1 knapsack over the
block's calls on a grid of 1/GRID of its bytes (at most MAX_POLICIES kept). Over the families, the chain
DP is exact at a resolution of 1 byte; by default it merges states within room/1024 bytes and reports
the gap to a proven lower bound (see solve_selective_chain), which widens with the units of the chain.

Cached tensors mutated in place are excluded at plan time: a call whose output storage an op's schema
says it writes later in the same forward (relu_, bernoulli_, the next block's +=) is never saved.
"""
from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from memplan.closed_loop import (
    Candidate,
    ClosedLoop,
    EstimateCache,
    Outcome,
    Replays,
    Setting,
    refusing_failures,
    verified_search,
)
from memplan.devices import device_model
from memplan.errors import BadInput
from memplan.estimate import Estimate
from memplan.plan import Plan, Segment
from memplan.planner import (
    Candidates,
    Floor,
    candidate_blocks,
    chained_runs,
    forward_calls_per_path,
    forward_passes,
    in_place_writers,
    peak_floor,
    plan_checkpoints,
    unsafe_reason,
)
from memplan.replay import RNG_STATE_BYTES, Timeline, casts_weight, estimate_replayed
from memplan.solvers import Solution
from memplan.step import StepConfig, precision_rule
from memplan.timing import (
    POLICY_BLIND,
    TimeModel,
    checkpoint_seconds,
    gpu_named,
    op_seconds,
    plan_checkpoint_seconds,
    recompute_seconds,
    segment_seconds,
    step_seconds,
    time_model_for,
)
from memplan.trace import ModuleCall, Trace
from memplan.workload import Workload

OBJECTIVES = ("seconds", "flops")
CLOSED_LOOP_ROUNDS = 8
BISECTION_ROUNDS = 3
VERIFICATIONS = 4  # searches, each checked by the estimator (memplan.closed_loop.verified_search)
BLEND_ROUNDS = 6  # blends of seconds and FLOPs tried, where no plan found beats a baseline in both
MIN_SHARE_STEP = 1e-3  # the walk stops where the shares left to try are closer than this
# The DP's forward residues (autocast's casts of the weights, a few per block, held until the forward
# ends) are judged in cells this many times coarser than the rest: its states multiply with their levels
# (llama2-7b's sub-block chain, before the DP's ceiling: 5.6 s a solve, against 83 s in fine cells). Every
# plan is replayed and re-estimated anyway; the gap's bound widens to match (solve_selective_chain).
RESIDUE_CELL = 64
COARSE_GRID = 8  # solve_selective_chain solves first on cells this many times larger: a ceiling for the DP
_CHUNK = 256  # DP states judged together (_undominated): a chunk's pairs against one update of its grid
_NEVER = np.iinfo(np.int64).max
GRID = 32  # knapsack resolution: 1/GRID of a block's bytes, per byte dimension
MAX_POLICIES = 24  # per block, after Pareto pruning (thinned evenly along held bytes beyond that)



# --------------------------------------------------------------------------------------------------
# What each block's op calls allocate


@dataclass(frozen=True)
class Cost:
    """What the planner minimises: per_second * seconds + per_flop * FLOPs. The objective "seconds" is
    (1, 0), "flops" (0, 1); a blend of the two finds plans between them, one of which may be at or below a
    baseline in both measures where neither extreme is (see _plan_selective)."""

    per_second: float
    per_flop: float

    @classmethod
    def of(cls, objective: str | Cost) -> Cost:
        if isinstance(objective, Cost):
            return objective
        if objective not in OBJECTIVES:
            raise BadInput(f"unknown objective {objective!r}; expected one of: {', '.join(OBJECTIVES)}")
        return cls(1.0, 0.0) if objective == "seconds" else cls(0.0, 1.0)

    def __call__(self, seconds: float, flops: float) -> float:
        return self.per_second * seconds + self.per_flop * flops


@dataclass(frozen=True)
class SavedCall:
    """One op call of a block's forward that allocates, as a save policy may keep it."""

    name: str  # "aten.addmm.default#2": the op and which of its calls (from 0) in one forward
    module: str  # the innermost module running it, for people reading plans
    held_bytes: int  # what keeping it adds to the bytes the block holds (its outputs, less the block's)
    needed_bytes: int  # of those, the activations autograd saves: recomputation no longer recreates them
    flops: int  # what keeping it saves in recomputation
    seconds: float  # and in time: its recomputation, less the dispatch that hands back its kept output
    excluded: str = ""  # why it may not be kept ("" = it may)
    cast_bytes: int = 0  # of its needed bytes, autocast's casts of weights (see Policy.forward_residue_bytes)

    @property
    def op(self) -> str:
        return self.name.partition("#")[0]


@dataclass(frozen=True)
class Policy:
    """One way to treat a block: kept, fully recomputed, or recomputed but for `saved_ops`."""

    name: str  # "keep", "full", "knapsack-3", "full-run-2"
    saved_ops: tuple[str, ...]  # call names ("aten.addmm.default#2"), or op names for all calls of an op
    contrib_bytes: int
    transient_bytes: int
    flops: int
    seconds: float
    checkpointed: bool = True
    # what a checkpointed forward of it holds until the forward ends beyond contrib_bytes: autocast's casts
    # of the weights that it does not keep (autocast's cache lets them go as it exits, memplan.replay)
    forward_residue_bytes: int = 0


@dataclass(frozen=True)
class BlockProfile:
    path: str
    group: str
    calls: tuple[SavedCall, ...]
    policies: tuple[Policy, ...]
    activation_bytes: int  # Σ activations it allocates (+ its outputs): what keeping it costs
    output_bytes: int
    flops: int
    seconds: float
    grad_bytes: int = 0  # parameter gradients its backward allocates (0 when they outlive the step)
    stashed_bytes: int = 0  # its inputs that a checkpoint of it keeps and the step without one frees in forward
    # what torch.utils.checkpoint itself keeps from a segment's forward to its backward on the target:
    # the CPU generator's state (memplan.replay.RNG_STATE_BYTES), device memory on a CPU target only
    checkpoint_state_bytes: int = 0
    # bytes a checkpointed forward of it still holds when the forward ends, beyond what its policy says
    # it holds (contrib and forward residue): learnt from replayed and re-estimated plans, 0 until then
    forward_residue_bytes: int = 0
    # finer segments under it (see SubBlock); () where the block is one unit of the chain
    parts: tuple[SubBlock, ...] = ()
    # the host time of one checkpoint call (memplan.timing.segment_seconds), in the seconds of its full
    # policy: a fully recomputed run of blocks is one call
    checkpoint_call_seconds: float = 0.0

    @property
    def exclusions(self) -> tuple[tuple[str, str], ...]:
        return tuple((c.name, c.excluded) for c in self.calls if c.excluded)

    @property
    def full_residue_bytes(self) -> int:
        """The forward residue of recomputing it whole."""
        return next((p.forward_residue_bytes for p in self.policies if p.name == "full"), 0)

    @property
    def full_seconds(self) -> float:
        """What recomputing it whole costs: its ops, and checkpointing's host time where that counts."""
        return next((p.seconds for p in self.policies if p.name == "full"), self.seconds)

    @property
    def units(self) -> tuple[BlockProfile, ...]:
        """What the chain DP steps over in this block: its finest parts in forward order, or itself."""
        return tuple(p.profile for p in self.parts if p.first == p.last) or (self,)

    def whole(self) -> BlockProfile:
        """The same block without its sub-blocks: one unit, as the chain over whole blocks sees it."""
        return replace(self, parts=())

    def block_level(self) -> BlockProfile:
        """The same block with only the block-level choices: kept or fully recomputed."""
        return replace(self, policies=tuple(p for p in self.policies if p.name in ("keep", "full")), parts=())


@dataclass(frozen=True)
class SubBlock:
    """A segment finer than its block: a child module (one level down), a run of children the block
    chains (`attn(ln_1(x))`), or ops the block runs outside any child it may checkpoint (residual adds,
    an unsafe child): those have only the "keep" policy. The parts with first == last partition the
    block's forward, so their kept bytes add up to the block's and the fixed bytes stay the same."""

    first: int  # index of its first unit among the block's units
    last: int
    modules: tuple[str, ...]  # what a checkpoint of it wraps; () for kept ops
    first_op: int  # its ops in the trace: [first_op, end_op)
    end_op: int
    profile: BlockProfile


def _forward_end(trace: Trace, start: int) -> int:
    """The index after the last op of the forward phase that op `start` belongs to."""
    end = start
    while end < len(trace.ops) and trace.ops[end].phase == "forward" and trace.ops[end].step == trace.ops[start].step:
        end += 1
    return end


def profile_block(trace: Trace, path: str, group: str, block_bytes: Callable[[int], int], clock: TimeModel,
                  objective: str | Cost = "seconds", *, last: str | None = None,
                  held_outputs: frozenset[int] | None = None, autocast: bool = False,
                  checkpoint_state_bytes: int = 0) -> BlockProfile:
    """`last`: profile the run of sibling modules from `path` to `last` as one segment. `held_outputs`:
    count only these of its outputs as held until backward (None: all); a sub-block's output that
    nothing saves (attn's, read by a residual add) is freed in forward, checkpointed or not. `autocast`:
    the step runs under autocast, whose casts of the weights a checkpointed forward holds to its end.
    `checkpoint_state_bytes`: what the checkpoint itself keeps until backward (BlockProfile's field)."""
    cost = Cost.of(objective)
    call = trace.first_forward_call(path)
    tail = call if last is None else trace.first_forward_call(last)
    ops = trace.ops[call.first_op : tail.end_op]
    allocated = {s for op in ops for s in op.allocates}
    activations = {s for s in allocated if trace.storages[s].role == "activations"}
    outputs = {s for s in tail.outputs if s in allocated and (held_outputs is None or s in held_outputs)}
    casts = {s for s in activations - outputs if autocast and casts_weight(trace, trace.storages[s])}
    # a checkpoint keeps its inputs until its backward, also those the step without it frees in forward
    stashed = {s for s in call.inputs if trace.storages[s].role == "temporaries"}

    def bb(storages: set[int]) -> int:
        return sum(block_bytes(trace.storages[s].nbytes) for s in storages)

    # A kept output must not change before backward reads it back: find in-place writers up to the
    # end of this forward (inside the block, or later, e.g. the next block's `x += ...`).
    mutated: dict[int, str] = {}
    for op in trace.ops[call.first_op : _forward_end(trace, call.first_op)]:
        for s in op.writes:
            if s in allocated and s not in mutated and trace.storages[s].allocated_by < op.index:
                mutated[s] = op.name

    stop = trace.early_stop(call.first_op, tail.end_op, tail.closed)
    seconds = {op.index: op_seconds(op, trace, clock) for op in ops if op.index <= stop}
    calls_seen: dict[str, int] = {}
    calls = []
    for op in ops:
        if op.name in POLICY_BLIND:
            continue
        position = calls_seen.get(op.name, 0)
        calls_seen[op.name] = position + 1
        if not op.allocates or op.index > stop:  # past the early stop: never run again, nothing to keep
            continue
        mine = set(op.allocates)
        written = sorted({mutated[s] for s in mine if s in mutated})
        calls.append(SavedCall(
            name=f"{op.name}#{position}", module=op.module,
            held_bytes=bb(mine - outputs), needed_bytes=bb((mine & activations) - outputs), flops=op.flops,
            seconds=seconds[op.index] - clock.selective_seconds_per_kept_op,
            excluded=f"its output is mutated in place by {', '.join(written)} later in the forward" if written else "",
            cast_bytes=bb(mine & casts),
        ))
    total_flops = sum(op.flops for op in ops if op.index <= stop)
    total_seconds = sum(seconds.values())
    keep_bytes = bb(activations | outputs)
    output_bytes = bb(outputs)
    transient_all = bb(activations - outputs)

    # checkpointing the block costs host time beyond recomputing it, more with a policy that keeps anything
    overhead = {selective: checkpoint_seconds(ops, trace, clock, selective) for selective in (False, True)}

    order = {c.name: i for i, c in enumerate(calls)}

    def policy(name: str, saved: Sequence[SavedCall]) -> Policy:
        return Policy(
            name=name,
            saved_ops=tuple(c.name for c in saved),  # named as the policy runtime counts them below
            contrib_bytes=output_bytes + bb(stashed) + checkpoint_state_bytes + sum(c.held_bytes for c in saved),
            transient_bytes=transient_all - sum(c.needed_bytes for c in saved),
            flops=total_flops - sum(c.flops for c in saved),
            seconds=total_seconds - sum(c.seconds for c in saved) + overhead[bool(saved)],
            forward_residue_bytes=bb(casts) - sum(c.cast_bytes for c in saved),
        )

    eligible = [c for c in calls if not c.excluded and (c.seconds > 0 or c.flops > 0)]
    # the block's own outputs: kept anyway (no bytes, no FLOPs), unless keeping one costs time (a CPU's
    # dispatch of the kept output exceeding its recomputation) where time is in the objective
    free = [c for c in eligible if c.held_bytes == 0 and (not cost.per_second or cost(c.seconds, c.flops) > 0)]
    priced = [c for c in eligible if c.held_bytes > 0]
    # the grid: 1/GRID of the transient, coarser where the kept bytes that shrink no transient dwarf it (a
    # sub-block that recreates little, as a norm): the table has a cell per quantum of those too
    other = sum(c.held_bytes - c.needed_bytes for c in priced)
    subsets = _knapsack_subsets(priced, cost, max(1, -(-transient_all // GRID), -(-other // (4 * GRID))))
    candidates = [policy(f"knapsack-{i}", free + chosen) for i, chosen in enumerate(subsets)]
    block_level = [Policy("keep", (), keep_bytes, 0, 0, 0.0, checkpointed=False),
                   Policy("full", (), output_bytes + bb(stashed) + checkpoint_state_bytes, transient_all, total_flops,
                          total_seconds + overhead[False], forward_residue_bytes=bb(casts))]
    # keep and full stay (the block-level choices); the others only where neither beats them
    family = _pareto_policies(block_level + candidates, cost)
    by_name = {c.name: c for c in calls}
    policies = block_level + [replace(p, saved_ops=_saved_names([by_name[n] for n in p.saved_ops], order, calls_seen))
                              for p in family if p.saved_ops]
    return BlockProfile(path, group, tuple(calls), tuple(policies), keep_bytes, output_bytes, total_flops,
                        total_seconds, stashed_bytes=bb(stashed), checkpoint_state_bytes=checkpoint_state_bytes,
                        checkpoint_call_seconds=segment_seconds(clock, selective=False))


def _saved_names(saved: Sequence[SavedCall], order: dict[str, int], calls_per_op: dict[str, int]) -> tuple[str, ...]:
    """Call names in forward order (`order`: call name -> its place); an op whose every call is kept is
    named once, without '#'."""
    chosen = sorted(saved, key=lambda c: order[c.name])
    kept_per_op = Counter(c.op for c in chosen)
    names: list[str] = []
    for call in chosen:
        if kept_per_op[call.op] < calls_per_op[call.op]:
            names.append(call.name)
        elif call.op not in names:
            names.append(call.op)
    return tuple(names)


def _knapsack_subsets(calls: Sequence[SavedCall], cost: Cost, quantum: int) -> list[list[SavedCall]]:
    """For every reachable (needed bytes, other bytes) cell of a grid of `quantum` bytes, the subset of
    `calls` that saves the most recomputation (by `cost`, FLOPs breaking ties, or seconds where it counts
    FLOPs only): a 0/1
    knapsack with two weights, since needed bytes also shrink the recomputation's transient."""
    if not calls:
        return [[]]
    needed = np.array([round(c.needed_bytes / quantum) for c in calls], dtype=np.int64)
    other = np.array([round((c.held_bytes - c.needed_bytes) / quantum) for c in calls], dtype=np.int64)
    primary = np.array([cost(c.seconds, c.flops) for c in calls])
    secondary = np.array([float(c.flops) if cost.per_second else c.seconds for c in calls])
    value = primary / max(primary.max(), 1e-30) + 1e-6 * secondary / max(secondary.max(), 1e-30)
    rows, cols = int(needed.sum()) + 1, int(other.sum()) + 1
    best = np.full((rows, cols), -np.inf)
    best[0, 0] = 0.0
    taken = np.zeros((len(calls), rows, cols), dtype=bool)
    for k in range(len(calls)):
        shifted = np.full((rows, cols), -np.inf)
        shifted[needed[k]:, other[k]:] = best[: rows - needed[k], : cols - other[k]] + value[k]
        taken[k] = shifted > best
        best = np.maximum(best, shifted)
    subsets = []
    for a, b in zip(*np.nonzero(np.isfinite(best))):
        chosen = []
        for k in range(len(calls) - 1, -1, -1):
            if taken[k, a, b]:
                chosen.append(calls[k])
                a, b = a - needed[k], b - other[k]
        subsets.append(chosen[::-1])
    return subsets


def _pareto_policies(policies: Sequence[Policy], cost: Cost) -> list[Policy]:
    """Those no other beats in held bytes, transient bytes and cost; at most MAX_POLICIES of them."""
    ordered = sorted(policies, key=lambda p: (cost(p.seconds, p.flops), p.contrib_bytes, p.transient_bytes))
    kept: list[Policy] = []
    for p in ordered:
        if not any(k.contrib_bytes <= p.contrib_bytes and k.transient_bytes <= p.transient_bytes for k in kept):
            kept.append(p)
    if len(kept) > MAX_POLICIES:
        kept.sort(key=lambda p: p.contrib_bytes)
        picks = np.unique(np.linspace(0, len(kept) - 1, MAX_POLICIES).round().astype(int))
        kept = [kept[i] for i in picks]
    return kept


# --------------------------------------------------------------------------------------------------
# Sub-blocks: the segments one level under each block


@dataclass(frozen=True)
class _Safety:
    """Whether a module, or a run of siblings, may be one segment: the rules of memplan.planner's
    candidates (called once per forward, nothing it reads or returns mutated later in forward)."""

    trace: Trace
    writers: dict[int, list[int]]
    forward_end: int
    passes: int
    calls_per_path: dict[str, int]
    refused: Mapping[str, str]  # see memplan.planner.unsafe_reason

    @classmethod
    def of(cls, trace: Trace, refused: Mapping[str, str]) -> _Safety:
        forward_end = max((c.end_op for c in trace.calls if c.phase == "forward" and c.step == 0), default=0)
        return cls(trace, in_place_writers(trace), forward_end, forward_passes(trace), forward_calls_per_path(trace),
                   refused)

    def once(self, call: ModuleCall) -> bool:
        return self.calls_per_path[call.path] <= self.passes

    def allows(self, head: ModuleCall, last: ModuleCall | None = None) -> bool:
        return not unsafe_reason(self.trace, self.writers, head, self.forward_end, last, self.refused)


def _child_calls(trace: Trace, call: ModuleCall) -> list[ModuleCall]:
    """The module calls directly inside `call` (one level down the call nesting), in order."""
    inside = sorted((c for c in trace.calls if c.phase == "forward" and c.step == call.step and c.path != call.path
                     and call.first_op <= c.first_op < c.end_op <= call.end_op), key=lambda c: c.opened)
    children: list[ModuleCall] = []
    for c in inside:
        if not children or c.first_op >= children[-1].end_op:
            children.append(c)
    return children


def _kept_unit(trace: Trace, path: str, group: str, first_op: int, end_op: int, held: frozenset[int],
               block_bytes: Callable[[int], int]) -> BlockProfile:
    """Ops of a block that no sub-block segment covers: always kept, holding what they allocate for backward."""
    ops = trace.ops[first_op:end_op]
    keep = sum(block_bytes(trace.storages[s].nbytes) for op in ops for s in op.allocates if s in held)
    return BlockProfile(path, group, (), (Policy("keep", (), keep, 0, 0, 0.0, checkpointed=False),), keep, 0,
                        sum(op.flops for op in ops), 0.0)


def _sub_blocks(trace: Trace, block: BlockProfile, safety: _Safety, activations: frozenset[int],
                block_bytes: Callable[[int], int], profile: Callable[..., BlockProfile]) -> tuple[SubBlock, ...]:
    """The units of `block` (its children and the ops between them) and the runs of children it chains;
    () where it has a single unit. `activations`: the storages the unplanned step holds for backward;
    with the block's outputs, what a unit holds of its own outputs. `profile(path, group, **kw)`:
    profile_block on this trace."""
    call = trace.first_forward_call(block.path)
    held = activations | frozenset(call.outputs)
    pieces: list[tuple[int, int, ModuleCall | None]] = []  # (first op, end op, child or None for own ops)
    at = call.first_op
    for child in _child_calls(trace, call):
        if child.first_op > at:
            pieces.append((at, child.first_op, None))
        pieces.append((child.first_op, child.end_op, child))
        at = child.end_op
    if at < call.end_op:
        pieces.append((at, call.end_op, None))
    if len(pieces) < 2:
        return ()

    def name(paths: Sequence[str]) -> str:
        return "+".join(p.removeprefix(block.path + ".") for p in paths)

    parts = []
    for i, (first_op, end_op, child) in enumerate(pieces):
        if child is not None and safety.once(child) and safety.allows(child):
            unit = profile(child.path, f"{block.group}/{name([child.path])}", held_outputs=held)
            parts.append(SubBlock(i, i, (child.path,), first_op, end_op, unit))
        else:
            path = child.path if child is not None else f"{block.path} (own ops {i})"
            parts.append(SubBlock(i, i, (), first_op, end_op,
                                  _kept_unit(trace, path, f"{block.group}/{i}", first_op, end_op, held, block_bytes)))
    children = [child for _, _, child in pieces]
    for start, end in chained_runs(children, safety.once):
        head, member = children[start], children[end]
        if (start, end) != (0, len(pieces) - 1) and safety.allows(head, member):  # all of it: the block
            paths = tuple(child.path for child in children[start : end + 1])
            run = profile(head.path, f"{block.group}/{name(paths)}", last=member.path, held_outputs=held)
            run = replace(run, path="+".join(paths))
            parts.append(SubBlock(start, end, paths, head.first_op, member.end_op, run))
    return tuple(parts)


# --------------------------------------------------------------------------------------------------
# The solver: an exact DP over the chain, Pareto-pruned


@dataclass(frozen=True)
class Choice:
    """One segment of the solution: units [first, last] of the chain (see BlockProfile.units) with a policy
    (runs of blocks are always "full"), checkpointing `modules`."""

    first: int
    last: int
    policy: Policy
    modules: tuple[str, ...] = ()


@dataclass(frozen=True)
class SelectiveSolution:
    choices: tuple[Choice, ...]  # only checkpointed segments
    feasible: bool
    modelled_peak_bytes: int
    recompute_flops: int
    recompute_seconds: float
    solve_seconds: float
    states_explored: int
    # (cost - lower bound) / cost over the policy families: 0.0 when proven optimal, nan when nothing fits
    optimality_gap: float = 0.0


@dataclass(frozen=True)
class _Option:
    end: int  # index after the option's last unit
    policy: Policy
    backward_above: int  # in backward, bytes above Σ contrib while it is recomputed (transient, gradients)
    forward_held: int  # bytes it holds from its forward to the end of the forward phase
    allocated: int  # bytes its forward allocates before dropping what it does not hold
    modules: tuple[str, ...]  # what its checkpoint wraps


def _options(blocks: Sequence[BlockProfile], recompute_offset: int = 0) -> list[list[_Option]]:
    """For each unit (see BlockProfile.units), the options starting there: a block with any policy, a
    run of 2+ consecutive blocks of one group fully recomputed, or a sub-block with any policy. In
    backward, recomputing it adds its transient and the gradients the backward of the units after it
    has allocated by then; in forward, a checkpointed segment holds its contrib and its forward residue
    until the forward ends."""
    units = [u for b in blocks for u in b.units]
    later_grads = np.cumsum([u.grad_bytes for u in units][::-1])[::-1].tolist() + [0]
    starts = np.cumsum([0] + [len(b.units) for b in blocks]).tolist()

    def option(policy: Policy, start: int, end: int, members: Sequence[BlockProfile],
               modules: tuple[str, ...]) -> _Option:
        learnt = sum(m.forward_residue_bytes for m in members)
        residue = policy.forward_residue_bytes + learnt if policy.checkpointed else 0
        return _Option(end, policy, policy.transient_bytes + later_grads[end] + recompute_offset,
                       policy.contrib_bytes + residue, sum(m.activation_bytes for m in members), modules)

    options: list[list[_Option]] = [[] for _ in units]
    for i, block in enumerate(blocks):
        first = starts[i]
        options[first] += [option(p, first, starts[i + 1], [block], (block.path,)) for p in block.policies]
        for part in block.parts:
            start, end = first + part.first, first + part.last + 1
            options[start] += [option(p, start, end, [part.profile], part.modules) for p in part.profile.policies]
        j = i + 1
        while block.group and j < len(blocks) and blocks[j].group == block.group:
            run = blocks[i : j + 1]
            everything = sum(b.activation_bytes for b in run)
            policy = Policy(f"full-run-{len(run)}", (),
                            run[-1].output_bytes + block.stashed_bytes + block.checkpoint_state_bytes,
                            everything - run[-1].output_bytes,
                            sum(b.flops for b in run),
                            sum(b.full_seconds for b in run) - sum(b.checkpoint_call_seconds for b in run[1:]),
                            forward_residue_bytes=sum(b.full_residue_bytes for b in run))
            options[first].append(option(policy, first, starts[j + 1], run, tuple(b.path for b in run)))
            j += 1
    return options


def solve_selective_chain(blocks: Sequence[BlockProfile], fixed_bytes: int, budget_bytes: int,
                          objective: str | Cost = "seconds", resolution: int | None = None,
                          forward_fixed_bytes: int | None = None, recompute_fixed_bytes: int | None = None,
                          bound: bool = True) -> SelectiveSolution:
    """The cheapest policy per block or sub-block (and fully recomputed runs of blocks) whose modelled
    peak fits.

    `fixed_bytes` is what the backward peak holds besides the blocks' activations; `forward_fixed_bytes`
    the same for the forward phase's peak (None: the same), which holds more where e.g. autocast keeps
    its casts of the weights until the forward ends; `recompute_fixed_bytes` the same while blocks are
    recomputed later in backward (None: the same), less where the peak holds the loss's temporaries.

    A DP over unit boundaries (BlockProfile.units); a state is (cost, held, peak-term, forward held): Σ
    contrib so far, the largest Σ_{i<=j} contrib_i + (its backward bytes above, see _options) and
    Σ_{i<j} forward held_i + allocated_j (+ the forward's fixed bytes less the backward's) so far, and Σ
    forward held so far. A state is dropped when it no longer fits, or when another costs no more and is
    within `resolution` bytes in held and peak (default: 1/1024 of the room) and RESIDUE_CELL x
    `resolution` in forward residues (forward held less held), which bounds the states per boundary.
    With resolution 1 that is exact. Otherwise the dropped state's future is open to its substitute with
    at most `resolution` more bytes per boundary in held and peak, and that plus the residues' cell in
    forward held, so the same DP with the room widened by n times that (n: the units) costs no more than
    the optimum: a lower bound, and the gap reported is (cost - bound) / cost (bound=False: not computed,
    nan). When nothing fits, the smallest modelled peak is returned (feasible=False)."""
    cost = Cost.of(objective)
    started = time.perf_counter()
    room = budget_bytes - fixed_bytes
    forward_offset = 0 if forward_fixed_bytes is None else forward_fixed_bytes - fixed_bytes
    options = _options(blocks, 0 if recompute_fixed_bytes is None else recompute_fixed_bytes - fixed_bytes)
    resolution = resolution or max(1, room // 1024)
    residues = any(o.forward_held > o.policy.contrib_bytes for starting in options for o in starting)
    # a chain found first on cells COARSE_GRID times larger fits too (fitting is judged in exact bytes):
    # its cost is a ceiling for the fine DP (_chain_dp)
    coarse = _chain_dp(options, room, cost, resolution * COARSE_GRID, forward_offset)
    found = _chain_dp(options, room, cost, resolution, forward_offset, coarse[0] if coarse else math.inf)
    gap = 0.0
    if found is None:  # the smallest peak: on a grid of the bytes at stake, however small the room
        found = _chain_dp(options, None, cost, max(resolution, sum(b.activation_bytes for b in blocks) // 1024),
                          forward_offset)
        gap = float("nan")
    elif not bound:
        gap = float("nan")
    elif resolution > 1 and found[0] > 0:
        drift = resolution * (1 + (RESIDUE_CELL if residues else 0))  # per unit, at most (see above)
        bound = _chain_dp(options, room + len(options) * drift, cost, resolution, forward_offset, found[0])
        gap = max(0.0, (found[0] - bound[0]) / found[0])
    _, held, peak, path, explored = found
    explored += coarse[4] if coarse else 0
    choices = tuple(Choice(start, o.end - 1, o.policy, o.modules) for start, o in path if o.policy.checkpointed)
    modelled = fixed_bytes + max(held, peak)
    return SelectiveSolution(choices, modelled <= budget_bytes, modelled, sum(c.policy.flops for c in choices),
                             sum(c.policy.seconds for c in choices), time.perf_counter() - started, explored, gap)


def _chain_dp(options: list[list[_Option]], room: int | None, cost_of: Cost, resolution: int,
              forward_offset: int, ceiling: float = math.inf) -> tuple[float, int, int, list[tuple[int, _Option]], int] | None:
    """(cost, held, peak, [(start, option)], states explored) of the cheapest chain within `room`,
    None if none fits; room None: the smallest max(held, peak) instead, cheapest among those.

    `ceiling`: the cost of a chain known to fit. A state that costs more leads to no cheaper chain (no
    option costs less than nothing), and every state it would drop costs no less, so dropping such states
    at once changes neither the states kept below the ceiling nor the chain found. On llama2-7b's
    sub-block chain (amp-bf16, 58 GiB) about a tenth of the states remain: 0.7 s a solve, against 7 s."""
    n = len(options)
    # per boundary: arrays cost, held, peak, forward held, and where each came from (boundary, state, option)
    pending: list[list[tuple[np.ndarray, ...]]] = [[] for _ in range(n + 1)]
    zero = np.zeros(1, dtype=np.int64)
    pending[0].append((np.zeros(1), zero, zero, zero, zero - 1, zero - 1, zero - 1))
    frontiers: list[tuple[np.ndarray, ...] | None] = [None] * (n + 1)
    explored = 0
    for i in range(n + 1):
        if not pending[i]:
            continue
        columns = [np.concatenate(parts) for parts in zip(*pending[i])]
        keep = _undominated(*columns[:4], resolution, by_peak=room is None)
        frontiers[i] = tuple(column[keep] for column in columns)
        if i == n:
            break
        cost, held, peak, forward = (column[:, None] for column in frontiers[i][:4])
        here = options[i]
        o_cost = np.array([cost_of(o.policy.seconds, o.policy.flops) for o in here])
        o_contrib = np.array([o.policy.contrib_bytes for o in here], dtype=np.int64)
        o_above = np.array([o.backward_above for o in here], dtype=np.int64)
        o_forward = np.array([o.forward_held for o in here], dtype=np.int64)
        o_allocated = np.array([o.allocated for o in here], dtype=np.int64)
        o_end = np.array([o.end for o in here])
        new_cost = cost + o_cost
        new_held = held + o_contrib
        new_forward = forward + o_forward
        new_peak = np.maximum(np.maximum(peak, new_held + o_above), forward + o_allocated + forward_offset)
        explored += new_cost.size
        fits = np.ones(new_cost.shape, dtype=bool) if room is None else np.maximum(new_held, new_peak) <= room
        fits &= new_cost <= ceiling
        for end in np.unique(o_end):
            s, o = np.nonzero(fits & (o_end == end)[None, :])
            if len(s):
                pending[end].append((new_cost[s, o], new_held[s, o], new_peak[s, o], new_forward[s, o],
                                     np.full(len(s), i), s, o))
    final = frontiers[n]
    if final is None or not len(final[0]):
        return None
    cost, held, peak = final[:3]
    top = np.maximum(held, peak)
    best = int(np.lexsort((top, cost))[0] if room is not None else np.lexsort((cost, top))[0])
    path = []
    boundary, state = n, best
    while boundary > 0:
        back_i, back_s, back_o = frontiers[boundary][4:]
        start, previous, option = int(back_i[state]), int(back_s[state]), int(back_o[state])
        path.append((start, options[start][option]))
        boundary, state = start, previous
    path.reverse()
    return float(cost[best]), int(held[best]), int(peak[best]), path, explored


def _undominated(cost: np.ndarray, held: np.ndarray, peak: np.ndarray, forward: np.ndarray, resolution: int,
                 by_peak: bool) -> np.ndarray:
    """Indices of the states to keep, in order (cost, then held and peak; by_peak, when nothing fits: the
    smallest max(held, peak) first, bytes alone decide): those that no state before them matches or
    beats in held and peak, in cells of `resolution` bytes, and in forward held beyond held (the forward
    residues), in cells RESIDUE_CELL times as large (exact at resolution 1). Whatever an earlier state
    beats, a kept one beats too (the relation is transitive), so each state is judged against all the
    states before it, a chunk at a time."""
    q_held, q_peak = -(-held // resolution), -(-peak // resolution)
    residue_cell = resolution * RESIDUE_CELL if resolution > 1 else 1
    levels, level = np.unique(-(-(forward - held) // residue_cell), return_inverse=True)
    keys = (q_peak, q_held, cost) if not by_peak else (cost, np.maximum(q_held, q_peak))  # np.lexsort's: last first
    # within each cell of held and residues, in order, only the states whose peak falls (vectorised)
    cell = q_held * len(levels) + level
    by_cell = np.lexsort((*keys, cell))
    peaks, cells = q_peak[by_cell], cell[by_cell]
    first = np.r_[True, cells[1:] != cells[:-1]]
    lowered = peaks - (np.cumsum(first) - 1) * (int(peaks.max()) + 1)  # each cell below all before it
    lowest_before = np.r_[_NEVER, np.minimum.accumulate(lowered)[:-1]]
    lowest_before[first] = _NEVER
    survivors = by_cell[lowered < lowest_before]
    survivors = survivors[np.lexsort((survivors, *(key[survivors] for key in keys)))]  # ties: by index
    # across cells: lowest[e, h], the lowest peak of the states so far with residues <= e and held <= h
    lowest = np.full((len(levels), int(q_held.max()) + 1), _NEVER)
    kept = []
    for chunk in np.array_split(survivors, max(1, -(-len(survivors) // _CHUNK))):
        chunk = chunk[lowest[level[chunk], q_held[chunk]] > q_peak[chunk]]
        e, h, p = level[chunk], q_held[chunk], q_peak[chunk]
        earlier = np.triu(np.ones((len(chunk), len(chunk)), dtype=bool), 1)
        kept.append(chunk[~(earlier & (e[:, None] <= e) & (h[:, None] <= h) & (p[:, None] <= p)).any(axis=0)])
        grid = np.full(lowest.shape, _NEVER)
        np.minimum.at(grid, (e, h), p)
        np.minimum(lowest, np.minimum.accumulate(np.minimum.accumulate(grid, axis=0), axis=1), out=lowest)
    return np.concatenate(kept)


# --------------------------------------------------------------------------------------------------
# Closed loop


@dataclass(frozen=True)
class SelectiveResult:
    """As memplan.planner.PlanResult (plan, unplanned, planned, candidates, solution), plus the per-block
    policies and op exclusions, and the recompute overhead in FLOPs and seconds (memplan.timing)."""

    plan: Plan
    unplanned: Estimate
    planned: Estimate
    candidates: Candidates
    solution: Solution
    selective: SelectiveSolution | None  # None when the plan returned is a baseline passed in
    blocks: tuple[BlockProfile, ...]
    exclusions: tuple[tuple[str, str, str], ...]  # (block, op call, why it is never saved)
    recompute_flops: int  # the estimator's: planned step FLOPs - unplanned step FLOPs
    recompute_seconds: float  # planned trace - unplanned trace, plus checkpointing's host time
    step_seconds: float  # seconds of the unplanned step
    processor: str  # the time model that priced recomputation (memplan.timing)
    objective: str
    solve_seconds: float  # all DP solves together
    plan_seconds: float  # everything, estimator runs included
    rounds: int  # plans the estimator ran on
    replays: int  # plans replayed from the unplanned trace (memplan.replay)
    floor: Floor  # a peak no checkpoint plan goes below

    @property
    def flops_overhead_pct(self) -> float:
        return 100 * self.recompute_flops / self.plan.step_flops if self.plan.step_flops else 0.0

    @property
    def seconds_overhead_pct(self) -> float:
        return 100 * self.recompute_seconds / self.step_seconds if self.step_seconds else 0.0


def _segments(solution: SelectiveSolution) -> tuple[Segment, ...]:
    return tuple(Segment(choice.modules, policy="selective" if choice.policy.saved_ops else "full",
                         saved_ops=choice.policy.saved_ops, activation_bytes=choice.policy.contrib_bytes,
                         recompute_flops=choice.policy.flops)
                 for choice in solution.choices)


def profile_blocks(trace: Trace, device: str, clock: TimeModel, objective: str | Cost = "seconds",
                   peak_event: int | None = None, autocast: bool = False,
                   refused: Mapping[str, str] | None = None) -> tuple[Candidates, tuple[BlockProfile, ...]]:
    """The candidate blocks with their policies and sub-blocks. `peak_event`: the unplanned peak's index in
    trace.events; the gradients allocated by then are in the fixed bytes already, so the units last in
    the chain (first in backward) allocate that much less. `autocast`: as profile_block's. `refused`:
    see memplan.planner.unsafe_reason."""
    block_bytes = device_model(device).block_bytes
    candidates = candidate_blocks(trace, block_bytes, refused=refused)
    state = RNG_STATE_BYTES if device == "cpu" else 0  # a CUDA step's generator states are host memory

    def profile(path: str, group: str, **kwargs) -> BlockProfile:
        return profile_block(trace, path, group, block_bytes, clock, objective, autocast=autocast,
                             checkpoint_state_bytes=state, **kwargs)

    unique = list({b.path: b for b in candidates.blocks}.values())  # a path listed twice is one block
    safety = _Safety.of(trace, refused or {})
    activations = frozenset(sid for sid, s in trace.storages.items() if s.role == "activations")
    profiles = []
    for b in unique:
        block = profile(b.path, b.group)
        profiles.append(replace(block, parts=_sub_blocks(trace, block, safety, activations, block_bytes, profile)))
    # a block unsafe to recompute whole (a decoder layer that appends to a cache it is handed) may still
    # hold safe sub-blocks (its MLP): it joins the chain kept whole, its sub-blocks as the options
    for excluded in candidates.excluded:
        call = trace.first_forward_call(excluded.path)
        if not safety.once(call):
            continue
        block = profile(excluded.path, "")
        block = replace(block, policies=tuple(p for p in block.policies if p.name == "keep"))
        parts = _sub_blocks(trace, block, safety, activations, block_bytes, profile)
        if any(part.modules for part in parts):
            profiles.append(replace(block, parts=parts))
    profiles.sort(key=lambda p: trace.first_forward_call(p.path).opened)
    ranges = [r for p in profiles for r in _unit_ranges(trace, p)]
    grads = _gradient_bytes(trace, ranges, block_bytes)
    counted = 0 if peak_event is None else sum(
        block_bytes(trace.storages[e.storage].nbytes) for e in trace.events[: peak_event + 1]
        if e.kind == "alloc" and trace.storages[e.storage].role == "gradients"
        and trace.ops[e.op].step == trace.ops[trace.events[peak_event].op].step)
    for k in reversed(range(len(grads))):
        taken = min(counted, grads[k])
        grads[k] -= taken
        counted -= taken
    with_grads = []
    for p in profiles:
        mine, grads = grads[: len(p.units)], grads[len(p.units) :]
        parts = tuple(replace(part, profile=replace(part.profile, grad_bytes=mine[part.first]))
                      if part.first == part.last else part for part in p.parts)
        with_grads.append(replace(p, grad_bytes=sum(mine), parts=parts))
    return candidates, tuple(with_grads)


def _unit_ranges(trace: Trace, block: BlockProfile) -> list[tuple[int, int]]:
    """The op ranges of the block's units, in forward order."""
    if not block.parts:
        call = trace.first_forward_call(block.path)
        return [(call.first_op, call.end_op)]
    return [(p.first_op, p.end_op) for p in block.parts if p.first == p.last]


def _gradient_bytes(trace: Trace, ranges: Sequence[tuple[int, int]], block_bytes: Callable[[int], int]) -> list[int]:
    """Per unit (op range, in forward order), the bytes of the gradients of the weights its forward reads
    (a weight several units read: the last, whose backward runs first), as gradients have their weights'
    size; all 0 when the first step's backward allocates no gradients (they outlive the step: the peak
    counts them already)."""
    fresh = any(s.role == "gradients" and s.allocated_by is not None and trace.ops[s.allocated_by].phase == "backward"
                for s in trace.storages.values())
    if not fresh:
        return [0] * len(ranges)
    owner: dict[int, int] = {}
    for k, (first_op, end_op) in enumerate(ranges):  # forward order: a later reader takes the weight over
        for op in trace.ops[first_op:end_op]:
            for s in op.reads:
                if trace.storages[s].role == "weights":
                    owner[s] = k
    grads = [0] * len(ranges)
    for s, k in owner.items():
        grads[k] += block_bytes(trace.storages[s].nbytes)
    return grads


def _forward_residues(trace: Trace, plan: Plan, block_bytes: Callable[[int], int],
                      modelled: dict[tuple[str, tuple[str, ...]], int]) -> dict[str, int]:
    """Per block or sub-block module that `plan` (replayed or re-estimated as `trace`) checkpoints alone,
    the bytes its forward allocates and still holds when the forward phase ends, beyond what the DP
    models it to (`modelled`, by path and saved ops: see _modelled_holds)."""
    freed_after = {e.storage: e.op for e in trace.events if e.kind == "free"}
    ends = [i for i, e in enumerate(trace.events) if e.kind == "phase" and e.phase != "forward"]
    # the first forward's allocations, by event (a replay's RNG state is made by no op; its recomputation
    # allocates again in backward, under the forward ops' indices)
    allocs = [e for e in trace.events[: min(ends, default=len(trace.events))] if e.kind == "alloc"]
    residues = {}
    for segment in plan.segments:
        path = segment.modules[0]
        if len(segment.modules) != 1 or (path, segment.saved_ops) not in modelled:
            continue
        call = trace.first_forward_call(path)
        last = _forward_end(trace, call.first_op) - 1  # freed after the forward's last op: held to its end
        held = {e.storage for e in allocs if call.first_op <= e.op < call.end_op
                and freed_after.get(e.storage, len(trace.ops)) >= last}
        residues[path] = max(0, sum(block_bytes(trace.storages[s].nbytes) for s in held)
                             - modelled[path, segment.saved_ops])
    return residues


def _modelled_holds(blocks: Sequence[BlockProfile]) -> dict[tuple[str, tuple[str, ...]], int]:
    """By the module a segment checkpoints alone (a block, or a sub-block of one module) and the ops its
    policy saves: what the DP models its forward to allocate and hold until the forward ends (its
    contrib but the inputs it stashes, and its forward residue)."""
    return {(unit.path, policy.saved_ops): policy.contrib_bytes - unit.stashed_bytes + policy.forward_residue_bytes
            for b in blocks for unit in (b, *(part.profile for part in b.parts if len(part.modules) == 1))
            for policy in unit.policies if policy.checkpointed}


def _with_residues(blocks: Sequence[BlockProfile], residues: dict[str, int]) -> list[BlockProfile]:
    """The blocks and sub-blocks with the forward residues learnt so far: one's own, else the largest
    learnt for one of the same structure (group and bytes), else 0."""
    alike: dict[tuple, int] = {}
    for p in (p for b in blocks for p in (b, *(part.profile for part in b.parts))):
        if p.path in residues:
            key = (p.group, p.activation_bytes)
            alike[key] = max(alike.get(key, 0), residues[p.path])

    def learnt(p: BlockProfile) -> BlockProfile:
        return replace(p, forward_residue_bytes=residues.get(p.path, alike.get((p.group, p.activation_bytes), 0)))

    return [replace(learnt(b), parts=tuple(replace(part, profile=learnt(part.profile)) for part in b.parts))
            for b in blocks]


def _residues_of(blocks: Sequence[BlockProfile]) -> list[int]:
    return [p.forward_residue_bytes for b in blocks for p in (b, *(part.profile for part in b.parts))]


@dataclass(frozen=True)
class _Problem:
    """One chain DP: the blocks, with the forward residues learnt by then, and the fixed bytes per phase."""

    blocks: Sequence[BlockProfile]
    fixed_bytes: int
    forward_fixed_bytes: int
    recompute_fixed_bytes: int

    def solve(self, budget_bytes: int, objective: str | Cost, bound: bool) -> SelectiveSolution:
        return solve_selective_chain(self.blocks, self.fixed_bytes, budget_bytes, objective,
                                     forward_fixed_bytes=self.forward_fixed_bytes,
                                     recompute_fixed_bytes=self.recompute_fixed_bytes, bound=bound)


@dataclass(frozen=True)
class _Solved:
    solution: SelectiveSolution
    problem: _Problem  # to bound the solution's gap, once it is the one chosen
    weights: Cost  # what the DP minimised


def plan_selective(
    workload: Workload,
    config: StepConfig,
    budget_bytes: int,
    device: str = "cuda",
    objective: str = "seconds",
    processor: str | TimeModel | None = None,
    cache: EstimateCache | None = None,
    baselines: Sequence[Plan] | None = None,
    time_limit_s: float | None = None,
) -> SelectiveResult:
    """The cheapest selective-recompute plan (by `objective`: "seconds" on `processor`, or "flops") whose
    re-estimated peak fits `budget_bytes`; feasible=False with the smallest peak reached when none fits.
    `processor`: a GPU name or "cpu" (memplan.timing); None: what `device` runs on (the CPU, or an H100). On
    CUDA the GPU named also sets the library workspaces the estimator counts, as `estimate --gpu` does.
    The plan must fit the budget by the estimator, as the block-level planner's does. `baselines`: plans
    of other planners re-estimated alongside; the plan returned recomputes no more than any of them that
    fits, in FLOPs and in seconds (at worst it is that baseline; where the plans least in `objective`
    are dearer than a baseline in the other measure, blends of the two measures are tried for one that is
    not, up to BLEND_ROUNDS). None: the block-level planner's plan
    (memplan.planner.plan_checkpoints, in the time left), whose candidates (modules at any depth) the
    selective chain does not all have. `time_limit_s`: once past it, the closed loop stops at the first
    plan that fits (or when it gives up), skipping the block-level loop, the bisection, the default
    baseline (unless no plan fits) and the optimality bound; None: no limit. Modules whose recomputation
    fails the estimator are left out (memplan.closed_loop.refusing_failures)."""
    if objective not in OBJECTIVES:
        raise BadInput(f"unknown objective {objective!r}; expected one of: {', '.join(OBJECTIVES)}")
    cache = cache or EstimateCache()
    return refusing_failures(
        lambda refused, left: _plan_selective(workload, config, budget_bytes, device, objective, processor, cache,
                                              baselines, left, refused),
        time_limit_s)


def _plan_selective(
    workload: Workload, config: StepConfig, budget_bytes: int, device: str, objective: str,
    processor: str | TimeModel | None, cache: EstimateCache, baselines: Sequence[Plan] | None,
    time_limit_s: float | None, refused: dict[str, str],
) -> SelectiveResult:
    started = time.perf_counter()
    clock = time_model_for(device, processor, config.precision)
    gpu = gpu_named(device, processor)
    unplanned, trace = cache.estimate(workload, config, device, gpu)
    peak_event = unplanned.simulation.peak_event if unplanned.simulation is not None else None
    autocast = precision_rule(config.precision).autocast_dtype is not None
    candidates, blocks = profile_blocks(trace, device, clock, objective, peak_event, autocast=autocast, refused=refused)
    fixed = max(0, unplanned.peak_bytes - sum(b.activation_bytes for b in blocks))
    forward_peak = unplanned.phase_peaks.get("forward")
    forward_fixed = None if forward_peak is None else max(0, forward_peak - sum(b.activation_bytes for b in blocks))
    # the loss's temporaries at a backward peak are gone by the time the blocks are recomputed
    recompute_fixed = fixed - (unplanned.breakdown.temporaries if unplanned.peak_phase == "backward" else 0)
    base_seconds = step_seconds(trace, clock)
    method = f"selective-dp ({objective})"
    own = Cost.of(objective)

    residues: dict[str, int] = {}  # learnt from each replayed or re-estimated plan, per block checkpointed alone
    modelled = _modelled_holds(blocks)
    allocator = device_model(device, gpu)
    block_bytes = allocator.block_bytes
    estimated: dict[tuple[Segment, ...], tuple[Plan, Estimate]] = {}  # plans the estimator ran on
    timeline = Timeline(trace)

    def realise(plan: Plan) -> tuple[Plan, Estimate]:
        """The estimator on the planned model: the truth every plan returned is judged by."""
        if plan.segments not in estimated:
            planned, planned_trace = cache.realise_checked(workload, config, device, plan, gpu)
            residues.update(_forward_residues(planned_trace, plan, block_bytes, modelled))
            seconds = max(0.0, recompute_seconds(trace, planned_trace, plan, clock))
            estimated[plan.segments] = (replace(
                plan, feasible=planned.peak_bytes <= budget_bytes, predicted_peak_bytes=planned.peak_bytes,
                recompute_flops=max(0, planned.step_flops - unplanned.step_flops), recompute_seconds=seconds), planned)
        return estimated[plan.segments]

    def replay(plan: Plan) -> tuple[Plan, Estimate]:
        """The plan replayed from the unplanned trace (memplan.replay), whose forward residues the chain DP
        learns as from the estimator's runs: the replay holds autocast's casts as a planned forward does."""
        planned, replayed = estimate_replayed(workload, config, device, trace, plan, timeline, gpu)
        residues.update(_forward_residues(replayed.trace, plan, block_bytes, modelled))
        seconds = (sum(op_seconds(trace.ops[i], trace, clock) for i in replayed.recomputed_ops)
                   + plan_checkpoint_seconds(trace, plan, clock))
        return replace(plan, predicted_peak_bytes=planned.peak_bytes, recompute_seconds=seconds,
                       recompute_flops=planned.step_flops - unplanned.step_flops), planned

    replays = Replays(replay, budget_bytes)

    def cost(r: Outcome) -> float:
        return r.plan.recompute_seconds if objective == "seconds" else float(r.plan.recompute_flops)

    def in_time() -> bool:
        return time_limit_s is None or time.perf_counter() - started < time_limit_s

    solve_seconds = 0.0

    def draft(segments: tuple[Segment, ...], method: str) -> Plan:
        """A plan of these segments, its figures not filled in yet."""
        return Plan(
            model=workload.spec, batch_size=workload.effective_batch_size, precision=config.precision,
            optimizer=config.optimizer, grad_accum=config.grad_accum, device=device, method=method,
            segments=segments, feasible=False, budget_bytes=budget_bytes, predicted_peak_bytes=0,
            unplanned_peak_bytes=unplanned.peak_bytes, recompute_flops=0, step_flops=unplanned.step_flops,
            options=dict(workload.options))

    def solver(chain: Sequence[BlockProfile], correction: int, weights: Cost) -> Callable[[Setting], Candidate[_Solved]]:
        """Solve `chain` for least `weights` with the setting's (backward, forward) margins added to the
        fixed bytes, to fit the budget less the search's correction."""

        def solve(margins: Setting) -> Candidate[_Solved]:
            nonlocal solve_seconds
            backward, forward = margins
            problem = _Problem(_with_residues(chain, residues), fixed + backward,
                               (fixed if forward_fixed is None else forward_fixed) + forward, recompute_fixed + backward)
            solution = problem.solve(budget_bytes - correction, weights, bound=False)
            solve_seconds += solution.solve_seconds
            return Candidate(draft(_segments(solution), method), solution.feasible, _Solved(solution, problem, weights))

        return solve

    def search(correction: int, blocks: Sequence[BlockProfile] = blocks, weights: Cost = own,
               finest_only: bool = False) -> list[Outcome[_Solved]]:
        """The closed loops, for least `weights` over `blocks` (profiled for them), over plans replayed
        `correction` bytes higher (the estimator's figures for a plan it has run on): the chain over whole blocks first, then the one over sub-blocks too (a
        superset of it, but the model misses more of what a sub-block's backward holds, so its loop may
        end on a plan dearer than the whole blocks'), then the block-level choices only. Under a time
        limit the sub-block chain goes first: the first loop runs however long, and the superset is the
        one whose plan may be far cheaper (llama2-7b at 58 GiB: 9.7 ms against 17.9 ms). `finest_only`: the
        sub-block chain alone (the superset)."""
        replayed = replays.realise(correction)

        def realise(plan: Plan) -> tuple[Plan, Estimate]:
            return estimated.get(plan.segments) or replayed(plan)

        def tighten(margins: Setting, over: Outcome, scale: int) -> Setting | None:
            """Add what the replay found over the budget to the fixed bytes of the phase that peaked; but
            where the forward peaked and its replay taught the DP forward residues it had not counted,
            solve again as is (the residues now count what the margin would add)."""
            phase = over.planned.peak_phase
            if phase not in ("forward", "backward"):
                return None
            solved = over.solution.problem.blocks
            if phase == "forward" and _residues_of(_with_residues(solved, residues)) != _residues_of(solved):
                return margins
            excess = scale * max(1, over.planned.peak_bytes + correction - budget_bytes)
            backward, forward = margins
            return (backward + excess, forward) if phase == "backward" else (backward, forward + excess)

        chains = [[b.whole() for b in blocks]] + ([list(blocks)] if any(b.parts for b in blocks) else [])
        if time_limit_s is not None or finest_only:
            chains.reverse()
        if finest_only:
            chains = chains[:1]
        loop = ClosedLoop(solver(chains[0], correction, weights), realise, tighten)
        loops = [(loop, loop.until_fits((0, 0), CLOSED_LOOP_ROUNDS))]  # to a plan that fits, however long
        if in_time() and len(chains) > 1:
            other = replace(loop, solve=solver(chains[1], correction, weights))  # shares loop.realised
            loops.append((other, other.until_fits((0, 0), CLOSED_LOOP_ROUNDS, in_time)))
        if in_time() and not finest_only:
            block_level = replace(loop, solve=solver([b.block_level() for b in blocks], correction, weights))
            block_level.until_fits((0, 0), CLOSED_LOOP_ROUNDS, in_time)
        for chain, tight in loops:
            if tight.fits and tight.loose is not None:
                chain.bisect(tight.loose, tight.setting, BISECTION_ROUNDS, in_time)
        searched.update(loop.realised)
        return list(loop.realised.values())

    def might_cost_less(plan: Plan) -> bool:
        """Whether `plan`, as replayed, might recompute less, in FLOPs or in seconds on `clock`, than
        every plan found that fits by the estimator. One that cannot would be neither chosen nor a bar
        to the plan chosen (see beats_baselines), so the estimator need not run on it."""
        replayed, _ = replay(plan)
        return not any(found.feasible and found.recompute_flops <= replayed.recompute_flops
                       and found.recompute_seconds <= replayed.recompute_seconds + 1e-15
                       for found, _ in estimated.values())

    searched: dict[tuple[Segment, ...], Outcome[_Solved]] = {}
    if unplanned.peak_bytes <= budget_bytes:  # the step fits as it is: no plan, whatever a plan would cost
        realise(draft((), "none"))
        baselines = ()
    else:
        verified_search(search, realise, cost, VERIFICATIONS, in_time)
    if baselines is None:  # a refinement like the others, skipped past the time limit unless nothing fits
        baselines = ()
        if in_time() or not any(plan.feasible for plan, _ in estimated.values()):
            left = None if time_limit_s is None else max(0.0, time_limit_s - (time.perf_counter() - started))
            block_level = plan_checkpoints(workload, config, budget_bytes, device, gpu=gpu, processor=processor, time_limit_s=left,
                                           cache=cache, worth_checking=might_cost_less)
            baselines = (block_level.plan,) if block_level.checked else ()
    external = []
    for baseline in baselines:
        plan, planned = realise(replace(baseline, budget_bytes=budget_bytes))
        external.append(Outcome(plan, planned, None))

    def beats_baselines(r: Outcome) -> bool:
        return all(r.plan.recompute_flops <= b.plan.recompute_flops
                   and r.plan.recompute_seconds <= b.plan.recompute_seconds + 1e-15
                   for b in external if b.plan.feasible)

    def blended(share: float) -> Outcome | None:
        """The cheapest plan that fits by replay, found for least (1 - share) x seconds + share x FLOPs, each
        as a fraction of the unplanned step's."""
        weights = Cost((1 - share) / max(base_seconds, 1e-30), share / max(unplanned.step_flops, 1))
        _, mixed = profile_blocks(trace, device, clock, weights, peak_event, autocast=autocast, refused=refused)
        found = [r for r in search(0, mixed, weights, finest_only=True) if r.plan.feasible]
        return min(found, key=lambda r: weights(r.plan.recompute_seconds, r.plan.recompute_flops)) if found else None

    # A plan least in one measure may be dearer than a baseline in the other (GPT-2's tiny model at half
    # its peak: least time recomputes matmuls, where the block-level plan recomputes attention, cheap in
    # FLOPs). Walk the lower hull of (seconds, FLOPs) between the cheapest plan found in the objective and
    # the baseline: solve for the blend at which the two cost the same, and replace whichever side the
    # plan found falls on, until one is at or below the baseline in both (the Lagrangian's breakpoints).
    # The DP prices plans by its model and the ends are replayed, so a solve may return an end again
    # where the two disagree: the shares that gave each side bracket the next, halved in that case.
    feasible_baselines = [b for b in external if b.plan.feasible]
    found = [Outcome(r, p, None) for r, p in estimated.values() if r.feasible and r.segments not in
             {b.plan.segments for b in external}]
    if len(feasible_baselines) == 1 and found and not any(beats_baselines(r) for r in found) and in_time():
        baseline = feasible_baselines[0].plan

        def point(r: Outcome) -> tuple[float, float]:
            """(seconds, FLOPs) as fractions of the unplanned step's, as `blended` weighs them."""
            return r.plan.recompute_seconds / max(base_seconds, 1e-30), r.plan.recompute_flops / max(unplanned.step_flops, 1)

        # `fast`: the quickest plan found that recomputes more FLOPs than the baseline; `lean`: the baseline
        dearer = [point(r) for r in found if r.plan.recompute_flops > baseline.recompute_flops]
        fast, lean = (min(dearer) if dearer else None), point(feasible_baselines[0])
        low, high = 0.0, 1.0  # shares known to solve to a plan on the fast side and on the lean side
        for _ in range(BLEND_ROUNDS if fast is not None else 0):
            if not in_time() or fast[1] <= lean[1] or lean[0] <= fast[0] or high - low < MIN_SHARE_STEP:
                break
            share = (lean[0] - fast[0]) / ((lean[0] - fast[0]) + (fast[1] - lean[1]))  # equal blended costs
            if not low < share < high:  # the DP's model and the replay disagree at the ends: halve the bracket
                share = (low + high) / 2
            plan = blended(share)
            if plan is not None and beats_baselines(plan):  # by replay: the estimator's figures decide
                plan = Outcome(*realise(plan.plan), plan.solution)
                if beats_baselines(plan) or not plan.plan.feasible:
                    break
            if plan is None:
                break
            if plan.plan.recompute_flops > baseline.recompute_flops:
                fast, low = point(plan), share
            else:
                lean, high = point(plan), share

    solutions = {segments: r.solution for segments, r in searched.items()}
    realised = [Outcome(plan, planned, solutions.get(segments)) for segments, (plan, planned) in estimated.items()]
    fitting = [r for r in realised if r.plan.feasible]
    if fitting:
        best = min([r for r in fitting if beats_baselines(r)] or fitting, key=lambda r: (cost(r), r.planned.peak_bytes))
    else:  # the smallest peak the replays reached, as the estimator sees it
        if searched:
            lowest = min(searched.values(), key=lambda r: (r.planned.peak_bytes, cost(r)))
            plan, planned = realise(lowest.plan)
            realised.append(Outcome(plan, planned, lowest.solution))
        best = min(realised, key=lambda r: (r.planned.peak_bytes, cost(r)))
        if best.plan.segments and best.planned.peak_bytes >= unplanned.peak_bytes:  # none got below no plan
            best = Outcome(*realise(replace(best.plan, segments=(), method="none")), None)
    exclusions = tuple((b.path, name, why) for b in blocks for name, why in b.exclusions)
    solved: _Solved | None = best.solution  # None where the plan is a baseline passed in
    solution = None if solved is None else solved.solution
    if solution is not None and solution.feasible and in_time():  # its gap, once: the bound costs two solves
        bounded = solved.problem.solve(budget_bytes, solved.weights, bound=True)
        solve_seconds += bounded.solve_seconds
        solution = replace(solution, optimality_gap=bounded.optimality_gap)
    seconds = best.plan.recompute_seconds
    compat = Solution(
        method=best.plan.method, segments=tuple(s.modules for s in best.plan.segments),
        feasible=best.plan.feasible, modelled_peak_bytes=solution.modelled_peak_bytes if solution else 0,
        recompute_flops=best.plan.recompute_flops, recompute_seconds=seconds, solve_seconds=solve_seconds,
        optimality_gap=solution.optimality_gap if solution else None)
    return SelectiveResult(
        plan=best.plan, unplanned=unplanned, planned=best.planned, candidates=candidates, solution=compat,
        selective=solution, blocks=blocks, exclusions=exclusions, recompute_flops=best.plan.recompute_flops,
        recompute_seconds=seconds, step_seconds=base_seconds, processor=clock.name, objective=objective,
        solve_seconds=solve_seconds, plan_seconds=time.perf_counter() - started, rounds=len(estimated), replays=len(replays.done),
        floor=peak_floor(trace, allocator))


def plan_overhead(
    workload: Workload, config: StepConfig, plan: Plan, device: str, processor: str | TimeModel | None = None,
    cache: EstimateCache | None = None,
) -> tuple[float, float]:
    """(FLOPs %, seconds % on `processor`) of any plan (e.g. the block-level planner's), from the estimator's
    traces, as plan_selective prices them."""
    clock = time_model_for(device, processor, config.precision)
    cache = cache or EstimateCache()
    gpu = gpu_named(device, processor)
    unplanned, trace = cache.estimate(workload, config, device, gpu)
    planned, planned_trace = cache.realise(workload, config, device, plan, gpu)
    extra = recompute_seconds(trace, planned_trace, plan, clock)
    return 100 * (planned.step_flops - unplanned.step_flops) / unplanned.step_flops, 100 * extra / step_seconds(trace, clock)
