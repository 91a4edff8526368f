"""Choose which blocks to checkpoint: the cheapest recomputation whose modelled memory fits a budget.

Pure optimisation over plain numbers; the tracer builds the inputs, and the caller re-estimates the chosen
plan on the real model (the model below is a cost model, not the truth).

The memory model
----------------
A chain is a sequence of blocks in forward order. Each block is either *kept* (it saves its activations for
backward as usual) or *checkpointed*, inside a *segment*: one block, or a run of consecutive blocks of the same
non-empty `group` (siblings that one `checkpoint` call may wrap). A segment keeps only its input and
recomputes everything inside during backward, one segment at a time. The activation memory held at the
backward peak is modelled as

    Σ saved_bytes over kept blocks                     (kept activations)
  + Σ input_bytes of each segment's first block        (checkpoint boundaries)
  + max over segments of Σ saved_bytes inside it       (the segment being recomputed, one at a time)

and the modelled peak is `fixed_bytes` plus that. `saved_bytes` excludes a block's own input: a checkpointed
block's input is counted once, as its segment's input, and a kept block's input is the previous block's
output, taken to be counted in the previous block's `saved_bytes` (the caller's convention). Known gap: when
the previous block is checkpointed its `saved_bytes` drop out, so the input of a kept block right after a
segment is counted nowhere; the caller's closed loop (re-estimate, tighten the budget) absorbs that.

The cost is Σ flops (objective "flops", ties broken by seconds: a LayerNorm costs no FLOPs but is not free
to recompute) or Σ seconds (objective "seconds") over checkpointed blocks, less what each segment's
recomputation does not run (past non-reentrant checkpointing's early stop: a segment ending in a Linear
does not run its matmul again); both totals are reported whichever is minimised. When no selection fits, a solver says so (feasible=False) and returns the selection with the
smallest modelled peak, the cheapest among those.

Nested candidates (a module, its submodules, runs of its children) are a chain too: the blocks are then the
finest units (leaf modules, and what a module computes outside its children), and the problem lists the
allowed segments explicitly as `Span`s, each a range of blocks with the module paths that one `checkpoint`
call wraps, the input it keeps, and what it frees: its blocks' saved bytes less what stays held after it
(its output, which the next op keeps). Chosen segments never overlap, so no checkpoint is nested in another.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import os
import sys
import time
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from memplan.errors import BadInput, MemplanError

OBJECTIVES = ("flops", "seconds")
BRUTE_FORCE_MAX_BLOCKS = 16
# Each of the MILP's HiGHS solves stops at the caller's deadline, but gets at least a second (a solve
# begun at the deadline still has a chance at a selection) and, without a deadline, at most a minute.
MILP_MIN_SOLVE_S = 1.0
MILP_MAX_SOLVE_S = 60.0


@dataclass(frozen=True)
class Block:
    """One candidate unit of a chain, in forward execution order."""

    path: str  # module path, e.g. "transformer.h.3"
    input_bytes: int  # bytes of its input tensor(s): what a checkpoint boundary keeps
    saved_bytes: int  # activation bytes it saves for backward when not checkpointed (its input excluded)
    flops: int  # forward FLOPs = recompute cost in FLOPs
    seconds: float = 0.0  # estimated recompute time on the target GPU (roofline)
    group: str = ""  # consecutive blocks with the same non-empty group may share one segment
    # of those, what a segment ending with this block does not recompute: its ops past the checkpoint's
    # early stop (memplan.trace.Trace.early_stop), such as a last Linear's matmul
    spared_flops: int = 0
    spared_seconds: float = 0.0


@dataclass(frozen=True)
class Span:
    """A segment the solvers may choose: blocks first..last (inclusive), checkpointed by wrapping the modules
    `paths` (one module, or a run of siblings), keeping `input_bytes` as its boundary. `saved_bytes` is what
    checkpointing it frees and its recomputation brings back; None: Σ saved_bytes of its blocks. `calls`:
    how many times per forward its module runs; checkpointed, it is recomputed at every one of them,
    wherever the solver picks it, so its cost counts that many times (calls alike). `spared_*`: what its
    recomputation does not run of its blocks' cost (as Block's)."""

    first: int
    last: int
    input_bytes: int
    paths: tuple[str, ...]
    saved_bytes: int | None = None
    calls: int = 1
    spared_flops: int = 0
    spared_seconds: float = 0.0


@dataclass(frozen=True)
class ChainProblem:
    blocks: tuple[Block, ...]
    fixed_bytes: int  # everything but these blocks' activations at the peak
    budget_bytes: int
    # the allowed segments; None: each block alone, and every run of consecutive blocks of one group
    spans: tuple[Span, ...] | None = None

    def __post_init__(self) -> None:
        _check_paths_and_bytes(self.blocks, self.fixed_bytes, self.budget_bytes)
        closed: set[str] = set()  # groups whose run has ended: seeing one again means it is not consecutive
        for previous, block in zip((None, *self.blocks), self.blocks):
            if previous is not None and previous.group and previous.group != block.group:
                closed.add(previous.group)
            if block.group in closed:
                raise BadInput(f"group {block.group!r} is not consecutive: it resumes at {block.path}")
        seen: set[tuple[int, int]] = set()
        for span in self.spans or ():
            if not 0 <= span.first <= span.last < len(self.blocks) or min(span.input_bytes, span.saved_bytes or 0) < 0 \
                    or not span.paths:
                raise BadInput(f"span {span.paths}: blocks {span.first}..{span.last} or its bytes are out of range")
            if (span.first, span.last) in seen:
                raise BadInput(f"two spans cover blocks {span.first}..{span.last}")
            seen.add((span.first, span.last))

    @functools.cached_property
    def allowed_spans(self) -> tuple[Span, ...]:
        if self.spans is not None:
            return self.spans
        ends = _run_ends(self.blocks)
        return tuple(
            Span(first, last, self.blocks[first].input_bytes, tuple(b.path for b in self.blocks[first : last + 1]),
                 spared_flops=self.blocks[last].spared_flops, spared_seconds=self.blocks[last].spared_seconds)
            for first in range(len(self.blocks))
            for last in range(first, ends[first] + 1)
        )


@dataclass(frozen=True)
class Solution:
    method: str  # "optimal-dp", "milp", "none", "every-block", "sqrt-n", "uniform-k", "brute-force"
    segments: tuple[tuple[str, ...], ...]  # each segment = the block paths it covers
    feasible: bool
    modelled_peak_bytes: int
    recompute_flops: int
    recompute_seconds: float
    solve_seconds: float
    optimality_gap: float | None = None  # 0.0 when proven optimal, None for heuristics


def _check_paths_and_bytes(units: Sequence[Block], fixed_bytes: int, budget_bytes: int) -> None:
    paths = [u.path for u in units]
    if len(set(paths)) != len(paths):
        raise BadInput("duplicate paths among the candidate blocks")
    for unit in units:
        if min(unit.input_bytes, unit.saved_bytes, unit.flops, unit.seconds) < 0:
            raise BadInput(f"{unit.path}: negative bytes, flops or seconds")
    if fixed_bytes < 0 or budget_bytes < 0:
        raise BadInput("fixed_bytes and budget_bytes must be non-negative")


# --------------------------------------------------------------------------------------------------
# The chain model: segments are index spans (first, last), inclusive


def _cost_of(units: Sequence[Block], objective: str) -> Callable[[int, float], float]:
    """The solvers' cost of (flops, seconds) in a chain of `units`."""
    if objective not in OBJECTIVES:
        raise BadInput(f"unknown objective {objective!r}; expected one of: {', '.join(OBJECTIVES)}")
    if objective == "seconds":
        return lambda flops, seconds: seconds
    # FLOPs, in units that keep the total below 2^32, plus the seconds in 2^-20ths of a unit, summing to less
    # than one unit: the seconds only break ties, and every sum is exact in floating point (52 bits), so
    # ties are real ties
    unit = 2 ** max(0, math.ceil(math.log2(sum(u.flops for u in units) + 1)) - 32)
    total_seconds = sum(u.seconds for u in units)
    return lambda flops, seconds: round(flops / unit) + (round(seconds / total_seconds * 2**19) if total_seconds else 0) / 2**20


