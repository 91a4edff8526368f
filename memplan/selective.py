"""Selective recompute: per checkpointed block, choose which aten ops' outputs to keep.

    trace -> candidate blocks -> per block, the aten ops whose outputs it allocates (bytes, FLOPs,
    roofline seconds) -> a small family of save policies per block -> an exact chain DP (multiple-choice
    knapsack with the transient of recomputing one segment at a time) -> Plan with "selective" segments
    -> re-estimate the planned model under fake tensors (closed loop) -> tighten and solve again.

Semantics this models (torch.utils.checkpoint.create_selective_checkpoint_contexts): inside a selective
segment, every call of a saved op keeps its outputs from forward until the segment's backward, whether
or not autograd needs them; the segment's input is kept; everything else is recomputed in backward. So
saving "aten.addmm.default" keeps the outputs of *all* addmm calls of the block (also the ones autograd
would not save), and recomputation costs the ops that are not saved.

The memory model, per block j and policy P (bytes rounded as the device allocates them):

    contrib_j   bytes held from block j's forward until its backward: for a kept block, the activations it
                allocates and its outputs; for a checkpointed one, the cached outputs of P and its outputs
                (the next block's input, or what follows the chain; the block's own input is the previous
                block's output, counted there, or in `fixed` for the first block)
    transient_j activations the block's recomputation recreates (its activations not already held)

    peak = fixed + max( Σ_j contrib_j ,  max_j ( Σ_{i<=j} contrib_i + transient_j ) )

since by the time segment j is recomputed in backward, blocks after j have released theirs. A run of
consecutive blocks of one container may also be one fully recomputed segment (as the block-level planner
does), so every block-level plan is in this search space. `fixed` is the unplanned peak minus Σ contrib
of all-kept blocks; the estimator's re-run on the planned model is the reported truth.

Cached tensors mutated in place are excluded at plan time: an op whose output storage is later read by
an in-place op (name ending in "_", no allocation) in the same forward is never saved.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from memplan.devices import device_model
from memplan.emit import apply_plan
from memplan.errors import BadInput
from memplan.estimate import Estimate, estimate_and_trace
from memplan.gpus import GpuSpec, gpu_spec, roofline_seconds
from memplan.plan import Plan, Segment
from memplan.planner import Candidates, candidate_blocks
from memplan.solvers import Solution
from memplan.step import StepConfig
from memplan.trace import ModuleCall, Op, Trace
from memplan.workload import Workload

OBJECTIVES = ("seconds", "flops")
CLOSED_LOOP_ROUNDS = 8
BISECTION_ROUNDS = 3

MATMUL_OPS = frozenset({
    "mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "matmul", "linear", "convolution", "_convolution",
    "mkldnn_convolution", "cudnn_convolution", "_int_mm", "addbmm",
})
ATTENTION_MARKERS = ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention")


def op_category(name: str) -> str:
    """"matmul", "attention" or "pointwise" (everything else: pointwise, norms, dropout, casts, copies)."""
    parts = name.split(".")
    base = parts[1] if len(parts) == 3 else name
    if base in MATMUL_OPS:
        return "matmul"
    if any(marker in base for marker in ATTENTION_MARKERS):
        return "attention"
    return "pointwise"


def is_inplace(op: Op) -> bool:
    parts = op.name.split(".")
    return len(parts) == 3 and parts[0] == "aten" and parts[1].endswith("_") and not parts[1].startswith("_") \
        and not op.allocates


def op_seconds(op: Op, trace: Trace, gpu: GpuSpec, precision: str) -> float:
    """Roofline time of one op: FLOPs at peak, bytes moved ≈ 2 x its output bytes (an in-place op: the
    storage it writes, taken as the largest it reads)."""
    out = sum(trace.storages[s].nbytes for s in op.allocates)
    if not op.allocates and is_inplace(op) and op.reads:
        out = max(trace.storages[s].nbytes for s in op.reads)
    return roofline_seconds(op.flops, 2 * out, gpu, precision)


def step_seconds(trace: Trace, gpu: GpuSpec, precision: str, step: int = 0) -> float:
    return sum(op_seconds(op, trace, gpu, precision) for op in trace.ops if op.step == step)


def step_flops(trace: Trace, step: int = 0) -> int:
    return sum(op.flops for op in trace.ops if op.step == step)


# --------------------------------------------------------------------------------------------------
# What each block's ops allocate


@dataclass(frozen=True)
class OpGroup:
    """All calls of one aten op inside one block's forward."""

    name: str  # "aten.addmm.default"
    category: str  # matmul, attention, pointwise
    calls: int
    cache_bytes: int  # what saving it keeps: every output of every call
    needed_bytes: int  # of those, the bytes autograd saves anyway (role "activations")
    flops: int  # recompute FLOPs when not saved
    seconds: float  # roofline recompute time when not saved
    excluded: str = ""  # why it may not be saved ("" = it may)


