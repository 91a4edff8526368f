"""The CPU time model's constants (memplan.timing.CPU), measured on this machine.

    python benchmarks/cpu_calibration.py [--threads 2] [--runs 15]

What each constant is and how it is measured: memplan/cpu_calibration.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from tabulate import tabulate

from memplan.cpu_calibration import measure_cpu_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = measure_cpu_model(args.runs)
    rows = [
        ["matmul FLOP/s (fp32)", f"{model.flops_per_s:.3g}"],
        ["element-wise bytes/s", f"{model.bytes_per_s:.3g}"],
        ["host seconds per op", f"{model.seconds_per_op:.2g}"],
        ["checkpoint: added seconds per segment (one call)", f"{model.checkpoint_seconds_per_segment:.2g}"],
        ["selective checkpoint: added seconds per segment", f"{model.selective_seconds_per_segment:.2g}"],
        ["checkpoint: added seconds per saved tensor", f"{model.checkpoint_seconds_per_saved_tensor:.2g}"],
        ["selective checkpoint: added seconds per op", f"{model.selective_seconds_per_op:.2g}"],
        ["selective checkpoint: added seconds per kept op", f"{model.selective_seconds_per_kept_op:.2g}"],
    ]
    rows += [[f"{name}: seconds per output byte", f"{value:.2g}"]
             for name, value in model.seconds_per_output_byte.items()]
    print(f"torch {torch.__version__}, {args.threads} threads")
    print(tabulate(rows, headers=["constant", "measured"]))


if __name__ == "__main__":
    main()