def _span_costs(problem: ChainProblem, objective: str) -> dict[tuple[int, int], float]:
    """What recomputing each allowed span costs: its blocks' cost, less what its early stop spares, at
    each of its calls."""
    cost = _cost_of(problem.blocks, objective)
    sums = [0.0, *itertools.accumulate(cost(b.flops, b.seconds) for b in problem.blocks)]
    return {(s.first, s.last): max(0.0, sums[s.last + 1] - sums[s.first] - cost(s.spared_flops, s.spared_seconds)) * s.calls
            for s in problem.allowed_spans}


def _run_ends(blocks: Sequence[Block]) -> list[int]:
    """For each block, the last index a segment starting there may reach (itself when it has no group)."""
    ends = list(range(len(blocks)))
    for i in reversed(range(len(blocks) - 1)):
        if blocks[i].group and blocks[i].group == blocks[i + 1].group:
            ends[i] = ends[i + 1]
    return ends


def _activations(saved: Sequence[int], spans: Sequence[Span]) -> int:
    """The model's activation bytes at the peak: kept + segment inputs + the largest segment."""
    inside = [_freed(saved, s) for s in spans]
    return sum(saved) - sum(inside) + sum(s.input_bytes for s in spans) + max(inside, default=0)


def _freed(saved: Sequence[int], span: Span) -> int:
    return sum(saved[span.first : span.last + 1]) if span.saved_bytes is None else span.saved_bytes