@dataclass(frozen=True)
class Policy:
    """One way to treat a block: kept, fully recomputed, or recomputed but for `saved_ops`."""

    name: str  # "keep", "full", "matmul", "matmul+attention", "greedy-3", ...
    saved_ops: tuple[str, ...]
    contrib_bytes: int
    transient_bytes: int
    flops: int
    seconds: float
    checkpointed: bool = True


@dataclass(frozen=True)
class BlockProfile:
    path: str
    group: str
    ops: tuple[OpGroup, ...]
    policies: tuple[Policy, ...]
    activation_bytes: int  # Σ activations it allocates (+ its outputs): what keeping it costs
    output_bytes: int
    flops: int
    seconds: float

    @property
    def exclusions(self) -> tuple[tuple[str, str], ...]:
        return tuple((g.name, g.excluded) for g in self.ops if g.excluded)


def _first_forward_call(trace: Trace, path: str) -> ModuleCall:
    return min((c for c in trace.calls if c.phase == "forward" and c.step == 0 and c.path == path),
               key=lambda c: c.first_op)


def _forward_end(trace: Trace, start: int) -> int:
    """The index after the last op of the forward phase that op `start` belongs to."""
    end = start
    while end < len(trace.ops) and trace.ops[end].phase == "forward" and trace.ops[end].step == trace.ops[start].step:
        end += 1
    return end


