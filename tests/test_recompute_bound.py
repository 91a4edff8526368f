"""The least recomputation any plan needs (memplan.recompute_bound): no plan beats it, and its MILP
solves the relaxation it states exactly."""

from __future__ import annotations

import itertools
import math

import pytest

from memplan.closed_loop import EstimateCache
from memplan.devices import device_model
from memplan.errors import BadInput
from memplan.estimate import estimate_and_trace
from memplan.plan import Plan, Segment
from memplan.planner import plan_checkpoints
from memplan.recompute_bound import _backward_moments, _Forward, least_recompute, recompute_bound
from memplan.selective import plan_selective
from memplan.step import StepConfig
from memplan.timing import op_seconds, step_seconds, time_model
from memplan.verify import measure
from memplan.workload import Workload, resolve_workload
from models import TINY_OVERRIDES

pytest.importorskip("scipy")

CONFIG = StepConfig(precision="fp32", optimizer="sgd", steps=2)
GPU = "h100"


def _gpt(n_layer: int = 2) -> Workload:
    return resolve_workload("gpt2", 4, dict(TINY_OVERRIDES["gpt2"], n_layer=n_layer))


def _plan(workload: Workload, *segments: Segment) -> Plan:
    return Plan(model=workload.spec, batch_size=workload.batch_size, precision="fp32", optimizer="sgd", grad_accum=1,
                device="cpu", method="test", segments=segments, feasible=True, budget_bytes=None,
                predicted_peak_bytes=0, unplanned_peak_bytes=0, recompute_flops=0, step_flops=1)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_no_plan_recomputes_less_than_the_bound(device):
    """Plans of every kind (whole segments at two depths, hand-written selective policies, both planners'
    plans): at a budget equal to a plan's own peak (on the CPU the allocator's, measured; on CUDA, with
    no GPU here, the estimator's with the card's workspaces), the bound is at most what that plan
    recomputes, in FLOPs and in roofline seconds."""
    workload = _gpt()
    cache = EstimateCache()
    gpu = GPU if device == "cuda" else None
    unplanned, trace = cache.estimate(workload, CONFIG, device, gpu)
    clock = time_model(GPU)
    full = [Segment(paths, "full") for paths in (("h.0",), ("h.1",), ("h.0.attn",), ("h.1.mlp",), ("h.0", "h.1"))]
    saves = [("aten.addmm.default",), ("aten._safe_softmax.default", "aten.bmm.default"),
             ("aten.addmm.default", "aten.native_layer_norm.default", "aten.gelu.default")]
    plans = [_plan(workload, segment) for segment in full]
    plans += [_plan(workload, full[0], full[1])]
    plans += [_plan(workload, *(Segment((path,), "selective", saved) for path in ("h.0", "h.1"))) for saved in saves]
    for fraction in (0.5, 0.7):
        budget = int(fraction * unplanned.peak_bytes)
        plans.append(plan_selective(workload, CONFIG, budget, device=device, processor=GPU, cache=cache,
                                    baselines=()).plan)
        plans.append(plan_checkpoints(workload, CONFIG, budget, device=device, gpu=gpu, cache=cache).plan)
    binding = 0
    for plan in plans:
        if not plan.segments:
            continue
        planned, planned_trace = cache.realise(workload, CONFIG, device, plan, gpu)
        peak = planned.peak_bytes if device == "cuda" else measure(workload, CONFIG, "cpu", plan=plan).measured_peak_bytes
        flops = least_recompute(workload, CONFIG, peak, device, gpu, objective="flops", cache=cache)
        seconds = least_recompute(workload, CONFIG, peak, device, GPU, cache=cache)
        recomputed_flops = planned.step_flops - unplanned.step_flops
        recomputed_seconds = step_seconds(planned_trace, clock) - step_seconds(trace, clock)
        assert flops.cost <= recomputed_flops, plan.segments
        assert seconds.cost <= recomputed_seconds * (1 + 1e-9), plan.segments
        binding += seconds.cost > 0
    assert binding >= len(plans) // 2  # the bound says something for most of them