def _chain_solution(
    problem: ChainProblem,
    method: str,
    spans: Sequence[tuple[int, int]],
    started: float,
    optimality_gap: float | None = None,
) -> Solution:
    allowed = {(s.first, s.last): s for s in problem.allowed_spans}
    chosen_spans = [allowed[span] for span in sorted(spans)]
    peak = problem.fixed_bytes + _activations([b.saved_bytes for b in problem.blocks], chosen_spans)
    return Solution(
        method=method,
        segments=tuple(s.paths for s in chosen_spans),
        feasible=peak <= problem.budget_bytes,
        modelled_peak_bytes=peak,
        recompute_flops=sum((sum(b.flops for b in problem.blocks[s.first : s.last + 1]) - s.spared_flops) * s.calls
                            for s in chosen_spans),
        recompute_seconds=sum((sum(b.seconds for b in problem.blocks[s.first : s.last + 1]) - s.spared_seconds) * s.calls
                              for s in chosen_spans),
        solve_seconds=time.perf_counter() - started,
        optimality_gap=optimality_gap,
    )


# --------------------------------------------------------------------------------------------------
# Exact dynamic programming for chains


def solve_chain_dp(problem: ChainProblem, objective: str = "flops", deadline: float | None = None) -> Solution:
    """The cheapest selection whose modelled peak fits, proven optimal; or, once past `deadline` (a
    time.perf_counter() reading), the cheapest fitting one the Lagrangian search met, with its relative gap
    to the Lagrangian bound as optimality_gap.

    A forward DP over block boundaries. A partial selection up to boundary k is summarised by
    (cost, mem, x): its cost, its kept + boundary bytes, and its largest segment so far. Its final peak is
    mem + rest + max(x, largest later segment), so one partial selection makes another redundant when it is
    no costlier and has no more mem and no more mem + x; only the non-redundant ones (a 3-D Pareto set) are
    extended. Two exact bounds drop the rest early: a memory bound (what the rest must add at least) and a
    Lagrangian cost bound (what the rest must cost at least to fit) against the cheapest fitting selection
    the Lagrangian search met. Both are vectorised DPs over every threshold for the largest segment.
    """
    started = time.perf_counter()
    costs = _span_costs(problem, objective)
    if not problem.blocks:
        return _chain_solution(problem, "optimal-dp", (), started, optimality_gap=0.0)
    chain = _Chain(problem, costs)
    reach_rest, reach = _bound_table(chain, cost_weight=0.0, mem_weight=1.0)
    # reach[0][0] is the smallest modelled activation peak of any selection: when even that exceeds the
    # headroom, it becomes the limit, and the answer is the cheapest selection reaching it (feasible=False)
    lowest = _selection(chain, reach_rest, reach, cost_weight=0.0, mem_weight=1.0)
    limit = max(problem.budget_bytes - problem.fixed_bytes, chain.activations(lowest))
    price, lower, upper, fitting = _lagrange(chain, limit, lowest)
    togo = _bound_table(chain, 1.0, price)[1]
    # search below a ceiling on the cost, raised until a selection turns up: a low ceiling prunes hard, and
    # any selection found under it is optimal, because nothing cheaper was pruned. The Lagrangian bound is
    # usually within a fraction of a percent of the optimum, the first selection found a little further off.
    try:
        for step in range(_CEILING_STEPS, -1, -1):
            ceiling = upper - (upper - lower) * (1 - 2.0**-step)
            spans = _cheapest_within(chain, reach, limit, price, togo, ceiling, deadline)
            if spans is not None:
                return _chain_solution(problem, "optimal-dp", spans, started, optimality_gap=0.0)
    except _PastDeadline:
        # the search's states grow with the headroom (a nested chain of 300 units: minutes per solve)
        gap = float((upper - lower) / upper) if upper > 0 else 0.0
        return _chain_solution(problem, "optimal-dp", fitting, started, optimality_gap=gap)
    raise AssertionError("unreachable: the last ceiling admits a known fitting selection")


