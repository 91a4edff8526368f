"""The CPU time model against measured step time, per kind of checkpoint segment.

    python benchmarks/cpu_time_model.py [--runs 10] [--threads 2] [--builtin]

The model's constants are measured on this machine first (memplan.cpu_calibration); --builtin prices
with memplan.timing.CPU's, measured on the CI machine.

On the 6-layer GPT of benchmarks/selective.py (d 256, batch 8), each probe plan checkpoints one kind
of segment in all six blocks: whole blocks, attention, MLP (full recompute), and the selective
policies plan_selective chooses at 30-50% budgets. Per plan: what the model adds to the step, split
into its terms (recomputed matmul FLOPs, element-wise bytes, host dispatch, checkpoint calls and hooks per saved
tensor, the selective policy's dispatch per op it sees and per op it keeps), and the measured extra seconds of one fp32 SGD step
(the median over --runs rounds of planned - unplanned, the models taking turns).

A second table: what a selective policy adds per op, by the size of the op's output, on a chain of 50
multiplications (which save nothing, so backward recomputes nothing): keeping every output (MUST_SAVE)
and recomputing every one (PREFER_RECOMPUTE), against the plain chain. The model's policy cost is per
op, whatever the size.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
import torch
from selective import timed_rounds, workloads
from tabulate import tabulate
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from memplan.closed_loop import EstimateCache
from memplan.cpu_calibration import measure_cpu_model
from memplan.plan import Segment
from memplan.selective import plan_selective
from memplan.step import StepConfig
from memplan.timing import CPU, bytes_moved, output_bytes, plan_checkpoint_seconds

TERMS = ("matmul", "element-wise", "dispatch", "hooks", "policy")


def modelled_terms(trace, model) -> np.ndarray:
    """Step 0's modelled seconds by term: FLOPs, element-wise bytes, host dispatch (memplan.timing.op_seconds)."""
    terms = np.zeros(3)
    for op in trace.ops:
        if op.step != 0:
            continue
        variant = f"{op.name}[{op.variant}]"
        key = variant if op.variant and variant in model.seconds_per_output_byte else op.name
        terms += (op.flops / model.flops_per_s,
                  max(bytes_moved(trace, op) / model.bytes_per_s,
                      output_bytes(trace, op) * model.seconds_per_output_byte.get(key, 0.0)),
                  model.seconds_per_op)
    return terms


def checkpoint_terms(trace, plan, model) -> np.ndarray:
    """memplan.timing.plan_checkpoint_seconds in two: the checkpoint calls and the hooks per saved tensor, and
    the selective policy's share (per call, per op it sees and per op it keeps)."""
    hooks = plan_checkpoint_seconds(trace, plan, replace(model, selective_seconds_per_segment=0.0,
                                                         selective_seconds_per_op=0.0, selective_seconds_per_kept_op=0.0))
    return np.array([hooks, plan_checkpoint_seconds(trace, plan, model) - hooks])


def probe_plans(workload, config, cache, unplanned_peak, model=CPU):
    """Each kind of segment in all six blocks: full ones, and every selective policy plan_selective chose."""
    chosen: dict[tuple, None] = {}  # (segment's paths relative to its block, saved ops), in order
    for fraction in (0.3, 0.4, 0.5):
        for processor in ("cpu", "h100"):
            result = plan_selective(workload, config, int(fraction * unplanned_peak), device="cpu",
                                    processor=model if processor == "cpu" else processor, cache=cache)
            for segment in result.plan.segments:
                if segment.policy == "selective":
                    relative = tuple(path.split(".", 2)[-1] for path in segment.modules)  # "h.3.ln_2" -> "ln_2"
                    chosen[(relative, segment.saved_ops)] = None
    kinds = {
        "whole blocks": [("",)], "ln_1+attn": [("ln_1", "attn")], "attn": [("attn",)],
        "ln_2+mlp": [("ln_2", "mlp")], "mlp": [("mlp",)],
    }
    segments = {f"{name} (full)": [Segment(tuple(f"h.{i}.{m}".rstrip(".") for m in runs[0])) for i in range(6)]
                for name, runs in kinds.items()}
    for relative, saved in chosen:
        whole = relative[0].isdigit()  # the block itself ("h.3" -> "3")
        label = f"{'whole blocks' if whole else '+'.join(relative)} saving {len(saved)} ops"
        segments[label] = [Segment((f"h.{i}",) if whole else tuple(f"h.{i}.{m}" for m in relative), "selective", saved)
                           for i in range(6)]
    return segments, result.plan


