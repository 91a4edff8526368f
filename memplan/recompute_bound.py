"""The least recomputation any plan needs to fit a budget: a proven lower bound, to judge plans by.

The planners search a space of their own (whole segments, Pareto families of save policies), and the
selective DP's gap (memplan.selective) is measured inside that space. This bound holds for every plan
that only recomputes: any segments, any save policy per op, selective or not, memplan's or another
tool's. It is a relaxation, so no plan does better; how far above it a plan lands is the most it can be
improved by recomputing differently.

Checkpointing changes neither the backward ops nor the order they run in (memplan.planner.Floor), so
at each backward op m, whatever the plan:
- what is not a forward activation is live as in the unplanned step (weights, inputs, gradients in
  flight, optimizer state, the library workspaces of the threads that ran a matrix product), and so
  are op m's own operands; any other activation may be gone;
- each forward activation that an op from m on reads is either live at m, or made again after m by
  re-running every forward op that wrote it;
- an op re-run needs each activation it read: live at m, or made again after m as well.

One MILP per moment m (HiGHS through scipy): binary x_s (activation s is live at m), r_o (forward op o
runs again after m):

    min  Σ cost(o) r_o
    s.t. x_s + r_w >= 1             s read from m on, w any forward op that wrote s
         r_o <= x_u + r_w           u an activation o read, w an op that wrote u before o
         Σ bytes(s) x_s <= budget - (bytes live at m that are not activations, and m's operands)

Its dual bound is a lower bound on the recompute cost of every plan fitting the budget at m; the bound
is the largest over the moments the step holds the most at, and some spread over the rest of the
backward. Only memory at those moments is constrained, and recomputation is priced per op (no host
time), which is what makes it a relaxation.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from memplan.closed_loop import EstimateCache
from memplan.devices import DeviceModel, device_model
from memplan.errors import BadInput
from memplan.estimate import eager_events, opened_workspace
from memplan.solvers import highs_stdout_to_stderr
from memplan.step import StepConfig
from memplan.timing import TimeModel, gpu_named, op_seconds, time_model_for
from memplan.trace import Op, Trace
from memplan.workload import Workload

# backward moments bounded by the LP relaxation, in the step holding the most: the ones holding the
# most, and some spread evenly over the rest of its backward; the MILP then tightens the highest few
MOST_HELD_MOMENTS = 6
SPREAD_MOMENTS = 6
MILP_MOMENTS = 2
# HiGHS's time per MILP; past it, its dual bound (or the LP's, if it has none yet) still bounds
SECONDS_PER_MILP = 1.0


# objective -> the price of one op of a trace, given the processor's time model
PRICES: dict[str, Callable[[Trace, TimeModel], Callable[[Op], float]]] = {
    "flops": lambda trace, clock: lambda op: float(op.flops),
    "seconds": lambda trace, clock: lambda op: op_seconds(op, trace, clock),
}


@dataclass(frozen=True)
class RecomputeBound:
    cost: float  # in the cost's unit (FLOPs, seconds); 0.0: nothing need run again; math.inf: nothing fits
    step_cost: float  # the unplanned step's, in the same unit
    moment: int | None  # the backward op at whose allocation it binds (None: nothing need run again)

    @property
    def pct(self) -> float:
        """The bound as a share of the step, as the planners report their overhead."""
        return 100 * self.cost / self.step_cost if self.step_cost else 0.0


def least_recompute(workload: Workload, config: StepConfig, budget_bytes: int, device: str = "cuda",
                    gpu: str | TimeModel | None = None, objective: str = "seconds",
                    cache: EstimateCache | None = None) -> RecomputeBound:
    """recompute_bound of the step the planners plan (the same trace and allocator rounding): in FLOPs, or
    in seconds on `gpu`'s roofline or the CPU's model (a name or a TimeModel, memplan.timing; None: what
    `device` runs on)."""
    if objective not in PRICES:
        raise BadInput(f"unknown objective {objective!r}; expected one of: {', '.join(PRICES)}")
    card = gpu_named(device, gpu)
    _, trace = (cache or EstimateCache()).estimate(workload, config, device, card)
    cost = PRICES[objective](trace, time_model_for(device, gpu, config.precision))
    step_cost = sum(cost(op) for op in trace.ops if op.step == 0)
    return recompute_bound(trace, budget_bytes, cost, step_cost, device_model(device, card))


def recompute_bound(trace: Trace, budget_bytes: int, cost: Callable[[Op], float], step_cost: float,
                    device: DeviceModel) -> RecomputeBound:
    """The least recompute cost (summed `cost` of the forward ops run again) of any plan whose live bytes,
    as `device` allocates them (its block rounding and library workspaces), stay within `budget_bytes` at
    each backward op of the trace (see the module)."""
    try:
        from scipy.optimize import milp  # noqa: F401
    except ImportError:
        raise ImportError("the recompute bound needs scipy: pip install scipy") from None
    moments = [m for m in _backward_moments(trace, device) if m.held > budget_bytes]
    if not moments:
        return RecomputeBound(0.0, step_cost, None)
    step = trace.ops[max(moments, key=lambda m: m.held).op].step  # later steps repeat the first
    moments = [m for m in moments if trace.ops[m.op].step == step]
    most = sorted(moments, key=lambda m: -m.held)[:MOST_HELD_MOMENTS]
    stride = max(1, len(moments) // SPREAD_MOMENTS)
    chosen = sorted({m.op: m for m in [*most, *moments[::stride][:SPREAD_MOMENTS]]}.values(), key=lambda m: m.op)
    forward = _Forward.of(trace, step, cost, device.block_bytes)
    relaxed = []
    for moment in chosen:
        bound = forward.bound_at(moment, budget_bytes, integral=False)
        if math.isinf(bound):
            return RecomputeBound(math.inf, step_cost, moment.op)
        relaxed.append((bound, moment))
    relaxed.sort(key=lambda m: -m[0])
    tightened = [(max(bound, forward.bound_at(moment, budget_bytes, integral=True)), moment.op)
                 for bound, moment in relaxed[:MILP_MOMENTS]]
    bound, op = max([*tightened, *((bound, moment.op) for bound, moment in relaxed)])
    return RecomputeBound(bound, step_cost, op if bound > 0 else None)


@dataclass(frozen=True)
class _Moment:
    """An allocation by a backward op: what is live right after it."""

    op: int
    held: int  # bytes, storages and library workspaces
    live: frozenset[int]  # storage ids
    workspace_bytes: int


def _backward_moments(trace: Trace, device: DeviceModel) -> list[_Moment]:
    """Each allocation by a backward op, in eager order, as memplan.estimate.simulate counts it."""
    live = {sid for sid, s in trace.storages.items() if s.allocated_by is None}
    held = sum(device.block_bytes(trace.storages[sid].nbytes) for sid in live)
    threads: set[str] = set()  # those whose workspace is allocated
    phase = ""
    moments = []
    for event in eager_events(trace):
        if event.kind == "phase":
            phase = event.phase
        elif event.kind == "alloc" and event.storage not in live:
            thread = opened_workspace(device, threads, phase, trace.ops[event.op].name)
            if thread is not None:
                threads.add(thread)
                held += device.workspace_bytes
            live.add(event.storage)
            held += device.block_bytes(trace.storages[event.storage].nbytes)
            if trace.ops[event.op].phase == "backward":
                moments.append(_Moment(event.op, held, frozenset(live), device.workspace_bytes * len(threads)))
        elif event.kind == "free" and event.storage in live:
            live.discard(event.storage)
            held -= device.block_bytes(trace.storages[event.storage].nbytes)
    return moments


@dataclass(frozen=True)
class _Forward:
    """One step's forward as the MILP sees it: what is the same at every moment of its backward."""

    trace: Trace
    writers: dict[int, list[int]]  # activation -> the forward ops that wrote it, in order
    x: dict[int, int]  # activation -> its variable
    r: dict[int, int]  # forward op -> its variable
    closure: list[tuple[dict[int, float], float, float]]  # rows: an op re-run has what it read
    costs: np.ndarray
    sizes: np.ndarray  # bytes per x variable, in `unit`s, rounded down
    unit: float
    block_bytes: Callable[[int], int]

    @classmethod
    def of(cls, trace: Trace, step: int, cost: Callable[[Op], float], block_bytes: Callable[[int], int]) -> _Forward:
        forward = [op for op in trace.ops if op.step == step and op.phase == "forward"]
        writers: dict[int, list[int]] = {}
        for op in forward:
            for sid in op.allocates:
                writers.setdefault(sid, []).append(op.index)
        for op in forward:
            for sid in op.writes:
                if sid in writers and op.index not in writers[sid]:
                    writers[sid].append(op.index)
        x = {sid: i for i, sid in enumerate(sorted(writers))}
        ops = sorted({w for ws in writers.values() for w in ws})
        r = {o: len(x) + i for i, o in enumerate(ops)}
        closure = [({r[o]: 1, x[sid]: -1, r[w]: -1}, -np.inf, 0)
                   for o in ops for sid in {*trace.ops[o].reads, *trace.ops[o].writes} & writers.keys()
                   for w in writers[sid] if w < o]
        costs = np.zeros(len(x) + len(r))
        costs[[r[o] for o in ops]] = [cost(trace.ops[o]) for o in ops]
        # bytes in power-of-two units that keep HiGHS's coefficients small, rounded down (and the room
        # up): the relaxation only loosens
        nbytes = [block_bytes(trace.storages[sid].nbytes) for sid in x]
        unit = 2.0 ** max(0, math.ceil(math.log2(max(nbytes, default=1) or 1)) - 20)
        sizes = np.floor(np.array(nbytes, dtype=float) / unit)
        return cls(trace, writers, x, r, closure, costs, sizes, unit, block_bytes)

    def bound_at(self, moment: _Moment, budget_bytes: int, integral: bool) -> float:
        """The MILP's dual bound at `moment` (`integral`), or its LP relaxation's optimum."""
        from scipy.optimize import Bounds, LinearConstraint, milp
        from scipy.sparse import coo_array

        trace, writers, x, r, live = self.trace, self.writers, self.x, self.r, moment.live
        now = trace.ops[moment.op]
        read_from_m = {sid for op in trace.ops[moment.op:] if op.step == now.step for sid in (*op.reads, *op.writes)}
        operands = {*now.reads, *now.writes, *now.allocates}
        # activations live at m that nothing reads from m on may go (held by Python, or by autograd for
        # their metadata only): the relaxation lets them
        fixed = {sid for sid in live if sid not in writers or sid in operands}
        needed = sorted(sid for sid in live - fixed if sid in read_from_m)
        room = budget_bytes - moment.workspace_bytes - sum(self.block_bytes(trace.storages[sid].nbytes) for sid in fixed)
        if room < 0:
            return math.inf
        room_units = math.ceil(room / self.unit)
        if sum(self.sizes[x[sid]] for sid in needed) <= room_units:
            return 0.0  # keeping what is read later fits (in the rounded units): nothing need run again
        rows = [*self.closure, *(({x[sid]: 1, r[w]: 1}, 1, np.inf) for sid in needed for w in writers[sid])]
        entries = [(i, j, v) for i, (coefs, _, _) in enumerate(rows) for j, v in coefs.items()]
        i, j, v = (np.array(column) for column in zip(*entries))
        n = len(self.costs)
        memory = coo_array((self.sizes, (np.zeros(len(x), dtype=int), np.arange(len(x)))), shape=(1, n))
        constraints = [LinearConstraint(memory, -np.inf, room_units)]
        constraints.append(LinearConstraint(coo_array((v.astype(float), (i, j)), shape=(len(rows), n)).tocsr(),
                                            [lo for _, lo, _ in rows], [hi for _, _, hi in rows]))
        scale = float(self.costs.max()) or 1.0  # HiGHS's tolerances are absolute: costs of order one
        with highs_stdout_to_stderr():
            result = milp(self.costs / scale, integrality=np.full(n, int(integral)), bounds=Bounds(0, 1),
                          constraints=constraints, options={"time_limit": SECONDS_PER_MILP})
        if result.status == 2:
            return math.inf
        # the MILP's dual bound holds wherever it stopped; the LP's optimum only once it is one
        bound = result.mip_dual_bound if integral else result.fun if result.status == 0 else None
        return max(0.0, float(bound) * scale) if bound is not None and np.isfinite(bound) else 0.0