class _PastDeadline(Exception):
    pass


_CEILING_STEPS = 8


@dataclass(frozen=True)
class _Span:
    first: int
    last: int
    input: int  # the input it keeps
    boundary: int  # what the DP adds for it: its input, and what its blocks save that it does not free
    saved: int  # what it frees, and recomputing it rematerialises
    cost: float
    saved_index: int  # position of `saved` among the chain's thresholds


class _Chain:
    """The chain as the DP sees it: per-block numbers, and every segment each block may start or end."""

    def __init__(self, problem: ChainProblem, costs: dict[tuple[int, int], float]) -> None:
        self.saved = [b.saved_bytes for b in problem.blocks]
        saved_sums = [0, *itertools.accumulate(self.saved)]
        spans = problem.allowed_spans
        # thresholds: 0 (no segment) and every distinct segment sum, sorted; a _Span's saved_index points here
        covered = [saved_sums[s.last + 1] - saved_sums[s.first] for s in spans]
        inside = [c if s.saved_bytes is None else s.saved_bytes for s, c in zip(spans, covered)]
        self.thresholds = sorted({0, *inside})
        index = {value: i for i, value in enumerate(self.thresholds)}
        self.segments: list[list[_Span]] = [[] for _ in problem.blocks]  # by first block
        self.ending: list[list[_Span]] = [[] for _ in problem.blocks]  # by last block
        self.by_ends: dict[tuple[int, int], _Span] = {}
        for span, saved, held in zip(spans, inside, covered):
            cost = costs[(span.first, span.last)]
            boundary = span.input_bytes + held - saved
            chain_span = _Span(span.first, span.last, span.input_bytes, boundary, saved, cost, index[saved])
            self.segments[span.first].append(chain_span)
            self.ending[span.last].append(chain_span)
            self.by_ends[(span.first, span.last)] = chain_span

    def activations(self, spans: Sequence[tuple[int, int]]) -> int:
        chosen = [self.by_ends[span] for span in spans]
        inside = [s.saved for s in chosen]
        return sum(self.saved) - sum(inside) + sum(s.input for s in chosen) + max(inside, default=0)

    def cost(self, spans: Sequence[tuple[int, int]]) -> float:
        return sum(self.by_ends[span].cost for span in spans)


def _bound_table(chain: _Chain, cost_weight: float, mem_weight: float) -> tuple[np.ndarray, np.ndarray]:
    """Two tables over (boundary k, threshold t), by a DP vectorised over all thresholds at once:

    rest[k][t]: the least cost_weight * cost + mem_weight * (kept + boundary bytes) of blocks k.. when every
    segment saves at most thresholds[t];
    bound[k][t]: the least of mem_weight * T + rest[k][T] over thresholds T >= thresholds[t] — with a segment of
    thresholds[t] already chosen, the largest segment ends at some such T, so this bounds what blocks k.. add.
    """
    n = len(chain.saved)
    rest = np.zeros((n + 1, len(chain.thresholds)))
    for k in reversed(range(n)):
        best = mem_weight * chain.saved[k] + rest[k + 1]
        for span in chain.segments[k]:
            # the segment is allowed from its own sum upwards: a suffix of the sorted thresholds
            allowed = slice(span.saved_index, None)
            starting = cost_weight * span.cost + mem_weight * span.boundary
            np.minimum(best[allowed], starting + rest[span.last + 1][allowed], out=best[allowed])
        rest[k] = best
    total = mem_weight * np.array(chain.thresholds, dtype=float) + rest
    return rest, np.minimum.accumulate(total[:, ::-1], axis=1)[:, ::-1]


def _selection(
    chain: _Chain, rest: np.ndarray, bound: np.ndarray, cost_weight: float, mem_weight: float
) -> list[tuple[int, int]]:
    """The spans of a selection attaining bound[0][0], followed back through `rest`."""
    t = int(np.argmin(mem_weight * np.array(chain.thresholds, dtype=float) + rest[0]))
    spans, k = [], 0
    while k < len(chain.saved):
        options = [(mem_weight * chain.saved[k] + rest[k + 1][t], None)]
        options += [
            (cost_weight * s.cost + mem_weight * s.boundary + rest[s.last + 1][t], s.last)
            for s in chain.segments[k]
            if s.saved_index <= t
        ]
        _, last = min(options, key=lambda option: option[0])
        if last is None:
            k += 1
        else:
            spans.append((k, last))
            k = last + 1
    return spans