def profile_block(trace: Trace, path: str, group: str, block_bytes: Callable[[int], int], gpu: GpuSpec,
                  precision: str, greedy: int = 6, exhaustive: int = 16) -> BlockProfile:
    call = _first_forward_call(trace, path)
    ops = trace.ops[call.first_op : call.end_op]
    allocated = {s for op in ops for s in op.allocates}
    activations = {s for s in allocated if trace.storages[s].role == "activations"}
    outputs = {s for s in call.outputs if s in allocated}
    forward_end = _forward_end(trace, call.first_op)

    def bb(storages: set[int]) -> int:
        return sum(block_bytes(trace.storages[s].nbytes) for s in storages)

    # in-place writers after each storage's allocation, to the end of this forward
    mutated: dict[int, str] = {}
    for op in trace.ops[call.first_op : forward_end]:
        if is_inplace(op):
            for s in op.reads:
                if s in allocated and s not in mutated and trace.storages[s].allocated_by < op.index:
                    mutated[s] = op.name

    seconds = {op.index: op_seconds(op, trace, gpu, precision) for op in ops}
    by_name: dict[str, list[Op]] = {}
    for op in ops:
        if op.allocates and not op.name.startswith("prim."):
            by_name.setdefault(op.name, []).append(op)
    groups = []
    for name, calls in by_name.items():
        storages = {s for op in calls for s in op.allocates}
        written = sorted({mutated[s] for s in storages if s in mutated})
        excluded = f"its output is mutated in place by {', '.join(written)} later in the forward" if written else ""
        groups.append(OpGroup(
            name=name, category=op_category(name), calls=len(calls), cache_bytes=bb(storages),
            needed_bytes=bb(storages & activations), flops=sum(op.flops for op in calls),
            seconds=sum(seconds[op.index] for op in calls), excluded=excluded,
        ))
    total_flops = sum(op.flops for op in ops)
    total_seconds = sum(seconds.values())
    keep_bytes = bb(activations | outputs)

    def policy(name: str, saved: Sequence[str]) -> Policy:
        saved_set = set(saved)
        cached = {s for op in ops if op.name in saved_set for s in op.allocates}
        held = cached | outputs
        return Policy(
            name=name,
            saved_ops=tuple(sorted(saved_set)),
            contrib_bytes=bb(held),
            transient_bytes=bb(activations - held),
            flops=sum(op.flops for op in ops if op.name not in saved_set),
            seconds=sum(s for i, s in seconds.items() if trace.ops[i].name not in saved_set),
        )

    eligible = [g for g in groups if not g.excluded]
    families: list[tuple[str, list[str]]] = [("full", [])]
    matmul = [g.name for g in eligible if g.category == "matmul"]
    attention = [g.name for g in eligible if g.category == "attention"]
    compute = [g.name for g in eligible if g.category != "pointwise" or g.flops > 0]
    families += [("matmul", matmul), ("matmul+attention", matmul + attention), ("all-but-pointwise", compute),
                 ("all-eligible", [g.name for g in eligible])]
    # nested prefixes of the ops ranked by recompute time saved per byte kept
    ranked = sorted((g for g in eligible if g.seconds > 0 or g.flops > 0),
                    key=lambda g: -(g.seconds + 1e-18 * g.flops) / max(1, g.cache_bytes - g.needed_bytes / 2))
    for k in range(1, min(greedy, len(ranked)) + 1):
        families.append((f"greedy-{k}", [g.name for g in ranked[:k]]))
    # every subset of the ops worth saving, when there are few: the Pareto-optimal ones join the family
    worth = [g.name for g in ranked if g.seconds >= 0.01 * total_seconds or g.flops >= 0.01 * max(1, total_flops)]
    if len(worth) <= exhaustive:
        terms = {}
        for g in eligible:
            mine = {s for op in ops if op.name == g.name for s in op.allocates}
            terms[g.name] = (bb(mine - outputs), bb((mine & activations) - outputs),
                             g.flops, g.seconds)
        families += _pareto_subsets(worth, terms, (bb(outputs), bb(activations - outputs), total_flops, total_seconds))
    policies = [Policy("keep", (), keep_bytes, 0, 0, 0.0, checkpointed=False)]
    seen: set[tuple[str, ...]] = set()
    for name, saved in families:
        candidate = policy(name, saved)
        if candidate.saved_ops in seen:
            continue
        seen.add(candidate.saved_ops)
        policies.append(candidate)
    return BlockProfile(path, group, tuple(groups), tuple(policies), keep_bytes, bb(outputs), total_flops,
                        total_seconds)


