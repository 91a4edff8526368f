"""Checkpoint plans over the zoo at small sizes, at budgets that cut activation memory by 25/50/75%.

    python benchmarks/planner.py [--models gpt2,llama2-7b] [--cuts 0.25,0.5,0.75] [--no-measure]

Sizes are small enough to measure on a CPU, with activations and weights in the same proportion as at
the zoo's own sizes (the "act/weights" column; at full size `memplan estimate MODEL --device cpu -o sgd`
gives gpt2 43, bert-base 29, vit-b16 11, resnet18 14, unet 42, lstm 13, mlp 0: its peak holds no
activations), since how much checkpointing can save depends on that proportion.

For each model and budget: the optimal plan's predicted peak (the estimator on the checkpointed
model), the floor no checkpoint plan goes below (memplan.planner.peak_floor; "> budget": no plan can
fit), the peak `verify --device cpu` measures on that model, its recompute overhead, and the
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

SIZES = {  # model: (batch size, options over TINY_OVERRIDES)
    "gpt2": (8, {"n_layer": 6, "seq_len": 128, "block_size": 128}),
    "bert-base": (4, {"n_layer": 6, "seq_len": 128, "max_positions": 128}),
    "llama2-7b": (8, {"n_layer": 6, "seq_len": 128}),
    "vit-b16": (8, {"n_layer": 6, "image_size": 64}),
    "mlp": (4, {}),
    "lstm": (4, {"seq_len": 128}),
    "resnet18": (32, {"image_size": 128}),
    "unet": (2, {"image_size": 64}),
}
BASELINES = ("every-block", "sqrt-n", "uniform-k")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(SIZES))
    parser.add_argument("--cuts", default="0.25,0.5,0.75")
    parser.add_argument("--no-measure", action="store_true", help="skip the CPU measurement")
    args = parser.parse_args()
    config = StepConfig(precision="fp32", optimizer="sgd", steps=2)
    rows = []
    for name in args.models.split(","):
        batch, options = SIZES[name]
        workload = resolve_workload(name, batch, {**TINY_OVERRIDES[name], **options})
        unplanned = estimate(workload, config, device="cpu")
        ratio = f"{unplanned.breakdown.activations / unplanned.breakdown.weights:.0f}"
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
            floor = result.floor.peak_bytes
            rows.append([
                name, ratio, f"{int(cut * 100)}%", budget, plan.predicted_peak_bytes if plan.feasible else f"no fit ({plan.predicted_peak_bytes})",
                f"{floor}{' > budget' if floor > budget else ''}",
                measured if measured is not None else "-",
                "yes" if measured is not None and measured <= budget else ("-" if measured is None else "NO"),
                len(plan.segments), f"{overhead:.1f}", *baseline_cells, f"{result.solution.solve_seconds:.3f}", f"{seconds:.1f}",
            ])
            print(*rows[-1], sep="\t", file=sys.stderr, flush=True)
    headers = ["model", "act/weights", "cut", "budget B", "predicted B", "floor B", "measured B", "measured<=budget", "segments",
               "optimal %", *(f"{b} %" for b in BASELINES), "solve s", "plan s (closed loop)"]
    print(tabulate(rows, headers=headers))
    fitting = sum(1 for row in rows if isinstance(row[4], int) and row[7] != "NO")
    proven = sum(1 for row in rows if str(row[5]).endswith("> budget"))
    measured = "" if args.no_measure else ", each CPU-measured under budget"
    print(f"\n{fitting} of {len(rows)} cells fit{measured}; {proven} are out of reach of any checkpoint plan "
          f"(floor > budget); {len(rows) - fitting - proven} neither")


if __name__ == "__main__":
    main()
