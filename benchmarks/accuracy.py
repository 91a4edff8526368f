"""Estimate vs the CPU allocator's truth over the zoo at small sizes.

    python benchmarks/accuracy.py [--models gpt2,resnet18] [--precisions fp32,amp-bf16,bf16]
                                  [--optimizers sgd,sgd-momentum,adamw,adafactor] [--batch 2]

By default every precision and every optimizer that runs on the CPU (all but adamw-8bit).
Prints one row per model x precision x optimizer: predicted and measured peak, first step and later
steps, and the error in percent. The truth is `memplan.verify.measure(..., device="cpu")`: the
profiler's memory events, never the estimator.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tabulate import tabulate

from memplan.estimate import estimate
from memplan.step import OPTIMIZERS, PRECISIONS, StepConfig
from memplan.verify import measure
from memplan.workload import resolve_workload
from models import TINY_OVERRIDES, ZOO

FAMILIES = ("gpt2", "bert-base", "llama2-7b", "llama3-8b", "resnet18", "vit-b16", "mlp", "unet", "lstm")


def error(predicted: int, measured: int) -> float:
    return 100.0 * (predicted - measured) / measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(FAMILIES))
    parser.add_argument("--precisions", default=",".join(PRECISIONS))
    parser.add_argument("--optimizers", default=",".join(n for n, rule in OPTIMIZERS.items() if not rule.needs_cuda))
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    rows, worst, skipped, failures, mismatched = [], 0.0, 0, [], 0
    for name in args.models.split(","):
        if name not in ZOO:
            parser.error(f"unknown model {name}")
        for precision in args.precisions.split(","):
            for optimizer in args.optimizers.split(","):
                workload = resolve_workload(name, args.batch, TINY_OVERRIDES[name])
                config = StepConfig(precision=precision, optimizer=optimizer, steps=args.steps)
                started = time.perf_counter()
                predicted, prediction_error = _attempt(estimate, workload, config, device="cpu")
                seconds = time.perf_counter() - started
                measured, measurement_error = _attempt(measure, workload, config, device="cpu")
                if prediction_error or measurement_error:
                    # the step itself cannot run so (LSTM in fp16: oneDNN has no such primitive on this
                    # CPU): a row, not an error, where the estimator fails as the real step does
                    same = prediction_error == measurement_error
                    failures.append(f"{name} {precision} {optimizer}: estimate: {prediction_error or 'ran'}; "
                                    f"real step: {measurement_error or 'ran'}" + ("" if same else "  <- differ"))
                    mismatched += not same
                    print(failures[-1], file=sys.stderr, flush=True)
                    continue
                skipped += measured.skipped_updates
                first = error(predicted.first_step_peak_bytes, measured.first_step_peak_bytes)
                later = (
                    error(predicted.later_steps_peak_bytes, measured.later_steps_peak_bytes)
                    if measured.later_steps_peak_bytes
                    else 0.0
                )
                overall = error(predicted.peak_bytes, measured.measured_peak_bytes)
                worst = max(worst, abs(first), abs(later), abs(overall))
                rows.append([
                    name, precision, optimizer, predicted.peak_bytes, measured.measured_peak_bytes,
                    f"{overall:+.3f}", f"{first:+.3f}", f"{later:+.3f}", f"{seconds:.2f}",
                ])
                print(*rows[-1], sep="\t", file=sys.stderr, flush=True)
    headers = ["model", "precision", "optimizer", "predicted B", "measured B", "error %", "step 1 err %",
               "later err %", "estimate s"]
    print(tabulate(rows, headers=headers))
    within = sum(1 for r in rows if max(abs(float(r[5])), abs(float(r[6])), abs(float(r[7]))) <= 1.0)
    print(f"\n{within}/{len(rows)} rows within 1%; worst |error| {worst:.3f}%; "
          f"{skipped} steps run again after a skipped loss-scaled update")
    if failures:
        print(f"{len(failures)} settings the step cannot run in ({mismatched} where the estimator and the real "
              "step disagree about it):", *failures, sep="\n  ")


def _attempt(run, *args, **kwargs):
    """(run's result, None), or (None, the first line of what it raised)."""
    try:
        return run(*args, **kwargs), None
    except Exception as error:  # noqa: BLE001 - reported per row
        return None, f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"


if __name__ == "__main__":
    main()