def _pareto_subsets(names: Sequence[str], terms: dict[str, tuple[int, int, int, float]],
                    base: tuple[int, int, int, float], grid: int = 10) -> list[tuple[str, list[str]]]:
    """The subsets of `names` whose policy no other subset beats in held bytes, transient bytes and both
    costs (the only ones the chain DP could pick). Each op adds its own terms (storages belong to the op
    that allocates them): terms[name] = (held added, transient removed, FLOPs saved, seconds saved)."""
    k = len(names)
    masks = np.arange(1, 1 << k, dtype=np.int64)
    bits = ((masks[:, None] >> np.arange(k)) & 1).astype(np.float64)
    t = np.array([terms[n] for n in names], dtype=np.float64)
    held = base[0] + bits @ t[:, 0]
    transient = base[1] - bits @ t[:, 1]
    flops = base[2] - bits @ t[:, 2]
    seconds = base[3] - bits @ t[:, 3]
    order = np.lexsort((transient, held, flops, seconds))
    kept: list[int] = []
    kh, kt, kf = np.empty(0), np.empty(0), np.empty(0)
    # epsilon-dominance on bytes (1/grid of the largest held): near-equal policies collapse into the
    # cheapest, which keeps the family small; the DP still sees each kept policy's exact figures
    step = max(1.0, float(held.max()) / grid)
    qh, qt = np.ceil(held / step), np.ceil(transient / step)
    for i in order:
        if np.any((kh <= qh[i]) & (kt <= qt[i]) & (kf <= flops[i])):
            continue  # sorted by seconds: an earlier kept one is no slower
        kept.append(i)
        kh, kt, kf = np.append(kh, qh[i]), np.append(kt, qt[i]), np.append(kf, flops[i])
    return [(f"pareto-{j}", [n for b, n in enumerate(names) if masks[i] >> b & 1]) for j, i in enumerate(kept)]


# --------------------------------------------------------------------------------------------------
# The solver: an exact DP over the chain, Pareto-pruned


@dataclass(frozen=True)
class Choice:
    """One segment of the solution: blocks [first, last] with a policy (runs are always "full")."""

    first: int
    last: int
    policy: Policy


@dataclass(frozen=True)
class SelectiveSolution:
    choices: tuple[Choice, ...]  # only checkpointed segments
    feasible: bool
    modelled_peak_bytes: int
    recompute_flops: int
    recompute_seconds: float
    solve_seconds: float
    states_explored: int
    optimality_gap: float = 0.0  # exact DP


def _options(blocks: Sequence[BlockProfile]) -> list[list[tuple[int, Policy]]]:
    """For each start index, (end index exclusive, policy) options: one block with any policy, or a run
    of 2+ consecutive blocks of one group, fully recomputed."""
    options: list[list[tuple[int, Policy]]] = []
    for i, block in enumerate(blocks):
        here = [(i + 1, p) for p in block.policies]
        j = i + 1
        while block.group and j < len(blocks) and blocks[j].group == block.group:
            run = blocks[i : j + 1]
            everything = sum(b.activation_bytes for b in run)
            here.append((j + 1, Policy(
                f"full-run-{len(run)}", (), run[-1].output_bytes, everything - run[-1].output_bytes,
                sum(b.flops for b in run), sum(b.seconds for b in run))))
            j += 1
        options.append(here)
    return options


