"""Checkpoint plans over the zoo at small sizes, at budgets that cut activation memory by 25/50/75%.

    python benchmarks/planner.py [--models gpt2,llama2-7b] [--cuts 0.25,0.5,0.75] [--no-measure]

For each model and budget: the optimal plan's predicted peak (the estimator on the checkpointed
model), the peak `verify --device cpu` measures on that model, its recompute overhead, and the
overhead of each baseline (every block, sqrt(n) segments, uniform segments) that also fits.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tabulate import tabulate

from memplan.estimate import estimate
from memplan.planner import plan_checkpoints
from memplan.step import StepConfig
from memplan.verify import measure
from memplan.workload import resolve_workload
from models import TINY_OVERRIDES

MODELS = ("gpt2", "bert-base", "llama2-7b", "vit-b16", "mlp", "lstm", "resnet18", "unet")
BASELINES = ("every-block", "sqrt-n", "uniform-k")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--cuts", default="0.25,0.5,0.75")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--layers", type=int, default=6, help="n_layer for the transformer families")
    parser.add_argument("--no-measure", action="store_true", help="skip the CPU measurement")
    args = parser.parse_args()
    config = StepConfig(precision="fp32", optimizer="sgd", steps=2)
    rows = []
    for name in args.models.split(","):
        options = dict(TINY_OVERRIDES[name])
        if "n_layer" in options:
            options["n_layer"] = args.layers
        workload = resolve_workload(name, args.batch, options)
        unplanned = estimate(workload, config, device="cpu")
        for cut in (float(c) for c in args.cuts.split(",")):
            budget = int(unplanned.peak_bytes - cut * unplanned.breakdown.activations)
            started = time.perf_counter()
            result = plan_checkpoints(workload, config, budget, device="cpu")
            seconds = time.perf_counter() - started
            plan = result.plan
            measured = None
            if plan.feasible and not args.no_measure:
                measured = measure(workload, config, device="cpu", plan=plan).measured_peak_bytes
            overhead = 100 * plan.recompute_flops / plan.step_flops
            baseline_cells = []
            for method in BASELINES:
                base = plan_checkpoints(workload, config, budget, device="cpu", method=method).plan
                baseline_cells.append(f"{100 * base.recompute_flops / base.step_flops:.1f}" if base.feasible else "no fit")
            rows.append([
                name, f"{int(cut * 100)}%", budget, plan.predicted_peak_bytes if plan.feasible else f"no fit ({plan.predicted_peak_bytes})",
                measured if measured is not None else "-",
                "yes" if measured is not None and measured <= budget else ("-" if measured is None else "NO"),
                len(plan.segments), f"{overhead:.1f}", *baseline_cells, f"{result.solution.solve_seconds:.3f}", f"{seconds:.1f}",
            ])
            print(*rows[-1], sep="\t", file=sys.stderr, flush=True)
    headers = ["model", "cut", "budget B", "predicted B", "measured B", "measured<=budget", "segments",
               "optimal %", *(f"{b} %" for b in BASELINES), "solve s", "plan s (closed loop)"]
    print(tabulate(rows, headers=headers))


if __name__ == "__main__":
    main()