def _lagrange(
    chain: _Chain, limit: int, fitting: list[tuple[int, int]]
) -> tuple[float, float, float, list[tuple[int, int]]]:
    """A price per byte for the Lagrangian cost bound, the bound at that price (a lower bound on the optimum),
    and the cheapest fitting selection met with its cost (an upper bound).

    Minimising cost + price * peak over all selections is the DP of _bound_table; raising the price trades
    cost for memory. The best price lies where the minimisers cross the limit; it is found by intersecting
    the lines cost + price * (peak - limit) of a selection over the limit and one within it (`fitting`, to
    start: the lowest-peak selection), as for any one-constraint Lagrangian dual."""
    over: list[tuple[int, int]] = []  # at price 0 nothing is checkpointed
    if chain.activations(over) <= limit:
        return 0.0, 0.0, 0.0, over
    upper, cheapest = chain.cost(fitting), fitting
    price, lower = 0.0, 0.0
    for _ in range(_LAGRANGE_STEPS):
        over_cost, over_peak = chain.cost(over), chain.activations(over)
        fit_cost, fit_peak = chain.cost(fitting), chain.activations(fitting)
        price = (fit_cost - over_cost) / (over_peak - fit_peak)
        rest, bound = _bound_table(chain, 1.0, price)
        found = _selection(chain, rest, bound, 1.0, price)
        line = over_cost + price * (over_peak - limit)
        lower = max(lower, bound[0][0] - price * limit)
        if lower >= line - 1e-12 * (abs(line) + price * limit):
            break  # no selection lies below both lines: the price is the dual optimum
        if chain.activations(found) <= limit:
            fitting = found
            if chain.cost(found) < upper:
                upper, cheapest = chain.cost(found), found
        else:
            over = found
    return price, min(lower, upper), upper, cheapest


_LAGRANGE_STEPS = 50  # the line intersection converges in far fewer steps; this only guards against float ties


def _cheapest_within(
    chain: _Chain, reach: np.ndarray, limit: int, price: float, togo: np.ndarray, ceiling: float,
    deadline: float | None,
) -> list[tuple[int, int]] | None:
    """The cheapest fitting selection that costs at most `ceiling` (then the lowest peak), or None; raises
    _PastDeadline once past `deadline`.

    Boundary by boundary, the partial selections ending there are gathered from every earlier boundary a
    move reaches it from (keep the previous block, or a segment ending at it), pruned by the bounds and
    reduced to their Pareto set, all in numpy arrays. Each state's chosen spans are a linked trail."""
    n = len(chain.saved)
    thresholds = np.array(chain.thresholds, dtype=np.int64)
    # a partial selection of cost c and memory m at boundary k cannot fit for less than
    # c + price * (m - limit) + togo[k][x]; the slack absorbs float rounding so the optimum is never pruned
    togo = togo - price * limit
    ceiling += 1e-9 * (abs(ceiling) + price * limit)
    no_span = np.full(1, -1)
    frontier = [_Frontier(np.zeros(1), np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.intp), no_span)]
    trail_parent: list[np.ndarray] = []  # node i: the span (trail_first[i], trail_last[i]) after node trail_parent[i]
    trail_first: list[np.ndarray] = []
    trail_last: list[np.ndarray] = []
    nodes = 0
    for after in range(1, n + 1):
        if deadline is not None and time.perf_counter() > deadline:
            raise _PastDeadline
        last = after - 1
        before = frontier[last]
        moves = [(before.cost, before.mem + chain.saved[last], before.x, before.node, np.full(len(before.x), -1))]
        for span in chain.ending[last]:
            source = frontier[span.first]
            moves.append(
                (
                    source.cost + span.cost,
                    source.mem + span.boundary,
                    np.maximum(source.x, span.saved_index),
                    source.node,
                    np.full(len(source.x), span.first),
                )
            )
        cost, mem, x, parent, span_first = (np.concatenate(column) for column in zip(*moves))
        fits = (mem + reach[after][x] <= limit) & (cost + price * mem + togo[after][x] <= ceiling)
        if after == n:
            # at the end reach is the largest segment itself, so every state left fits; one with memory to
            # spare may still cost more than the ceiling (the bound only says it costs no less)
            fits &= cost <= ceiling
        keep = np.flatnonzero(fits)
        keep = keep[_pareto(cost[keep], mem[keep], mem[keep] + thresholds[x[keep]])]
        # states that just closed a segment get a new trail node; the others carry their parent's
        new = span_first[keep] >= 0
        node = parent[keep].copy()
        node[new] = nodes + np.arange(np.count_nonzero(new))
        nodes += np.count_nonzero(new)
        trail_parent.append(parent[keep][new])
        trail_first.append(span_first[keep][new])
        trail_last.append(np.full(np.count_nonzero(new), last))
        frontier.append(_Frontier(cost[keep], mem[keep], x[keep], node))
    final = frontier[n]
    if not len(final.cost):
        return None
    best = np.lexsort((final.mem + thresholds[final.x], final.cost))[0]  # the cheapest, then the lowest peak
    parents, firsts, lasts = (np.concatenate(chunks).tolist() for chunks in (trail_parent, trail_first, trail_last))
    spans, node = [], int(final.node[best])
    while node >= 0:
        spans.append((firsts[node], lasts[node]))
        node = parents[node]
    return spans


