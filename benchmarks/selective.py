"""Selective recompute vs the block-level optimal plan, at budgets of 30..70% of the unplanned peak.

    python benchmarks/selective.py [--models gpt2,llama2-7b,gpt2-seq128,llama2-7b-seq128,gpt-d256,llama-d256]
                                   [--fracs 0.3,0.4,0.5,0.6,0.7]
                                   [--objective seconds] [--gpu h100] [--runs 10] [--threads 2] [--no-measure]
                                   [--builtin-cpu-model]

Per model and budget, two selective plans, each priced on the processor it is for (memplan.timing):
- GPU-priced (--gpu's roofline): its predicted peak (the estimator on the planned model), the peak
  `verify --device cpu` measures, and its recompute overhead as FLOPs %, roofline GPU time % and CPU
  step time %;
- CPU-priced (the CPU time model, which counts host time per op and the selective policy's dispatch;
  its constants measured on this machine first, memplan.cpu_calibration, unless --builtin-cpu-model):
  its measured peak, FLOPs %, modelled CPU % and measured CPU step time %;
whether each plan's fp32 gradients equal eager's (dropout included, the same seed);
and the same for the block-level optimal plan (memplan.planner.plan_checkpoints on the CPU model, which both get as a
baseline, so each returns a plan that costs no more on its processor); the op-level reference figures
(simulated time overhead, measured by its authors with their own cost model); the least any recompute
plan needs (memplan.recompute_bound: FLOPs %, roofline GPU %, modelled CPU % without checkpointing's host
time, each a proven lower bound on that measure); the planning time (all DP
solves; a cold GPU-priced plan_selective call, its default baseline, the block-level planner's
search, inside it: estimator runs, the unplanned one included; how many plans the estimator ran on and how many memplan.replay replayed) and the DP's
optimality gap over its policy families. Where a plan does not fit, the line under the table gives
the peak floor (memplan.planner.Floor) and whether it proves that no checkpoint plan can.

Models: gpt2 and llama2-7b at the zoo's tiny sizes with 6 layers (d 64, 32 tokens), batch --batch,
where the weights and their gradients hold most of the peak; the same with 128 tokens (-seq128),
benchmarks/planner.py's sizes, where activations and weights are in their full-size proportion;
gpt-d256, the issue's 6-layer GPT (d 256, 8 heads, 128 tokens, vocab 1000, batch 8); llama-d256, the
Llama family at that shape.

CPU step time: one fp32 SGD step of the real model, --threads threads. The unplanned and planned
models take turns, step by step (the order rotating each round), so that drift and other load on the
machine hit all alike; the overhead is the median over --runs rounds of each round's
(planned / unplanned - 1), after one warm-up round. Plans with the same segments are one model, timed once.
The block-level plan is also timed as a second model built again ("CPU% again"): how far apart two
measurements of one plan lie, the resolution of any comparison of CPU step times here.
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

from memplan.closed_loop import EstimateCache
from memplan.cpu_calibration import measure_cpu_model
from memplan.emit import apply_plan
from memplan.planner import plan_checkpoints
from memplan.recompute_bound import least_recompute
from memplan.selective import plan_overhead, plan_selective
from memplan.step import StepConfig, prepare_step, run_steps
from memplan.timing import CPU
from memplan.verify import gradients_equal, measure
from memplan.workload import resolve_workload
from models import TINY_OVERRIDES

GPT_D256 = {"n_layer": 6, "n_embd": 256, "n_head": 8, "seq_len": 128, "vocab_size": 1000, "block_size": 128}
# the Llama family at the reference GPT's shape (SwiGLU's width in llama2-7b's proportion: 11008 / 4096 x 256)
LLAMA_D256 = {"n_layer": 6, "n_embd": 256, "n_head": 8, "n_kv_head": 8, "ffn_dim": 688, "seq_len": 128, "vocab_size": 1000}
OP_LEVEL_REFERENCE = {0.3: 20.2, 0.4: 15.6, 0.5: 11.1, 0.6: 7.0, 0.7: 3.9}  # simulated time overhead %


# name -> (zoo family, its options, batch size; None: --batch)
MODELS = {
    "gpt2": ("gpt2", dict(TINY_OVERRIDES["gpt2"], n_layer=6), None),
    "llama2-7b": ("llama2-7b", dict(TINY_OVERRIDES["llama2-7b"], n_layer=6), None),
    # benchmarks/planner.py's sizes: activations and weights in their full-size proportion
    "gpt2-seq128": ("gpt2", dict(TINY_OVERRIDES["gpt2"], n_layer=6, seq_len=128, block_size=128), None),
    "llama2-7b-seq128": ("llama2-7b", dict(TINY_OVERRIDES["llama2-7b"], n_layer=6, seq_len=128), None),
    "gpt-d256": ("gpt2", GPT_D256, 8),
    "llama-d256": ("llama2-7b", LLAMA_D256, 8),
}


def workloads(names: list[str], batch: int):
    for name in names:
        family, options, fixed_batch = MODELS[name]
        yield name, resolve_workload(family, fixed_batch or batch, options)


def timed_rounds(workload, config, plans, runs: int) -> list[list[float]]:
    """Seconds of one fp32 step of the unplanned model and of each plan's, per round: the models take
    turns, step by step (the order rotating each round), so that drift and other load on the machine hit
    all alike; `runs` rounds after one that warms up. Row i: the unplanned model (0), then plans[i - 1]."""
    one = replace(config, steps=1)
    steppers = []
    for plan in (None, *plans):
        torch.manual_seed(0)
        model, inputs = workload.build()
        steppers.append(prepare_step(apply_plan(model, plan) if plan is not None else model, inputs, config, "cpu"))
    order = list(range(len(steppers)))
    seconds: list[list[float]] = [[] for _ in order]
    for round_ in range(runs + 1):
        for i in order[round_ % len(order) :] + order[: round_ % len(order)]:
            started = time.perf_counter()
            run_steps(steppers[i], one)
            if round_ > 0:  # the first round warms up
                seconds[i].append(time.perf_counter() - started)
    return seconds


def step_overheads(workload, config, plans, runs: int, again=None) -> tuple[list[float | None], float | None]:
    """CPU step-time overhead % of each plan (None: not measured) against the unplanned model: the
    median over `runs` interleaved rounds of planned / unplanned - 1. Plans with equal segments are timed
    once. `again`: a plan also timed as a model of its own built once more, whose second figure (returned
    second) shows how far two measurements of one plan lie apart."""
    distinct = list(dict.fromkeys(p.segments for p in plans if p is not None and p.segments))
    timed_plans = [next(p for p in plans if p is not None and p.segments == s) for s in distinct]
    twice = again is not None and bool(again.segments)
    unplanned, *timed = timed_rounds(workload, config, timed_plans + ([again] if twice else []), runs)
    pct = [100 * statistics.median(t / u - 1 for t, u in zip(rounds, unplanned)) for rounds in timed]
    overhead = dict(zip(distinct, pct))
    return ([None if p is None else overhead[p.segments] if p.segments else 0.0 for p in plans],
            pct[-1] if twice else None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--fracs", default="0.3,0.4,0.5,0.6,0.7")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--objective", default="seconds")
    parser.add_argument("--gpu", default="h100")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-measure", action="store_true")
    parser.add_argument("--builtin-cpu-model", action="store_true",
                        help="price on memplan.timing.CPU's constants, not on a model measured here first")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cpu = CPU if args.builtin_cpu_model else measure_cpu_model()
    print(f"CPU-priced plans, block level and the CPU bound: {cpu.description}")
    config = StepConfig(precision="fp32", optimizer="sgd", steps=2)
    rows, infeasible = [], []
    for name, workload in workloads(args.models.split(","), args.batch):
        cache = EstimateCache()  # the budgets of one model share the unplanned and re-estimated steps
        unplanned, _ = cache.estimate(workload, config, "cpu")
        for frac in (float(f) for f in args.fracs.split(",")):
            budget = int(frac * unplanned.peak_bytes)
            cold = plan_selective(workload, config, budget, device="cpu", objective=args.objective, processor=args.gpu)
            started = time.perf_counter()
            block = plan_checkpoints(workload, config, budget, device="cpu", processor=cpu)
            block_seconds = time.perf_counter() - started
            on_gpu, on_cpu = (plan_selective(workload, config, budget, device="cpu", objective=args.objective,
                                             processor=processor, cache=cache, baselines=(block.plan,))
                              for processor in (args.gpu, cpu))
            plans = {"GPU-priced": on_gpu.plan, "CPU-priced": on_cpu.plan, "block-level": block.plan}
            for method, plan in plans.items():
                if not plan.feasible:
                    infeasible.append(f"{name} {int(frac * 100)}%: {method} no fit (smallest peak reached "
                                      f"{plan.predicted_peak_bytes} > budget {budget}; {_floor(cold.floor, budget)})")
            fitting = {method: plan if plan.feasible else None for method, plan in plans.items()}
            measured = {method: None for method in plans}
            cpu_pct = {method: None for method in plans}
            block_again = None
            if not args.no_measure:
                for method, plan in fitting.items():
                    if plan is not None and method != "block-level":
                        measured[method] = measure(workload, config, device="cpu", plan=plan).measured_peak_bytes
                pcts, block_again = step_overheads(workload, config, list(fitting.values()), args.runs,
                                                   again=fitting["block-level"])
                cpu_pct = dict(zip(plans, pcts))
            grads = " ".join("-" if plan is None else "yes" if gradients_equal(workload, plan) else "NO"
                             for plan in fitting.values())
            block_flops, block_gpu = plan_overhead(workload, config, block.plan, "cpu", args.gpu, cache)
            block_cpu_model = plan_overhead(workload, config, block.plan, "cpu", cpu, cache)[1]
            bounds = [least_recompute(workload, config, budget, "cpu", gpu, objective, cache).pct
                      for gpu, objective in ((None, "flops"), (args.gpu, "seconds"), (cpu, "seconds"))]

            ok = {method: plan is not None for method, plan in fitting.items()}
            rows.append([
                name, f"{int(frac * 100)}%", budget,
                on_gpu.plan.predicted_peak_bytes if on_gpu.plan.feasible else f"no fit ({on_gpu.plan.predicted_peak_bytes})",
                _peak(measured["GPU-priced"], budget), _pct(on_gpu.flops_overhead_pct, ok["GPU-priced"]),
                _pct(on_gpu.seconds_overhead_pct, ok["GPU-priced"]), _pct(cpu_pct["GPU-priced"], ok["GPU-priced"]),
                _peak(measured["CPU-priced"], budget), _pct(on_cpu.flops_overhead_pct, ok["CPU-priced"]),
                _pct(on_cpu.seconds_overhead_pct, ok["CPU-priced"]), _pct(cpu_pct["CPU-priced"], ok["CPU-priced"]),
                _pct(block_flops, ok["block-level"]), _pct(block_gpu, ok["block-level"]), _pct(block_cpu_model, ok["block-level"]),
                _pct(cpu_pct["block-level"], ok["block-level"]), _pct(block_again, ok["block-level"]),
                OP_LEVEL_REFERENCE.get(frac, "-"), "/".join("inf" if math.isinf(b) else f"{b:.1f}" for b in bounds),
                f"{on_gpu.solve_seconds:.2f}", f"{cold.plan_seconds:.1f}", f"{cold.rounds}/{cold.replays}", _gap(on_gpu),
                f"{block_seconds:.1f}", grads, _described(on_gpu.plan), _described(on_cpu.plan),
            ])
            print(*rows[-1], sep="\t", file=sys.stderr, flush=True)
    headers = ["model", "budget", "budget B",
               "GPU-priced predicted B", "measured B <= budget", "FLOPs%", "GPU%", "CPU%",
               "CPU-priced measured B <= budget", "FLOPs%", "CPU% model", "CPU%",
               "block FLOPs%", "GPU%", "CPU% model", "CPU%", "CPU% again", "op-level ref %", "any plan >= FLOPs/GPU/CPU model %",
               "solve s", "plan s (cold)", "estimator runs/replays", "DP gap", "block plan s", "grads = eager (GPU, CPU, block)",
               "GPU-priced segments (module:saved ops)", "CPU-priced segments"]
    print(tabulate(rows, headers=headers))
    print("\nno fit:" if infeasible else "\nno fit: none")
    for line in infeasible:
        print("  " + line)


def _floor(floor, budget: int) -> str:
    """Whether the peak floor (memplan.planner.Floor) proves that no checkpoint plan fits."""
    verdict = "no checkpoint plan fits" if floor.peak_bytes > budget else "proves nothing"
    return f"floor {floor.peak_bytes} at {floor.op}: {verdict}"


def _pct(value: float | None, fits: bool) -> str:
    return "-" if value is None or not fits else f"{value:.1f}"


def _peak(measured: int | None, budget: int) -> str:
    return "-" if measured is None else f"{measured} {'yes' if measured <= budget else 'NO'}"


def _described(plan) -> str:
    return " ".join(f"{s.modules[0]}:{'full' if s.policy == 'full' else len(s.saved_ops)}" for s in plan.segments)


def _gap(result) -> str:
    if result.selective is None:
        return "(baseline)"
    gap = result.selective.optimality_gap
    return "-" if math.isnan(gap) else f"{100 * gap:.2f}%"  # nan: nothing fits


if __name__ == "__main__":
    main()