def solve_selective_chain(blocks: Sequence[BlockProfile], fixed_bytes: int, budget_bytes: int,
                          objective: str = "seconds") -> SelectiveSolution:
    """The cheapest policy per block (and fully recomputed runs) whose modelled peak fits; exact.

    States after each block boundary are (cost, held, peak-term): Σ contrib so far, and the largest
    Σ_{i<=j} contrib_i + transient_j so far. A state is dropped when another is no worse in all three
    (the future adds the same to each), or when it already exceeds the room left. When nothing fits, the
    smallest modelled peak is returned (feasible=False)."""
    if objective not in OBJECTIVES:
        raise BadInput(f"unknown objective {objective!r}; expected one of: {', '.join(OBJECTIVES)}")
    started = time.perf_counter()
    room = budget_bytes - fixed_bytes
    options = _options(blocks)
    n = len(blocks)

    def cost_of(p: Policy) -> float:
        return p.seconds if objective == "seconds" else float(p.flops)

    # state: (cost, held, peak, other_cost, back) with back = (previous state, start index, policy)
    frontier: list[list[tuple]] = [[] for _ in range(n + 1)]
    frontier[0] = [(0.0, 0, 0, 0.0, None)]
    explored = 0
    # fallback when nothing fits: track the smallest peak, with pruning disabled on room
    for relax in (False, True):
        frontier = [[] for _ in range(n + 1)]
        frontier[0] = [(0.0, 0, 0, 0.0, None)]
        for i in range(n):
            if not frontier[i]:
                continue
            frontier[i] = _pareto(frontier[i], by_peak=relax)
            for state in frontier[i]:
                cost, held, peak, other, _ = state
                for end, policy in options[i]:
                    new_held = held + policy.contrib_bytes
                    new_peak = max(peak, new_held + policy.transient_bytes)
                    explored += 1
                    if not relax and max(new_held, new_peak) > room:
                        continue
                    other_cost = float(policy.flops) if objective == "seconds" else policy.seconds
                    frontier[end].append((cost + cost_of(policy), new_held, new_peak, other + other_cost,
                                          (state, i, policy)))
        finals = frontier[n]
        if finals:
            break
    if not relax:
        best = min(finals, key=lambda s: (s[0], max(s[1], s[2])))
    else:
        best = min(finals, key=lambda s: (max(s[1], s[2]), s[0]))
    choices = []
    state = best
    while state[4] is not None:
        previous, start, policy = state[4]
        end = next(e for e, p in options[start] if p is policy)
        if policy.checkpointed:
            choices.append(Choice(start, end - 1, policy))
        state = previous
    choices.reverse()
    peak = fixed_bytes + max(best[1], best[2])
    flops = sum(c.policy.flops for c in choices)
    seconds = sum(c.policy.seconds for c in choices)
    return SelectiveSolution(tuple(choices), peak <= budget_bytes, peak, flops, seconds,
                             time.perf_counter() - started, explored, 0.0 if not relax else float("nan"))


def _pareto(states: list[tuple], by_peak: bool = False) -> list[tuple]:
    """Drop states another is no worse than in cost, held and peak."""
    if by_peak:  # fallback mode: minimise the peak first, cost second
        states.sort(key=lambda s: (max(s[1], s[2]), s[0]))
    else:
        states.sort(key=lambda s: (s[0], s[1], s[2]))
    kept: list[tuple] = []
    for s in states:
        if not any(k[0] <= s[0] and k[1] <= s[1] and k[2] <= s[2] for k in kept):
            kept.append(s)
    return kept


# --------------------------------------------------------------------------------------------------
# Closed loop


@dataclass(frozen=True)
class SelectiveResult:
    """As memplan.planner.PlanResult (plan, unplanned, planned, candidates, solution), plus the per-block
    policies and op exclusions, and the recompute overhead in FLOPs and roofline seconds."""

    plan: Plan
    unplanned: Estimate
    planned: Estimate
    candidates: Candidates
    solution: Solution
    selective: SelectiveSolution
    blocks: tuple[BlockProfile, ...]
    exclusions: tuple[tuple[str, str, str], ...]  # (block, op, why it is never saved)
    recompute_flops: int  # the estimator's: planned step FLOPs - unplanned step FLOPs
    recompute_seconds: float  # roofline, planned trace - unplanned trace
    step_seconds: float  # roofline seconds of the unplanned step
    gpu: str
    objective: str
    solve_seconds: float  # all DP solves together
    plan_seconds: float  # everything, estimator runs included
    rounds: int
    baselines: tuple = ()

    @property
    def flops_overhead_pct(self) -> float:
        return 100 * self.recompute_flops / self.plan.step_flops if self.plan.step_flops else 0.0

    @property
    def seconds_overhead_pct(self) -> float:
        return 100 * self.recompute_seconds / self.step_seconds if self.step_seconds else 0.0