@dataclass(frozen=True)
class _Frontier:
    """The partial selections kept at one boundary, as parallel arrays."""

    cost: np.ndarray
    mem: np.ndarray  # kept + boundary bytes so far
    x: np.ndarray  # index of the largest segment's sum among the thresholds
    node: np.ndarray  # the trail node of the last span chosen, -1 for none


def _pareto(cost: np.ndarray, mem: np.ndarray, peak: np.ndarray) -> list[int]:
    """Indices of the states no other state beats on cost, mem and peak (mem + largest segment) all at once.

    Sorted by cost, a state is redundant when an earlier one has mem' <= mem and peak' <= peak; the earlier
    ones are kept as a staircase (mem ascending, peak descending) so that test is one bisection."""
    kept = []
    stair_mem: list[int] = []
    stair_peak: list[int] = []
    order = np.lexsort((peak, mem, cost))
    for i, m, p in zip(order.tolist(), mem[order].tolist(), peak[order].tolist()):
        below = bisect_right(stair_mem, m)
        if below and stair_peak[below - 1] <= p:
            continue
        # the new point replaces the staircase points it covers: same or larger mem, same or larger peak
        start = bisect_left(stair_mem, m)
        end = start
        while end < len(stair_mem) and stair_peak[end] >= p:
            end += 1
        stair_mem[start:end] = [m]
        stair_peak[start:end] = [p]
        kept.append(i)
    return kept


# --------------------------------------------------------------------------------------------------
# Mixed-integer linear programming (HiGHS through scipy): a cross-check of the DP on the same model


@dataclass(frozen=True)
class _Item:
    """One choosable segment."""

    input_bytes: int
    saved_bytes: int  # Σ saved inside: leaves the kept activations when chosen, comes back while recomputed
    cost: float
    atoms: tuple[int, ...]  # the blocks it covers; chosen items must not share any


