"""Host time that selective activation checkpointing adds per op: the constant behind
memplan.selective's SAC_SECONDS_PER_OP.

    python benchmarks/sac_overhead.py [--ops 400] [--runs 15] [--threads 2]

torch.utils.checkpoint's selective policies run two Python dispatch modes over every op of a segment:
one caches the kept outputs in forward, the other replays them in backward. Their cost is per op, not
per byte, so it is measured on a chain of ops on a one-element tensor (whose kernels cost almost
nothing): a segment that keeps every output (SAC) against the plain chain, and against a plain
checkpoint of the same chain (which recomputes it once). Per op: (SAC - plain) / ops, both passes.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from tabulate import tabulate
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts


def chain(x: torch.Tensor, ops: int) -> torch.Tensor:
    for _ in range(ops):
        x = x * 1.0001
    return x


def keep_everything(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE


def step(kind: str, ops: int) -> float:
    x = torch.ones(1, requires_grad=True)
    started = time.perf_counter()
    if kind == "plain":
        y = chain(x, ops)
    elif kind == "checkpoint":
        y = checkpoint(chain, x, ops, use_reentrant=False)
    else:
        y = checkpoint(chain, x, ops, use_reentrant=False,
                       context_fn=lambda: create_selective_checkpoint_contexts(keep_everything))
    y.sum().backward()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=400)
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kinds = ("plain", "checkpoint", "selective")
    seconds: dict[str, list[float]] = {kind: [] for kind in kinds}
    for round_ in range(args.runs + 1):
        for kind in kinds:  # interleaved, so load on the machine hits all three alike
            elapsed = step(kind, args.ops)
            if round_:  # the first round warms up
                seconds[kind].append(elapsed)
    median = {kind: statistics.median(values) for kind, values in seconds.items()}
    rows = [[kind, f"{1e3 * median[kind]:.2f}", f"{1e6 * (median[kind] - median['plain']) / args.ops:.1f}"] for kind in kinds]
    print(tabulate(rows, headers=["segment", "step ms (median)", "added us per op"]))


if __name__ == "__main__":
    main()
