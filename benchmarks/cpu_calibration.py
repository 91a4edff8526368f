"""The CPU time model's constants (memplan.timing.CPU), measured on this machine.

    python benchmarks/cpu_calibration.py [--threads 2] [--runs 15]

Each the median of --runs timed calls after a warm-up, fp32:
- matmul FLOP/s: matmuls of transformer shapes (tokens x d x 4d);
- bytes/s: memory-bound element-wise ops (add, mul, copy) on tensors of 1-16 MiB, counting each op's
  inputs and output;
- seconds per output byte of the element-wise ops that compute far more per element than they move
  (random numbers, transcendental functions, normalisations), on a 4 MiB tensor: dropout's mask costs
  a hundred times an add on a CPU, so recomputing it is not cheap there;
- host seconds per op: a chain of ops on a one-element tensor, whose kernels cost almost nothing;
- host seconds a checkpoint adds per tensor autograd saves inside it (its pack and unpack hooks): a
  chain of sin (each saves its input) checkpointed, against the plain chain and its recomputation;
- host seconds selective checkpointing adds per op: a chain of ops that save nothing, in a segment that
  keeps every output (create_selective_checkpoint_contexts), against the plain chain, forward and
  backward together. torch.utils.checkpoint runs two Python dispatch modes over every op of such a
  segment: one caches kept outputs in forward, the other replays them in backward; their cost is per
  op, not per byte.
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import torch
from tabulate import tabulate
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

CHAIN_OPS = 400


def median_seconds(fn, runs: int) -> float:
    fn()
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def matmul_flops_per_s(runs: int) -> float:
    rates = []
    for m, k, n in ((1024, 256, 1024), (1024, 1024, 256), (4096, 256, 768), (2048, 512, 2048)):
        a, b = torch.randn(m, k), torch.randn(k, n)
        rates.append(2 * m * k * n / median_seconds(partial(torch.mm, a, b), runs))
    return statistics.median(rates)


def elementwise_bytes_per_s(runs: int) -> float:
    rates = []
    for numel in (2**18, 2**20, 2**22):
        x, y = torch.randn(numel), torch.randn(numel)
        for fn, tensors in ((partial(torch.add, x, y), 3), (partial(torch.mul, x, y), 3),
                            (partial(torch.clone, x), 2)):  # tensors: inputs and output
            rates.append(tensors * 4 * numel / median_seconds(fn, runs))
    return statistics.median(rates)


def compute_heavy_seconds_per_byte(runs: int) -> dict[str, float]:
    """Per aten op, seconds per byte of output on a 4 MiB fp32 tensor (rows of 128 where it reduces)."""
    x, y = torch.randn(2**20), torch.randn(2**20)
    rows = x.view(-1, 128)
    ops = {
        "aten.bernoulli_.float": lambda: x.clone().bernoulli_(0.9),  # less the clone's time, below
        "aten.native_dropout.default": partial(torch.native_dropout, x, 0.1, True),
        "aten.gelu.default": partial(torch.nn.functional.gelu, x),
        "aten.gelu.default[tanh]": partial(torch.nn.functional.gelu, x, approximate="tanh"),
        "aten.silu.default": partial(torch.nn.functional.silu, x),
        "aten.sigmoid.default": partial(torch.sigmoid, x),
        "aten.tanh.default": partial(torch.tanh, x),
        "aten.exp.default": partial(torch.exp, x),
        "aten.erf.default": partial(torch.erf, x),
        "aten.rsqrt.default": partial(torch.rsqrt, x),
        "aten._softmax.default": partial(torch.softmax, rows, -1),
        "aten._safe_softmax.default": partial(torch.ops.aten._safe_softmax, rows, -1),
        "aten._log_softmax.default": partial(torch.log_softmax, rows, -1),
        "aten.native_layer_norm.default": partial(torch.nn.functional.layer_norm, rows, (128,)),
        "aten.where.self": partial(torch.where, x > 0, x, y),
    }
    clone = median_seconds(partial(torch.clone, x), runs)
    per_byte = {}
    for name, fn in ops.items():
        seconds = median_seconds(fn, runs) - (clone if name == "aten.bernoulli_.float" else 0.0)
        per_byte[name] = seconds / x.nbytes
    return per_byte


def chain(x: torch.Tensor) -> torch.Tensor:
    for _ in range(CHAIN_OPS):
        x = x * 1.0001  # saves no tensor for backward
    return x


def saving_chain(x: torch.Tensor) -> torch.Tensor:
    for _ in range(CHAIN_OPS):
        x = torch.sin(x)  # saves its input for backward
    return x


def keep_everything(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE


def step(kind: str) -> None:
    x = torch.ones(1, requires_grad=True)
    if kind == "plain":
        y = chain(x)
    elif kind == "checkpoint":
        y = checkpoint(chain, x, use_reentrant=False)
    else:
        y = checkpoint(chain, x, use_reentrant=False,
                       context_fn=lambda: create_selective_checkpoint_contexts(keep_everything))
    y.sum().backward()


def per_saved_tensor(runs: int) -> float:
    x = torch.ones(1, requires_grad=True)
    plain = median_seconds(lambda: saving_chain(x).sum().backward(), runs)
    checkpointed = median_seconds(lambda: checkpoint(saving_chain, x, use_reentrant=False).sum().backward(), runs)
    recompute = median_seconds(lambda: saving_chain(x), runs)
    return (checkpointed - plain - recompute) / CHAIN_OPS


def host_seconds(runs: int) -> tuple[float, float, float]:
    """(per op forward, per op that plain checkpointing adds, per op that selective checkpointing adds)."""
    x = torch.ones(1)
    forward = median_seconds(lambda: chain(x), runs) / CHAIN_OPS
    kinds = ("plain", "checkpoint", "selective")
    seconds: dict[str, list[float]] = {kind: [] for kind in kinds}
    for round_ in range(runs + 1):
        for kind in kinds:  # interleaved, so load on the machine hits all three alike
            started = time.perf_counter()
            step(kind)
            if round_:  # the first round warms up
                seconds[kind].append(time.perf_counter() - started)
    median = {kind: statistics.median(values) for kind, values in seconds.items()}
    return (forward, (median["checkpoint"] - median["plain"]) / CHAIN_OPS,
            (median["selective"] - median["plain"]) / CHAIN_OPS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    per_op, checkpoint_per_op, selective_per_op = host_seconds(args.runs)
    rows = [
        ["matmul FLOP/s (fp32)", f"{matmul_flops_per_s(args.runs):.3g}"],
        ["element-wise bytes/s", f"{elementwise_bytes_per_s(args.runs):.3g}"],
        ["host seconds per op", f"{per_op:.2g}"],
        ["plain checkpoint: added seconds per op", f"{checkpoint_per_op:.2g}"],
        ["checkpoint: added seconds per saved tensor", f"{per_saved_tensor(args.runs):.2g}"],
        ["selective checkpoint: added seconds per op", f"{selective_per_op:.2g}"],
    ]
    rows += [[f"{name}: seconds per output byte", f"{value:.2g}"]
             for name, value in compute_heavy_seconds_per_byte(args.runs).items()]
    print(f"torch {torch.__version__}, {args.threads} threads")
    print(tabulate(rows, headers=["constant", "measured"]))


if __name__ == "__main__":
    main()