def solve_milp(problem: ChainProblem, objective: str = "flops", deadline: float | None = None) -> Solution:
    """The cheapest fitting selection by MILP; optimality_gap is HiGHS's relative gap (0.0: proven optimal,
    more when it stopped at its time limit with the best selection found; None when it stopped with none,
    and the selection is empty, or the lowest-peak one when nothing fits). Each HiGHS solve stops at
    `deadline` (a time.perf_counter() reading), within MILP_MIN_SOLVE_S and MILP_MAX_SOLVE_S.

    Binary z_s per item, continuous X for the segment being recomputed at the peak:
        min Σ cost_s z_s
        s.t. Σ_{s covers a} z_s <= 1                                  for each atom a (no overlap)
             base + Σ (input_s - saved_s) z_s + X <= budget - fixed   (the memory model)
             X >= Σ_{s covers a} saved_s z_s                          for each atom a (X is the max term)
    When that is infeasible: first minimise the activation peak, then the cost at that peak."""
    try:
        from scipy.optimize import Bounds, LinearConstraint, milp
        from scipy.sparse import coo_array
    except ImportError:
        raise BadInput("the MILP solver needs scipy: pip install scipy") from None
    started = time.perf_counter()
    spans, items, base = _chain_items(problem, _span_costs(problem, objective))
    if not items:
        return _chain_solution(problem, "milp", [], started, 0.0)
    m = len(items)
    # bytes in power-of-two units (exact in floating point) that keep coefficients below 2^20 for HiGHS;
    # costs scaled up only, so that HiGHS's absolute gap (1e-6) stays far below any real cost difference
    largest = max(max(i.input_bytes, i.saved_bytes) for i in items)
    unit = 2.0 ** max(0, math.ceil(math.log2(max(largest, 1))) - 20)
    largest_cost = max(i.cost for i in items)
    cost_scale = 2.0 ** max(0, 20 - math.ceil(math.log2(largest_cost))) if largest_cost > 0 else 1.0

    delta = np.array([(i.input_bytes - i.saved_bytes) / unit for i in items] + [1.0])  # memory row, X last
    n_atoms = 1 + max(a for i in items for a in i.atoms)
    rows, cols = (np.array(column) for column in zip(*((a, s) for s, item in enumerate(items) for a in item.atoms)))
    covering = coo_array((np.ones(len(rows)), (rows, cols)), shape=(n_atoms, m + 1)).tocsr()
    no_overlap = LinearConstraint(covering, -np.inf, 1)
    # X >= Σ saved_s z_s over the items covering one atom: at most one of them is chosen, so this is
    # X >= saved of the chosen one, the max term; and summed per atom it is tighter for the LP relaxation
    # than one row per item
    saved_at = coo_array(
        (
            np.r_[[items[s].saved_bytes / unit for s in cols], -np.ones(n_atoms)],
            (np.r_[rows, np.arange(n_atoms)], np.r_[cols, np.full(n_atoms, m)]),
        ),
        shape=(n_atoms, m + 1),
    )
    max_term = LinearConstraint(saved_at, -np.inf, 0)
    integrality = np.r_[np.ones(m), 0]
    bounds = Bounds(0, np.r_[np.ones(m), np.inf])

    def solve(objective_row: np.ndarray, delta_limit_bytes: float | None):
        constraints = [no_overlap, max_term]
        if delta_limit_bytes is not None:
            # + half a byte: byte counts are integers, so this admits exactly the selections that fit
            constraints.append(LinearConstraint(delta, -np.inf, (delta_limit_bytes + 0.5) / unit))
        left = MILP_MAX_SOLVE_S if deadline is None else deadline - time.perf_counter()
        options = {"mip_rel_gap": 0.0, "time_limit": min(MILP_MAX_SOLVE_S, max(MILP_MIN_SOLVE_S, left))}
        with highs_stdout_to_stderr():
            result = milp(
                objective_row, integrality=integrality, bounds=bounds, constraints=constraints, options=options
            )
        if result.x is None and result.status not in (1, 2):  # 1: time limit; 2: infeasible
            raise MemplanError(f"the MILP solver stopped without a solution: {result.message}")
        chosen = [] if result.x is None else [s for s in range(m) if result.x[s] > 0.5]
        return result, chosen

    def gap(result) -> float | None:
        return None if result.x is None else getattr(result, "mip_gap", None)

    cost_row = np.r_[[i.cost * cost_scale for i in items], 0.0]
    result, chosen = solve(cost_row, problem.budget_bytes - problem.fixed_bytes - base)
    if result.status == 2:  # nothing fits: the lowest reachable peak, then the cheapest selection at it
        _, lowest = solve(delta, None)
        reached = sum(items[s].input_bytes - items[s].saved_bytes for s in lowest)
        reached += max((items[s].saved_bytes for s in lowest), default=0)
        result, chosen = solve(cost_row, reached)
        if result.x is None:  # out of time: the lowest selection found, unpriced
            return _chain_solution(problem, "milp", [spans[s] for s in lowest], started, None)
    return _chain_solution(problem, "milp", [spans[s] for s in chosen], started, gap(result))


