"""Plan activation checkpoints: the cheapest set of recompute segments whose step fits a budget.

    trace -> candidate blocks (with cost-model numbers) -> solver -> Plan -> re-estimate the
    checkpointed model under fake tensors (closed loop) -> tighten and solve again if it does not fit.

The prediction a plan reports is always the estimator's on the checkpointed model, never the
solver's cost model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from memplan.devices import device_model
from memplan.emit import apply_plan
from memplan.errors import DoesNotFit
from memplan.estimate import Estimate, estimate, estimate_and_trace
from memplan.gpus import gpu_spec, roofline_seconds
from memplan.plan import Plan, Segment
from memplan.solvers import SOLVERS, Block, ChainProblem, Solution
from memplan.step import StepConfig
from memplan.trace import ModuleCall, Op, Trace
from memplan.workload import Workload

CONTAINERS = ("ModuleList", "Sequential")
DEFAULT_GPU = "h100"  # matches memplan.devices.DEFAULT_COMPUTE_CAPABILITY
CLOSED_LOOP_ROUNDS = 8
BISECTION_ROUNDS = 6
BASELINES = ("every-block", "sqrt-n", "uniform-k")


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
    seconds_of: Callable[[int, int], float] = lambda flops, bytes_moved: 0.0,
) -> Candidates:
    """The chain of blocks to choose from, in forward order: the outermost children of nn.Sequential /
    nn.ModuleList containers (blocks called in a loop), and the model's direct children that hold none.
    Cost-model numbers come from the first forward of the trace; `seconds_of(flops, bytes moved)` times
    one op's recomputation (a roofline on the target GPU), summed over the block."""
    first_forward = [c for c in trace.calls if c.phase == "forward" and c.step == 0]
    calls_per_path: dict[str, int] = {}
    for call in first_forward:
        calls_per_path[call.path] = calls_per_path.get(call.path, 0) + 1
    seen: set[str] = set()
    first_calls = []
    for call in sorted(first_forward, key=lambda c: (c.first_op, -c.end_op)):  # enclosing calls first
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
    chosen = sorted(in_containers + top_level, key=lambda c: (c.first_op, -c.end_op))
    outermost = []
    for call in chosen:  # sorted by first op: an enclosing block comes before what it contains
        if not any(call.path.startswith(kept.path + ".") for kept in outermost):
            outermost.append(call)

    approximate_ops = set(trace.approximate_ops)
    forward_end = max((c.end_op for c in first_forward), default=0)
    blocks, excluded = [], []
    previous: ModuleCall | None = None  # the call of the last block kept
    for call in outermost:
        before, previous = previous, None  # an excluded block breaks any run
        ops = trace.ops[call.first_op : call.end_op]
        if calls_per_path[call.path] > _forward_passes(trace):
            excluded.append(Excluded(call.path, "called more than once per forward"))
            continue
        if _mutated_after(trace, call, forward_end):
            excluded.append(Excluded(call.path, "its input or output is modified in place later in forward"))
            continue
        if any(op.name in approximate_ops for op in ops):
            excluded.append(Excluded(call.path, "has outputs with data-dependent shapes"))
            continue
        saved = sum(
            block_bytes(trace.storages[sid].nbytes)
            for op in ops
            for sid in op.allocates
            if trace.storages[sid].role == "activations"
        )
        inputs = sum(
            block_bytes(trace.storages[sid].nbytes)
            for sid in call.inputs
            if trace.storages[sid].role not in ("weights",)
        )
        group = ""
        if trace.module_types.get(parent(call.path)) in CONTAINERS:
            # a run may join this block to the one before only if the parent feeds one's output
            # straight into the next (`x = block(x)`); otherwise it starts a run of its own
            chained = before is not None and parent(before.path) == parent(call.path) and call.inputs[:1] \
                and call.inputs[0] in before.outputs
            group = blocks[-1].group if chained else f"{parent(call.path)}@{call.path}"
        seconds = sum(seconds_of(op.flops, _bytes_moved(trace, op)) for op in ops)
        blocks.append(Block(call.path, inputs, saved, sum(op.flops for op in ops), seconds, group))
        previous = call
    return Candidates(tuple(blocks), tuple(excluded))


def _bytes_moved(trace: Trace, op: Op) -> int:
    """What one op reads and writes: its input storages and the storages it allocates."""
    return sum(trace.storages[sid].nbytes for sid in (*op.reads, *op.allocates))


