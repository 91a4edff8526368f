"""The CPU time model's constants (memplan.timing.TimeModel), measured on the machine that runs this.

Each is the median of `runs` timed calls after a warm-up, fp32, on torch's current thread count:
- matmul FLOP/s: matmuls of transformer shapes (tokens x d x 4d);
- bytes/s: memory-bound element-wise ops (add, mul, copy) on tensors of 1-16 MiB, counting each op's
  inputs and output;
- seconds per output byte of the element-wise ops that compute far more per element than they move
  (random numbers, transcendental functions, normalisations), on a 4 MiB tensor: dropout's mask costs
  fifty to a hundred times an add on a CPU, so recomputing it is not cheap there;
- checkpointing's host time, on chains of ops on a one-element tensor, whose kernels cost almost
  nothing (one interleaved set of runs, so that load on the machine hits every kind alike):
  - per op: a chain of multiplications run forward;
  - per segment (one checkpoint call, as memplan.emit's runtime makes it): a chain of sin split into
    SEGMENTS modules, each checkpointed alone, against the same modules in one module checkpointed
    once, each less the same modules run plain; with a selective policy keeping nothing, the same;
  - per tensor autograd saves inside a checkpoint (its pack and unpack hooks): a chain of sin (each
    saves its input) checkpointed, less the plain chain and its recomputation;
  - per op a selective policy sees: the sin chain under a policy that recomputes every op, less the
    plain checkpoint, which recomputes the same. torch.utils.checkpoint runs a Python dispatch mode
    over every op of the segment's forward, and another over every op of its recomputation;
  - per op a selective policy keeps: the sin chain under a policy that keeps every output, less the
    plain chain, the hooks and the policy's dispatch. Backward still runs the segment's forward again,
    and each kept op is dispatched there to hand back its cached output.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from functools import partial
from types import MappingProxyType

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from memplan.emit import checkpoint_segment
from memplan.timing import CPU_NAME, TimeModel

CHAIN_OPS = 400
SEGMENTS = 100  # checkpoint calls the chain is split into, to price one


def measure_cpu_model(runs: int = 15) -> TimeModel:
    """This CPU's time model, measured now (about ten seconds)."""
    host = host_seconds(runs)
    return TimeModel(
        CPU_NAME, flops_per_s=matmul_flops_per_s(runs), bytes_per_s=elementwise_bytes_per_s(runs), serial=True,
        seconds_per_op=host["op"], checkpoint_seconds_per_segment=host["segment"],
        selective_seconds_per_segment=host["selective segment"], checkpoint_seconds_per_saved_tensor=host["saved tensor"],
        selective_seconds_per_op=host["selective op"], selective_seconds_per_kept_op=host["kept op"],
        seconds_per_output_byte=MappingProxyType(compute_heavy_seconds_per_byte(runs)),
        measured_on="this machine",
    )


def median_seconds(fn: Callable[[], object], runs: int) -> float:
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
        "aten.bernoulli_.Tensor": lambda: x.clone().bernoulli_(torch.full((), 0.9)),
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
    return {name: (median_seconds(fn, runs) - (clone if name.startswith("aten.bernoulli_") else 0.0)) / x.nbytes
            for name, fn in ops.items()}


def _multiplications(x: torch.Tensor) -> torch.Tensor:
    for _ in range(CHAIN_OPS):
        x = x * 1.0001
    return x


class _Sines(nn.Module):
    def __init__(self, ops: int) -> None:
        super().__init__()
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.ops):
            x = torch.sin(x)  # saves its input for backward
        return x


_sines = _Sines(CHAIN_OPS)


def _segments(count: int, saved_ops: tuple | None, checkpointed: bool) -> nn.Module:
    """CHAIN_OPS sines in `count` modules, each checkpointed alone (saved_ops as emitted code passes them)."""
    chain = nn.Sequential(*(_Sines(CHAIN_OPS // count) for _ in range(count)))
    for module in chain if checkpointed else ():
        checkpoint_segment([module], saved_ops)
    return chain


def _every_op(choice: CheckpointPolicy) -> Callable:
    return lambda: create_selective_checkpoint_contexts(lambda ctx, op, *args, **kwargs: choice)


def host_seconds(runs: int) -> dict[str, float]:
    """Host seconds: per op, per checkpoint call (and more for a selective one), per saved tensor in a
    checkpoint, per op a selective policy sees, per op it keeps."""
    x = torch.ones(1, requires_grad=True)
    # one checkpoint call against SEGMENTS, plainly and with a selective policy that keeps nothing
    split = {f"{label} x{count}": _segments(count, saved_ops, checkpointed) for count in (1, SEGMENTS)
             for label, saved_ops, checkpointed in (("plain", None, False), ("checkpoint", None, True),
                                                    ("selective", (), True))}
    kinds = {
        "forward": lambda: _multiplications(x.detach()),
        "sines": lambda: _sines(x.detach()),
        "plain": lambda: _sines(x).sum().backward(),
        "checkpoint": lambda: checkpoint(_sines, x, use_reentrant=False).sum().backward(),
        "recompute all": lambda: checkpoint(_sines, x, use_reentrant=False,
                                            context_fn=_every_op(CheckpointPolicy.PREFER_RECOMPUTE)).sum().backward(),
        "keep all": lambda: checkpoint(_sines, x, use_reentrant=False,
                                       context_fn=_every_op(CheckpointPolicy.MUST_SAVE)).sum().backward(),
        **{key: partial(lambda chain: chain(x).sum().backward(), chain) for key, chain in split.items()},
    }
    seconds: dict[str, list[float]] = {kind: [] for kind in kinds}
    for round_ in range(runs + 1):
        for kind, fn in kinds.items():
            started = time.perf_counter()
            fn()
            if round_:  # the first round warms up
                seconds[kind].append(time.perf_counter() - started)
    median = {kind: statistics.median(values) for kind, values in seconds.items()}
    per_op = {kind: value / CHAIN_OPS for kind, value in median.items()}

    def per_call(label: str) -> float:
        added = {count: median[f"{label} x{count}"] - median[f"plain x{count}"] for count in (1, SEGMENTS)}
        return (added[SEGMENTS] - added[1]) / (SEGMENTS - 1)

    segment = max(0.0, per_call("checkpoint"))
    # differences of medians: on a loaded machine one may come out below zero, which no cost is
    saved_tensor = max(0.0, per_op["checkpoint"] - per_op["plain"] - per_op["sines"])
    selective_op = max(0.0, per_op["recompute all"] - per_op["checkpoint"])
    return {
        "op": per_op["forward"],
        "segment": segment,
        "selective segment": max(0.0, per_call("selective") - segment),
        "saved tensor": saved_tensor,
        "selective op": selective_op,
        "kept op": max(0.0, per_op["keep all"] - per_op["plain"] - saved_tensor - selective_op),
    }