@contextlib.contextmanager
def highs_stdout_to_stderr() -> Iterator[None]:
    """HiGHS 1.12 (in scipy 1.17) now and then prints a stray debug line on the process's stdout
    (ERGO-Code/HiGHS#2783); send it to stderr, so that stdout stays clean for the CLI's output."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def _chain_items(problem: ChainProblem, costs: dict[tuple[int, int], float]) -> tuple[list[tuple[int, int]], list[_Item], int]:
    spans, items = [], []
    for span in _Chain(problem, costs).by_ends.values():
        spans.append((span.first, span.last))
        items.append(_Item(span.input, span.saved, span.cost, tuple(range(span.first, span.last + 1))))
    return spans, items, sum(b.saved_bytes for b in problem.blocks)


# --------------------------------------------------------------------------------------------------
# Baselines, judged by the same model


def no_checkpoint(problem: ChainProblem, objective: str = "flops", deadline: float | None = None) -> Solution:
    return _chain_solution(problem, "none", [], time.perf_counter())


def every_block(problem: ChainProblem, objective: str = "flops", deadline: float | None = None) -> Solution:
    started = time.perf_counter()
    _require_groups(problem, "every-block")
    return _chain_solution(problem, "every-block", [(i, i) for i in range(len(problem.blocks))], started)


def sqrt_n(problem: ChainProblem, objective: str = "flops", deadline: float | None = None) -> Solution:
    """Chen et al. 2016 ("Training deep nets with sublinear memory cost"): segments of about √n consecutive
    blocks, all checkpointed; a segment that would cross a group boundary is split there."""
    started = time.perf_counter()
    _require_groups(problem, "sqrt-n")
    n = len(problem.blocks)
    length = max(1, round(math.sqrt(n)))
    pieces = [(first, min(first + length, n) - 1) for first in range(0, n, length)]
    return _chain_solution(problem, "sqrt-n", _split_at_groups(problem, pieces), started)


def uniform_k(
    problem: ChainProblem, k: int | None = None, objective: str = "flops", deadline: float | None = None
) -> Solution:
    """What torch.utils.checkpoint.checkpoint_sequential(blocks, k) does: k segments of n // k blocks, the first
    k - 1 checkpointed and the last (with the remainder) run normally; split at group boundaries.
    k defaults to about √n."""
    started = time.perf_counter()
    _require_groups(problem, "uniform-k")
    if k is None:
        k = max(1, round(math.sqrt(len(problem.blocks))))
    if k < 1:
        raise BadInput(f"uniform-k needs k >= 1, got {k}")
    size = len(problem.blocks) // k
    pieces = [(first, first + size - 1) for first in range(0, size * (k - 1), size)] if size else []
    return _chain_solution(problem, "uniform-k", _split_at_groups(problem, pieces), started)


def _require_groups(problem: ChainProblem, method: str) -> None:
    """The baselines checkpoint whole blocks of one chain, as their users do; they take no explicit spans."""
    if problem.spans is not None:
        raise BadInput(f"{method} takes a chain of blocks (groups), not explicit spans")


def _split_at_groups(problem: ChainProblem, pieces: list[tuple[int, int]]) -> list[tuple[int, int]]:
    ends = _run_ends(problem.blocks)
    spans = []
    for first, last in pieces:
        while first <= last:
            spans.append((first, min(last, ends[first])))
            first = spans[-1][1] + 1
    return spans


# --------------------------------------------------------------------------------------------------
# Brute force, the tests' reference


def brute_force(problem: ChainProblem, objective: str = "flops", deadline: float | None = None) -> Solution:
    """Every selection, depth first: at each block, keep it or start any allowed segment there.
    Memory, largest segment and cost are carried along, so each selection costs O(1) beyond its parent."""
    started = time.perf_counter()
    blocks = problem.blocks
    n = len(blocks)
    if n > BRUTE_FORCE_MAX_BLOCKS:
        raise BadInput(f"brute force takes at most {BRUTE_FORCE_MAX_BLOCKS} blocks, got {n}")
    costs = _span_costs(problem, objective)
    starting: list[list[Span]] = [[] for _ in blocks]
    for span in problem.allowed_spans:
        starting[span.first].append(span)
    headroom = problem.budget_bytes - problem.fixed_bytes
    # fitting selections rank first, by (cost, peak); the others by (peak, cost)
    best_rank: tuple = (2,)
    best_spans: tuple = ()

    def visit(k: int, mem: int, largest: int, cost: float, spans: tuple) -> None:
        nonlocal best_rank, best_spans
        if k == n:
            peak = mem + largest
            rank = (0, cost, peak) if peak <= headroom else (1, peak, cost)
            if rank < best_rank:
                best_rank, best_spans = rank, spans
            return
        visit(k + 1, mem + blocks[k].saved_bytes, largest, cost, spans)
        for span in starting[k]:
            saved = _freed([b.saved_bytes for b in blocks], span)
            held = sum(b.saved_bytes for b in blocks[span.first : span.last + 1]) - saved  # saved inside, not freed
            extra = costs[(span.first, span.last)]
            visit(span.last + 1, mem + span.input_bytes + held, max(largest, saved), cost + extra, (*spans, (k, span.last)))

    visit(0, 0, 0, 0.0, ())
    return _chain_solution(problem, "brute-force", best_spans, started, optimality_gap=0.0)


# Every solver takes (problem, objective, deadline). Only the searches (optimal-dp, milp) need the deadline:
# the baselines are instant, and brute force, the tests' oracle, takes at most BRUTE_FORCE_MAX_BLOCKS.
SOLVERS: dict[str, Callable[..., Solution]] = {
    "optimal-dp": solve_chain_dp,
    "milp": solve_milp,
    "none": no_checkpoint,
    "every-block": every_block,
    "sqrt-n": sqrt_n,
    "uniform-k": uniform_k,
    "brute-force": brute_force,
}
