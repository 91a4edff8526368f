"""The peak floor (memplan.planner.peak_floor) against plans: no plan's peak may lie under it.

    python benchmarks/floor.py [--models zoo|hf|NAME,...] [--plans 4] [--batch 4]
                               [--precision fp32] [--optimizer sgd] [--grad-accum 1] [--device cpu]

Per model (`zoo`: the zoo at small sizes; `hf`: benchmarks/hf_architectures.py's Hugging Face
architectures, which need transformers, built with use_cache=False as for checkpointing): random
checkpoint plans (disjoint segments drawn from the block-level planner's candidates at any depth,
modules and runs of siblings), each estimated with the plan applied, and the lowest plan of each
planner (budget 0: block level, and selective without a baseline). Reports the floor, the lowest predicted peak of them all, their ratio (1: the floor is that
plan's peak; how close it comes is how much it can prove), and how many plans lie under the floor, which
would disprove it. Two steps of --precision and --optimizer, on --device's allocator model (plans and
the floor on the same one). A model that fails is a row saying why.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tabulate import tabulate

from memplan.devices import device_model
from memplan.emit import apply_plan
from memplan.errors import BadInput
from memplan.estimate import estimate, estimate_and_trace
from memplan.planner import peak_floor, plan_checkpoints, random_plan
from memplan.selective import plan_selective
from memplan.step import StepConfig
from memplan.workload import Workload, resolve_workload
from models import TINY_OVERRIDES


def workloads(names: str, batch: int) -> list[Workload]:
    if names == "hf":
        try:
            import transformers  # noqa: F401 - hf_architectures builds its models with it
        except ImportError:
            raise BadInput("--models hf needs Hugging Face transformers (pip install transformers)") from None
        import hf_architectures

        return [Workload(name, hf_architectures.without_cache(build), batch, {})
                for name, build in hf_architectures.MODELS.items()]
    chosen = list(TINY_OVERRIDES) if names == "zoo" else names.split(",")
    return [resolve_workload(name, batch, TINY_OVERRIDES.get(name, {})) for name in chosen]


def random_plan_peaks(workload: Workload, config: StepConfig, device: str, trace, unplanned, plans: int,
                      rng: random.Random) -> list[int]:
    peaks = []
    for _ in range(plans):
        plan = random_plan(workload, config, device, trace, unplanned, rng)
        peaks.append(estimate(workload, config, device, transform=lambda m, plan=plan: apply_plan(m, plan)).peak_bytes)
    return peaks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="zoo")
    parser.add_argument("--plans", type=int, default=4, help="random plans per model")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--optimizer", default="sgd")
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = parser.parse_args()
    try:
        config = StepConfig(precision=args.precision, optimizer=args.optimizer, grad_accum=args.grad_accum, steps=2)
        chosen = workloads(args.models, args.batch)
    except BadInput as error:
        parser.error(str(error))
    device = args.device
    rows, disproved = [], 0
    for workload in chosen:
        started = time.perf_counter()
        try:
            unplanned, trace = estimate_and_trace(workload, config, device)
            floor = peak_floor(trace, device_model(device))
            peaks = random_plan_peaks(workload, config, device, trace, unplanned, args.plans, random.Random(workload.spec))
            peaks.append(plan_checkpoints(workload, config, 0, device=device).plan.predicted_peak_bytes)
            peaks.append(plan_selective(workload, config, 0, device=device, baselines=()).plan.predicted_peak_bytes)
        except Exception as error:  # noqa: BLE001 - a row says what failed, the others still run
            rows.append([workload.spec, "-", "-", "-", "-", "-", "-", f"{type(error).__name__}: {str(error)[:80]}"])
            continue
        under = sum(peak < floor.peak_bytes for peak in peaks)
        disproved += under > 0
        rows.append([workload.spec, unplanned.peak_bytes, floor.peak_bytes, min(peaks),
                     f"{floor.peak_bytes / min(peaks):.3f}", len(peaks), under, f"{time.perf_counter() - started:.0f}"])
    print(tabulate(rows, headers=["model", "unplanned B", "floor B", "lowest plan B", "floor / lowest", "plans",
                                  "under the floor", "s"]))
    print(f"\n{disproved} of {len(rows)} models have a plan under the floor")


if __name__ == "__main__":
    main()
