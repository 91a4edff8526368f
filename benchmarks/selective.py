"""Selective recompute vs the block-level optimal plan, at budgets of 30..70% of the unplanned peak.

    python benchmarks/selective.py [--models gpt2,llama2-7b,gpt-d256] [--fracs 0.3,0.4,0.5,0.6,0.7]
                                   [--objective seconds] [--gpu h100] [--runs 10] [--threads 2] [--no-measure]

Per model and budget: the selective plan's predicted peak (the estimator on the planned model), the
peak `verify --device cpu` measures, and its recompute overhead as FLOPs %, roofline GPU time % (on
--gpu) and CPU step time %; the same three for the block-level optimal plan
(memplan.planner.plan_checkpoints, which plan_selective gets as a baseline, so the plan it returns
recomputes no more in FLOPs or GPU time); the op-level reference figures (simulated time overhead,
measured by its authors with their own cost model); the planning time (all DP solves; a cold
plan_selective call without baseline: estimator runs, the unplanned one included) and the DP's
optimality gap over its policy families.

CPU step time: one fp32 SGD step of the real model, --threads threads. The unplanned, selective and
block-level models take turns, step by step (the order rotating each round), so that drift and other
load on the machine hit all three alike; the overhead is the median over --runs rounds of each
round's (planned / unplanned - 1), after one warm-up round.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from tabulate import tabulate

from memplan.emit import apply_plan
from memplan.planner import plan_checkpoints
from memplan.selective import EstimateCache, plan_overhead, plan_selective
from memplan.step import StepConfig, prepare_step, run_steps
from memplan.verify import measure
from memplan.workload import resolve_workload
from models import TINY_OVERRIDES

GPT_D256 = {"n_layer": 6, "n_embd": 256, "n_head": 8, "seq_len": 128, "vocab_size": 1000, "block_size": 128}
OP_LEVEL_REFERENCE = {0.3: 20.2, 0.4: 15.6, 0.5: 11.1, 0.6: 7.0, 0.7: 3.9}  # simulated time overhead %


def workloads(names: list[str], batch: int):
    for name in names:
        if name == "gpt-d256":
            yield name, resolve_workload("gpt2", 8, GPT_D256)
        else:
            yield name, resolve_workload(name, batch, dict(TINY_OVERRIDES[name], n_layer=6))


def step_overheads(workload, config, plans, runs: int) -> list[float | None]:
    """CPU step-time overhead % of each plan (None: not measured) against the unplanned model: the
    median over `runs` interleaved rounds of planned / unplanned - 1."""
    one = replace(config, steps=1)
    steppers = []
    for plan in (None, *plans):
        torch.manual_seed(0)
        model, inputs = workload.build()
        if plan is not None:
            model = apply_plan(model, plan)
        steppers.append(prepare_step(model, inputs, config, "cpu"))
    live = [0] + [i + 1 for i, plan in enumerate(plans) if plan is not None]
    ratios: dict[int, list[float]] = {i: [] for i in live[1:]}
    for round_ in range(runs + 1):
        seconds = {}
        for i in live[round_ % len(live) :] + live[: round_ % len(live)]:
            started = time.perf_counter()
            run_steps(steppers[i], one)
            seconds[i] = time.perf_counter() - started
        if round_ > 0:  # the first round warms up
            for i in live[1:]:
                ratios[i].append(seconds[i] / seconds[0] - 1)
    return [100 * statistics.median(ratios[i + 1]) if plan is not None else None for i, plan in enumerate(plans)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt2,llama2-7b,gpt-d256")
    parser.add_argument("--fracs", default="0.3,0.4,0.5,0.6,0.7")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--objective", default="seconds")
    parser.add_argument("--gpu", default="h100")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-measure", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = StepConfig(precision="fp32", optimizer="sgd", steps=2)
    rows, infeasible = [], []
    for name, workload in workloads(args.models.split(","), args.batch):
        cache = EstimateCache()  # the budgets of one model share the unplanned and re-estimated steps
        unplanned, _ = cache.estimate(workload, config, "cpu")
        for frac in (float(f) for f in args.fracs.split(",")):
            budget = int(frac * unplanned.peak_bytes)
            cold = plan_selective(workload, config, budget, device="cpu", objective=args.objective, gpu=args.gpu)
            started = time.perf_counter()
            block = plan_checkpoints(workload, config, budget, device="cpu")
            block_seconds = time.perf_counter() - started
            sel = plan_selective(
                workload, config, budget, device="cpu", objective=args.objective, gpu=args.gpu, cache=cache,
                baselines=(block.plan,),
            )
            for method, plan in (("selective", sel.plan), ("block-level", block.plan)):
                if not plan.feasible:
                    infeasible.append(f"{name} {int(frac * 100)}%: {method} no fit (smallest peak reached "
                                      f"{plan.predicted_peak_bytes} > budget {budget})")
            measured = cpu_sel = cpu_block = None
            if not args.no_measure and sel.plan.feasible:
                measured = measure(workload, config, device="cpu", plan=sel.plan).measured_peak_bytes
            if not args.no_measure:
                timed = [p if p.feasible else None for p in (sel.plan, block.plan)]
                cpu_sel, cpu_block = step_overheads(workload, config, timed, args.runs)
            block_flops, block_gpu = plan_overhead(workload, config, block.plan, "cpu", args.gpu, cache)

            def pct(value, ok=True):
                return "-" if value is None or not ok else f"{value:.1f}"

            ok_s, ok_b = sel.plan.feasible, block.plan.feasible
            rows.append([
                name, f"{int(frac * 100)}%", budget,
                sel.plan.predicted_peak_bytes if ok_s else f"no fit ({sel.plan.predicted_peak_bytes})",
                measured if measured is not None else "-",
                "-" if measured is None else ("yes" if measured <= budget else "NO"),
                pct(sel.flops_overhead_pct, ok_s), pct(sel.seconds_overhead_pct, ok_s), pct(cpu_sel, ok_s),
                pct(block_flops, ok_b), pct(block_gpu, ok_b), pct(cpu_block, ok_b),
                OP_LEVEL_REFERENCE.get(frac, "-"),
                f"{sel.solve_seconds:.2f}", f"{cold.plan_seconds:.1f}", cold.rounds, _gap(sel),
                f"{block_seconds:.1f}",
                " ".join(f"{s.modules[0]}:{'full' if s.policy == 'full' else len(s.saved_ops)}" for s in sel.plan.segments),
            ])
            print(*rows[-1], sep="\t", file=sys.stderr, flush=True)
    headers = ["model", "budget", "budget B", "sel predicted B", "sel measured B", "meas<=budget",
               "sel FLOPs%", "sel GPU%", "sel CPU%", "block FLOPs%", "block GPU%", "block CPU%", "op-level ref %",
               "sel solve s", "sel plan s (cold)", "rounds", "DP gap", "block plan s", "segments (module:saved ops)"]
    print(tabulate(rows, headers=headers))
    print("\nno fit:" if infeasible else "\nno fit: none")
    for line in infeasible:
        print("  " + line)


def _gap(result) -> str:
    if result.selective is None:
        return "(baseline)"
    gap = result.selective.optimality_gap
    return "-" if math.isnan(gap) else f"{100 * gap:.2f}%"  # nan: nothing fits


if __name__ == "__main__":
    main()
