"""How close a replayed plan (memplan.replay) comes to the estimator re-tracing the planned model.

    python benchmarks/replay.py [--models gpt2,llama2-7b,...] [--plans 6] [--seed 0]

Per model (the zoo at small sizes), precision and target device: random checkpoint plans drawn from the
selective planner's candidates (each block whole, or its sub-blocks, each checkpointed or not, with a
random policy of its family: full recompute or a set of kept op calls), each replayed from the unplanned
trace and estimated by re-tracing the model with the plan applied. Reports how many replayed peaks equal
the estimator's to the byte, the largest difference (replayed - estimated; negative: the replay is
short) and the time of each.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tabulate import tabulate

from memplan.emit import apply_plan
from memplan.estimate import estimate_and_trace
from memplan.plan import Plan, Segment
from memplan.replay import Timeline, estimate_replayed
from memplan.selective import profile_blocks
from memplan.step import StepConfig
from memplan.timing import time_model
from memplan.workload import resolve_workload
from models import TINY_OVERRIDES

SETTINGS = (("fp32", "cpu"), ("amp-bf16", "cpu"), ("amp-bf16", "cuda"))


def random_segments(blocks, rng: random.Random) -> tuple[Segment, ...]:
    """Each block whole or cut into its parts (a child, a run of children, or kept ops), each checkpointed
    with probability 1/2 and a random policy of its family."""
    segments = []
    for block in blocks:
        units = [((block.path,), block)]
        if block.parts and rng.random() < 0.5:
            units, first = [], 0
            while first <= max(p.last for p in block.parts):
                part = rng.choice([p for p in block.parts if p.first == first])
                units.append((part.modules, part.profile))
                first = part.last + 1
        for modules, profile in units:
            policies = [p for p in profile.policies if p.checkpointed]
            if modules and policies and rng.random() < 0.5:
                policy = rng.choice(policies)
                segments.append(Segment(modules, "selective" if policy.saved_ops else "full", policy.saved_ops))
    return tuple(segments)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt2,llama2-7b,bert-base,vit-b16,unet,resnet18")
    parser.add_argument("--plans", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rows = []
    for name in args.models.split(","):
        workload = resolve_workload(name, 4, dict(TINY_OVERRIDES[name]))
        for precision, device in SETTINGS:
            config = StepConfig(precision=precision, optimizer="sgd", steps=2)
            _, trace = estimate_and_trace(workload, config, device)
            _, blocks = profile_blocks(trace, device, time_model("h100"))
            timeline, rng = Timeline(trace), random.Random(args.seed)
            errors, replay_s, trace_s = [], [], []
            for _ in range(args.plans):
                segments = random_segments(blocks, rng)
                plan = Plan(model=workload.spec, batch_size=workload.batch_size, precision=precision,
                            optimizer="sgd", grad_accum=1, device=device, method="random", segments=segments,
                            feasible=True, budget_bytes=None, predicted_peak_bytes=0, unplanned_peak_bytes=0,
                            recompute_flops=0, step_flops=1)
                started = time.perf_counter()
                replayed, _ = estimate_replayed(workload, config, device, trace, plan, timeline)
                replay_s.append(time.perf_counter() - started)
                started = time.perf_counter()
                planned, _ = estimate_and_trace(workload, config, device, transform=lambda m, p=plan: apply_plan(m, p))
                trace_s.append(time.perf_counter() - started)
                errors.append((replayed.peak_bytes - planned.peak_bytes, planned.peak_bytes))
            worst = max(errors, key=lambda e: abs(e[0]))
            rows.append([name, precision, device, len(errors), sum(e == 0 for e, _ in errors), worst[0],
                         f"{100 * worst[0] / worst[1]:+.3f}", f"{1000 * statistics.median(replay_s):.0f}",
                         f"{1000 * statistics.median(trace_s):.0f}"])
            print("\t".join(map(str, rows[-1])), file=sys.stderr, flush=True)
    print(tabulate(rows, headers=["model", "precision", "device", "plans", "exact", "worst diff B", "worst %",
                                  "replay ms", "re-trace ms"]))
    exact = sum(r[4] for r in rows)
    total = sum(r[3] for r in rows)
    print(f"\n{exact} of {total} replayed peaks equal the estimator's to the byte")


if __name__ == "__main__":
    main()