def roofline(gpu: str | None, precision: str) -> Callable[[int, int], float]:
    """Recompute time of one op on `gpu` (default: the CUDA model's default GPU, an H100)."""
    spec = gpu_spec(gpu or DEFAULT_GPU)
    return lambda flops, bytes_moved: roofline_seconds(flops, bytes_moved, spec, precision)


def _mutated_after(trace: Trace, call: ModuleCall, forward_end: int) -> bool:
    """A checkpoint keeps its input to recompute from, and autograd checks its output's version:
    an in-place write to either, inside the block or after it, breaks the recomputation."""
    def watched(storages: tuple[int, ...]) -> set[int]:
        return {sid for sid in storages if trace.storages[sid].role not in ("weights", "inputs")}

    inputs, outputs = watched(call.inputs), watched(call.outputs) - set(call.inputs)
    return any(inputs.intersection(op.writes) for op in trace.ops[call.first_op : forward_end]) or any(
        outputs.intersection(op.writes) for op in trace.ops[call.end_op : forward_end]
    )


def _forward_passes(trace: Trace) -> int:
    """How many forward passes step 0 ran (one per micro-batch)."""
    return max(1, sum(1 for e in trace.events if e.kind == "phase" and e.phase == "forward" and e.step == 0))


@dataclass(frozen=True)
class PlanResult:
    plan: Plan
    unplanned: Estimate
    planned: Estimate
    candidates: Candidates
    solution: Solution
    baselines: tuple[tuple[str, Plan], ...] = ()


def plan_checkpoints(
    workload: Workload,
    config: StepConfig,
    budget_bytes: int,
    device: str = "cuda",
    method: str = "optimal-dp",
    gpu: str | None = None,
) -> PlanResult:
    """The cheapest plan (by the solver `method`) whose re-estimated peak fits `budget_bytes`.
    The result's plan has feasible=False, with the smallest peak reached, when none fits."""
    unplanned, trace = estimate_and_trace(workload, config, device, gpu=gpu)
    candidates = candidate_blocks(trace, device_model(device, gpu).block_bytes, roofline(gpu, config.precision))
    fixed = max(0, unplanned.peak_bytes - sum(b.saved_bytes for b in candidates.blocks))
    solver_budget = budget_bytes
    best: tuple[Plan, Estimate, Solution] | None = None
    realised: dict[tuple, tuple[Plan, Estimate]] = {}
    excess_scale = 1
    loose: int | None = None  # the last solver budget whose plan did not fit
    for _ in range(CLOSED_LOOP_ROUNDS):
        solution = _solve(method, ChainProblem(candidates.blocks, fixed, max(0, solver_budget)))
        if solution.segments in realised:
            excess_scale *= 2  # the same choice again: tighten harder
        else:
            realised[solution.segments] = _realise(workload, config, device, solution, budget_bytes, unplanned, gpu)
        plan, planned = realised[solution.segments]
        if best is None or plan.feasible or planned.peak_bytes < best[1].peak_bytes:
            best = (plan, planned, solution)
        if plan.feasible or not solution.feasible:
            break
        # the cost model was optimistic: tighten the solver's budget by what the estimator found over
        loose = solver_budget
        solver_budget -= excess_scale * (planned.peak_bytes - budget_bytes)
    if best[0].feasible and best[0].segments:
        # The cost model is only a model: a looser solver budget may still give a plan that really
        # fits, and costs less. Bisect between the solver budget whose plan fits and the last one
        # whose plan did not (or the unplanned peak, where no checkpoint is needed).
        loose = unplanned.peak_bytes if loose is None else loose
        tight = solver_budget
        for _ in range(BISECTION_ROUNDS):
            middle = (loose + tight) // 2
            solution = _solve(method, ChainProblem(candidates.blocks, fixed, max(0, middle)))
            if solution.segments not in realised:
                realised[solution.segments] = _realise(workload, config, device, solution, budget_bytes, unplanned, gpu)
            plan, planned = realised[solution.segments]
            if plan.feasible:
                tight = middle
                if plan.recompute_flops < best[0].recompute_flops:
                    best = (plan, planned, solution)
            else:
                loose = middle
    if method == "optimal-dp" and candidates.blocks:
        # The cost model can be pessimistic where a baseline's real peak fits: never return a plan
        # that recomputes more than a baseline the estimator shows fitting.
        for baseline in BASELINES:
            solution = _solve(baseline, ChainProblem(candidates.blocks, fixed, budget_bytes))
            if solution.segments not in realised:
                realised[solution.segments] = _realise(workload, config, device, solution, budget_bytes, unplanned, gpu)
            plan, planned = realised[solution.segments]
            if plan.feasible and (not best[0].feasible or plan.recompute_flops < best[0].recompute_flops):
                best = (replace(plan, method=f"optimal-dp (via {baseline})"), planned, solution)
    plan, planned, solution = best
    return PlanResult(plan, unplanned, planned, candidates, solution)