def measured_extra(workload, config, plans, runs: int) -> tuple[list[float], float]:
    """Median extra seconds of each plan's step over the unplanned one's (per round), and the unplanned median."""
    unplanned, *timed = timed_rounds(workload, config, plans, runs)
    extra = [statistics.median(t - u for t, u in zip(rounds, unplanned)) for rounds in timed]
    return extra, statistics.median(unplanned)


CHAIN_OPS = 50


def policy_cost_by_size(runs: int) -> list[tuple]:
    """Per op of a 50-op chain: host seconds a selective policy adds over the plain chain, by output size."""
    def chain(x: torch.Tensor) -> torch.Tensor:
        for _ in range(CHAIN_OPS):
            x = x * 1.0001  # saves nothing for backward: a plain checkpoint recomputes nothing
        return x

    def policy(choice):
        return lambda: create_selective_checkpoint_contexts(lambda ctx, op, *args, **kwargs: choice)

    rows = []
    for elements in (1, 1 << 14, 1 << 18, 1 << 20):
        x = torch.ones(elements, requires_grad=True)
        kinds = {
            "plain": lambda x=x: chain(x).sum().backward(),
            "MUST_SAVE": lambda x=x: checkpoint(chain, x, use_reentrant=False,
                                                context_fn=policy(CheckpointPolicy.MUST_SAVE)).sum().backward(),
            "PREFER_RECOMPUTE": lambda x=x: checkpoint(chain, x, use_reentrant=False,
                                                       context_fn=policy(CheckpointPolicy.PREFER_RECOMPUTE)).sum().backward(),
        }
        seconds: dict[str, list[float]] = {kind: [] for kind in kinds}
        for round_ in range(runs + 1):
            for kind, step in kinds.items():  # interleaved
                started = time.perf_counter()
                step()
                if round_:
                    seconds[kind].append(time.perf_counter() - started)
        median = {kind: statistics.median(values) for kind, values in seconds.items()}
        rows.append((elements * 4, *(f"{1e6 * (median[k] - median['plain']) / CHAIN_OPS:.1f}"
                                     for k in ("MUST_SAVE", "PREFER_RECOMPUTE"))))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--builtin", action="store_true", help="price with memplan.timing.CPU, not a model measured now")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = StepConfig(precision="fp32", optimizer="sgd", steps=2)
    (_, workload), = list(workloads(["gpt-d256"], 8))
    cache = EstimateCache()
    unplanned, trace = cache.estimate(workload, config, "cpu")
    model = CPU if args.builtin else measure_cpu_model()
    segments, template = probe_plans(workload, config, cache, unplanned.peak_bytes, model)
    plans = [replace(template, segments=tuple(s), method="probe") for s in segments.values()]
    base = modelled_terms(trace, model)
    terms = np.array([np.r_[modelled_terms(cache.realise(workload, config, "cpu", plan)[1], model) - base,
                            checkpoint_terms(trace, plan, model)] for plan in plans])
    measured, unplanned_seconds = measured_extra(workload, config, plans, args.runs)
    rows = [(label, *(f"{1e3 * t:.2f}" for t in row), f"{1e3 * row.sum():.2f}", f"{1e3 * m:.2f}",
             f"{1e3 * (m - row.sum()):+.2f}") for label, row, m in zip(segments, terms, measured)]
    print(f"CPU model: {model.description}")
    print(f"unplanned step: measured {1e3 * unplanned_seconds:.1f} ms (median), modelled {1e3 * base.sum():.1f} ms")
    print(tabulate(rows, headers=["6 segments of", *(f"{t} ms" for t in TERMS), "model ms", "measured ms",
                                  "measured - model"]))
    print()
    print(tabulate(policy_cost_by_size(args.runs), headers=["output bytes", "MUST_SAVE adds us/op",
                                                            "PREFER_RECOMPUTE adds us/op"]))


if __name__ == "__main__":
    main()