@dataclass
class EstimateCache:
    """Estimates of one workload, unplanned and per plan, kept by whoever plans several budgets (the
    closed loop re-estimates the same plans); each plan_selective call makes its own by default."""

    unplanned: dict[tuple, tuple[Estimate, Trace]] = field(default_factory=dict)
    planned: dict[tuple, tuple[Estimate, Trace]] = field(default_factory=dict)

    @staticmethod
    def _key(workload: Workload, config: StepConfig, device: str) -> tuple:
        return (workload.spec, workload.factory, workload.batch_size, tuple(sorted(workload.options.items())),
                config, device)

    def estimate(self, workload: Workload, config: StepConfig, device: str) -> tuple[Estimate, Trace]:
        key = self._key(workload, config, device)
        if key not in self.unplanned:
            self.unplanned[key] = estimate_and_trace(workload, config, device)
        return self.unplanned[key]

    def realise(self, workload: Workload, config: StepConfig, device: str, plan: Plan) -> tuple[Estimate, Trace]:
        """The estimator on the model with `plan` applied."""
        if not plan.segments:
            return self.estimate(workload, config, device)
        key = (*self._key(workload, config, device), plan.segments)
        if key not in self.planned:
            self.planned[key] = estimate_and_trace(workload, config, device, transform=lambda m: apply_plan(m, plan))
        return self.planned[key]


def _segments(blocks: Sequence[BlockProfile], solution: SelectiveSolution) -> tuple[Segment, ...]:
    segments = []
    for choice in solution.choices:
        paths = tuple(b.path for b in blocks[choice.first : choice.last + 1])
        policy = choice.policy
        segments.append(Segment(
            paths, policy="selective" if policy.saved_ops else "full", saved_ops=policy.saved_ops,
            activation_bytes=policy.contrib_bytes, recompute_flops=policy.flops))
    return tuple(segments)


def profile_blocks(trace: Trace, device: str, gpu: str, precision: str) -> tuple[Candidates, tuple[BlockProfile, ...]]:
    block_bytes = device_model(device).block_bytes
    candidates = candidate_blocks(trace, block_bytes)
    spec = gpu_spec(gpu)
    unique = list({b.path: b for b in candidates.blocks}.values())  # a path listed twice is one block
    profiles = tuple(profile_block(trace, b.path, b.group, block_bytes, spec, precision) for b in unique)
    return candidates, profiles