def _solve(method: str, problem: ChainProblem) -> Solution:
    if method == "uniform-k":
        return SOLVERS[method](problem, k=max(1, round(len(problem.blocks) ** 0.5)))
    return SOLVERS[method](problem)


def _realise(
    workload: Workload,
    config: StepConfig,
    device: str,
    solution: Solution,
    budget_bytes: int,
    unplanned: Estimate,
    gpu: str | None,
) -> tuple[Plan, Estimate]:
    """The solver's segments as a Plan, with the peak and FLOPs the estimator gives the checkpointed model."""
    draft = Plan(
        model=workload.spec,
        batch_size=workload.effective_batch_size,
        precision=config.precision,
        optimizer=config.optimizer,
        grad_accum=config.grad_accum,
        device=device,
        method=solution.method,
        segments=tuple(Segment(tuple(paths)) for paths in solution.segments),
        feasible=False,
        budget_bytes=budget_bytes,
        predicted_peak_bytes=0,
        unplanned_peak_bytes=unplanned.peak_bytes,
        recompute_flops=0,
        step_flops=unplanned.step_flops,
        options=dict(workload.options),
    )
    planned = (
        estimate(workload, config, device, transform=lambda model: apply_plan(model, draft), gpu=gpu)
        if draft.segments
        else unplanned
    )
    plan = replace(
        draft,
        feasible=planned.peak_bytes <= budget_bytes,
        predicted_peak_bytes=planned.peak_bytes,
        recompute_flops=max(0, planned.step_flops - unplanned.step_flops),
        recompute_seconds=solution.recompute_seconds,
    )
    return plan, planned


def require_fit(result: PlanResult) -> None:
    if not result.plan.feasible:
        raise DoesNotFit(f"no checkpoint plan fits: the smallest peak reached is {result.plan.predicted_peak_bytes} bytes")


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


def alternatives(
    workload: Workload, config: StepConfig, budget_bytes: int, device: str, gpu: str | None = None
) -> tuple[Alternative, ...]:
    """What would fit instead: a smaller micro-batch with gradient accumulation giving the same
    effective batch, a lower precision, a lighter optimizer — each re-estimated."""
    found = []
    batch = workload.effective_batch_size
    if batch and batch > 1:
        for divisor in (d for d in range(2, batch + 1) if batch % d == 0):
            smaller = replace(workload, batch_size=batch // divisor)
            accum = replace(config, grad_accum=config.grad_accum * divisor)
            peak = estimate(smaller, accum, device, gpu=gpu).peak_bytes
            if peak <= budget_bytes:
                found.append(Alternative(
                    f"micro-batch {batch // divisor} x grad-accum {accum.grad_accum} (same effective batch)",
                    batch // divisor, accum.grad_accum, config.precision, config.optimizer, peak))
                break
    for description, changed in (
        ("precision", replace(config, precision=LOWER_PRECISIONS[config.precision]) if config.precision in LOWER_PRECISIONS else None),
        ("optimizer", replace(config, optimizer=LIGHTER_OPTIMIZERS[config.optimizer]) if config.optimizer in LIGHTER_OPTIMIZERS else None),
    ):
        if changed is None:
            continue
        peak = estimate(workload, changed, device, gpu=gpu).peak_bytes
        if peak <= budget_bytes:
            what = changed.precision if description == "precision" else changed.optimizer
            found.append(Alternative(f"{description} {what}", batch, changed.grad_accum, changed.precision, changed.optimizer, peak))
    return tuple(found)


@dataclass(frozen=True)
class MaxBatch:
    without_plan: int  # 0: not even batch 1 fits
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
    memory grows with the batch)."""

    def fits_plain(batch: int) -> bool:
        return estimate(replace(workload, batch_size=batch), config, device, gpu=gpu).peak_bytes <= budget_bytes

    def plan_at(batch: int) -> Plan:
        return plan_checkpoints(replace(workload, batch_size=batch), config, budget_bytes, device, gpu=gpu).plan

    plain = _largest(fits_plain, 1, limit)
    planned = _largest(lambda b: plan_at(b).feasible, max(plain, 1), limit)
    return MaxBatch(plain, max(plain, planned), plan_at(planned) if planned else None)


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