def test_the_bound_falls_with_the_budget_and_ends_where_nothing_fits():
    workload = _gpt()
    cache = EstimateCache()
    unplanned, trace = cache.estimate(workload, CONFIG, "cpu")
    bounds = [least_recompute(workload, CONFIG, int(f * unplanned.peak_bytes), "cpu", GPU, cache=cache)
              for f in (0.4, 0.55, 0.7, 0.85, 1.0)]
    costs = [b.cost for b in bounds]
    assert costs == sorted(costs, reverse=True) and costs[0] > costs[-2] > 0
    assert bounds[-1].cost == 0 and bounds[-1].moment is None  # the step fits as it is
    assert all(b.step_cost == step_seconds(trace, time_model(GPU)) for b in bounds)
    weights = sum(s.nbytes for s in trace.storages.values() if s.role == "weights")
    assert math.isinf(least_recompute(workload, CONFIG, weights, "cpu", GPU, cache=cache).cost)


def test_unknown_objective_is_refused():
    with pytest.raises(BadInput, match="unknown objective"):
        least_recompute(_gpt(1), CONFIG, 1 << 20, "cpu", objective="joules")


def _brute_force(trace, moment: int, live: frozenset[int], budget: int, cost, block_bytes) -> float:
    """The relaxation of memplan.recompute_bound at one moment, by trying every set of forward ops to run
    again: each needs what it read live or made again before it, and what is read from the moment on
    must be live or made again by every op that wrote it."""
    step = trace.ops[moment].step
    forward = [op for op in trace.ops if op.step == step and op.phase == "forward"]
    writers: dict[int, list[int]] = {}
    for op in forward:
        for sid in (*op.allocates, *op.writes):
            if sid in trace.storages and trace.storages[sid].allocated_by is not None \
                    and trace.ops[trace.storages[sid].allocated_by].phase == "forward" \
                    and trace.ops[trace.storages[sid].allocated_by].step == step:
                writers.setdefault(sid, []).append(op.index)
    later = {sid for op in trace.ops[moment:] if op.step == step for sid in (*op.reads, *op.writes)}
    now = trace.ops[moment]
    operands = {*now.reads, *now.writes, *now.allocates}
    fixed = {sid for sid in live if sid not in writers or sid in operands}
    needed = {sid for sid in live - fixed if sid in later}
    room = budget - sum(block_bytes(trace.storages[sid].nbytes) for sid in fixed)
    ops = sorted({w for ws in writers.values() for w in ws})
    best = math.inf
    for n in range(len(ops) + 1):
        for rerun in itertools.combinations(ops, n):
            kept = {sid for sid in needed if not set(writers[sid]) <= set(rerun)}
            for o in rerun:
                for sid in {*trace.ops[o].reads, *trace.ops[o].writes} & writers.keys():
                    if any(w < o and w not in rerun for w in writers[sid]):
                        kept.add(sid)
            if sum(block_bytes(trace.storages[sid].nbytes) for sid in kept) <= room:
                best = min(best, sum(cost(trace.ops[o]) for o in rerun))
    return best


def test_the_milp_solves_its_relaxation_exactly():
    """On a small MLP, at every backward moment and a budget between what must stay and what is held,
    the MILP's bound equals the best of every set of ops run again."""
    workload = resolve_workload("mlp", 4, TINY_OVERRIDES["mlp"])
    _, trace = estimate_and_trace(workload, StepConfig(precision="fp32", optimizer="sgd"), "cpu")
    device = device_model("cpu")
    block_bytes = device.block_bytes
    clock = time_model(GPU)

    def cost(op):
        return op_seconds(op, trace, clock)

    forward = _Forward.of(trace, 0, cost, block_bytes)
    weights = sum(block_bytes(s.nbytes) for s in trace.storages.values() if s.allocated_by is None)
    checked = 0
    for moment in _backward_moments(trace, device)[:6]:
        for budget in (weights + (moment.held - weights) // 3, weights + 2 * (moment.held - weights) // 3):
            expected = _brute_force(trace, moment.op, moment.live, budget, cost, block_bytes)
            found = forward.bound_at(moment, budget, integral=True)
            assert found == pytest.approx(expected, rel=1e-6, abs=1e-12) or (math.isinf(found) and math.isinf(expected))
            checked += 0 < expected < math.inf
    assert checked >= 3
    # and the whole bound is the largest over the moments it solves
    held = max(m.held for m in _backward_moments(trace, device))
    assert recompute_bound(trace, weights + (held - weights) // 2, cost, 1.0, device).cost > 0