def plan_selective(
    workload: Workload,
    config: StepConfig,
    budget_bytes: int,
    device: str = "cuda",
    objective: str = "seconds",
    gpu: str = "h100",
    headroom: float = 0.005,
    cache: EstimateCache | None = None,
) -> SelectiveResult:
    """The cheapest selective-recompute plan (by `objective`, "seconds" on `gpu` or "flops") whose
    re-estimated peak fits `budget_bytes`; feasible=False with the smallest peak reached when none fits.
    `headroom`: the plan must fit budget x (1 - headroom) by the estimator, a margin for its error against
    the real allocator (a few KiB on the CPU at tiny sizes)."""
    started = time.perf_counter()
    cache = cache or EstimateCache()
    target = budget_bytes - int(headroom * budget_bytes)
    spec = gpu_spec(gpu)
    unplanned, trace = cache.estimate(workload, config, device)
    candidates, blocks = profile_blocks(trace, device, gpu, config.precision)
    fixed = max(0, unplanned.peak_bytes - sum(b.activation_bytes for b in blocks))
    base_seconds = step_seconds(trace, spec, config.precision)

    def draft(solution: SelectiveSolution) -> Plan:
        return Plan(
            model=workload.spec, batch_size=workload.effective_batch_size, precision=config.precision,
            optimizer=config.optimizer, grad_accum=config.grad_accum, device=device,
            method=f"selective-dp ({objective})", segments=_segments(blocks, solution), feasible=False,
            budget_bytes=budget_bytes, predicted_peak_bytes=0, unplanned_peak_bytes=unplanned.peak_bytes,
            recompute_flops=0, step_flops=unplanned.step_flops, options=dict(workload.options))

    def realised(solution: SelectiveSolution) -> tuple[Plan, Estimate, float]:
        plan = draft(solution)
        planned, planned_trace = cache.realise(workload, config, device, plan)
        seconds = max(0.0, step_seconds(planned_trace, spec, config.precision) - base_seconds)
        plan = replace(plan, feasible=planned.peak_bytes <= target, predicted_peak_bytes=planned.peak_bytes,
                       recompute_flops=max(0, planned.step_flops - unplanned.step_flops), recompute_seconds=seconds)
        return plan, planned, seconds

    def cost(plan: Plan, seconds: float) -> float:
        return seconds if objective == "seconds" else plan.recompute_flops

    solve_seconds = 0.0
    rounds = 0

    def solve(budget: int) -> SelectiveSolution:
        nonlocal solve_seconds
        solution = solve_selective_chain(blocks, fixed, max(0, budget), objective)
        solve_seconds += solution.solve_seconds
        return solution

    best = None  # (plan, planned, seconds, solution)
    seen: dict[tuple, tuple] = {}
    solver_budget, scale, loose = target, 1, None

    def consider(solution: SelectiveSolution) -> tuple:
        nonlocal best, rounds
        segments = _segments(blocks, solution)
        if segments not in seen:
            rounds += 1
            seen[segments] = realised(solution)
        plan, planned, seconds = seen[segments]
        better = best is None or (plan.feasible and (not best[0].feasible or cost(plan, seconds) < cost(best[0], best[2]))) \
            or (not plan.feasible and not best[0].feasible and planned.peak_bytes < best[1].peak_bytes)
        if better:
            best = (plan, planned, seconds, solution)
        return plan, planned

    for _ in range(CLOSED_LOOP_ROUNDS):
        solution = solve(solver_budget)
        repeated = _segments(blocks, solution) in seen
        plan, planned = consider(solution)
        if plan.feasible or not solution.feasible:
            break
        if repeated:
            scale *= 2
        loose = solver_budget
        solver_budget -= scale * max(1, planned.peak_bytes - target)
    if best[0].feasible and loose is not None:
        tight = solver_budget
        for _ in range(BISECTION_ROUNDS):
            middle = (loose + tight) // 2
            plan, _ = consider(solve(middle))
            loose, tight = (loose, middle) if plan.feasible else (middle, tight)
    plan, planned, seconds, solution = best
    exclusions = tuple((b.path, name, why) for b in blocks for name, why in b.exclusions)
    compat = Solution(
        method=plan.method, segments=tuple(s.modules for s in plan.segments), feasible=solution.feasible,
        modelled_peak_bytes=solution.modelled_peak_bytes, recompute_flops=solution.recompute_flops,
        recompute_seconds=solution.recompute_seconds, solve_seconds=solve_seconds,
        optimality_gap=solution.optimality_gap)
    return SelectiveResult(
        plan=plan, unplanned=unplanned, planned=planned, candidates=candidates, solution=compat,
        selective=solution, blocks=blocks, exclusions=exclusions, recompute_flops=plan.recompute_flops,
        recompute_seconds=seconds, step_seconds=base_seconds, gpu=spec.name, objective=objective,
        solve_seconds=solve_seconds, plan_seconds=time.perf_counter() - started, rounds=rounds)


def plan_overhead(
    workload: Workload, config: StepConfig, plan: Plan, device: str, gpu: str = "h100", cache: EstimateCache | None = None
) -> tuple[float, float]:
    """(FLOPs %, roofline seconds %) of any plan (e.g. the block-level planner's), from the estimator's traces."""
    spec = gpu_spec(gpu)
    cache = cache or EstimateCache()
    unplanned, trace = cache.estimate(workload, config, device)
    planned, planned_trace = cache.realise(workload, config, device, plan)
    base = step_seconds(trace, spec, config.precision)
    extra = step_seconds(planned_trace, spec, config.precision) - base
    return 100 * (planned.step_flops - unplanned.step_flops) / unplanned.step_flops, 100 * extra / base
