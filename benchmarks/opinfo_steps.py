"""Estimate vs the CPU allocator's truth for every differentiable op of PyTorch's OpInfo database.

    python benchmarks/opinfo_steps.py [--precision fp32|bf16] [--ops cumprod,take] [--samples 2]   # needs expecttest

Each OpInfo sample (float32 samples, cast by the precision) becomes a model: its differentiable
tensors are the model's parameters, its other tensors buffers, and the loss is the mean square of the
op's floating outputs; two training steps with SGD, estimated (`memplan.estimate`) and measured
(`memplan.verify.measure`, the profiler's memory events). A case is exact when the peak of every phase
is; a case whose estimate and real step both fail refuses as eager refuses. Prints the counts and one
row per case that is neither. Ops that draw from an RNG, make data-dependent shapes or sparse tensors
are left out (SKIPPED); OpInfo runs some random ops inside `freeze_rng_state`, whose 5,056 B state
tensor is made outside the dispatcher and so is never traced (those rows are the harness's own).
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from tabulate import tabulate
from torch import nn

from memplan.estimate import estimate
from memplan.step import StepConfig
from memplan.verify import measure
from memplan.workload import Workload

SKIPPED = ("sparse", "nn.functional.dropout", "bernoulli", "normal", "rand", "multinomial", "nn.functional.rrelu",
           "nonzero", "unique", "histc", "bincount", "masked_select", "item", "tolist")


class OpModel(nn.Module):
    """One OpInfo sample as a model: the sample's differentiable floating tensors are parameters, its
    other tensors buffers, its other arguments kept as they are."""

    def __init__(self, op: Any, sample: Any):
        super().__init__()
        self.op = op
        self.params, self.slots, tensors = nn.ParameterList(), [], []

        def lift(value: Any) -> Any:  # tensors -> ("tensor", index), in nested lists and tuples
            if isinstance(value, torch.Tensor):
                tensors.append(value)
                return ("tensor", len(tensors) - 1)
            if isinstance(value, (list, tuple)):
                return type(value)(lift(v) for v in value)
            return value

        self.spec = lift((sample.input, tuple(sample.args), dict(sample.kwargs)))
        for index, tensor in enumerate(tensors):
            if tensor.requires_grad and tensor.is_floating_point():
                self.slots.append(("param", len(self.params)))
                self.params.append(nn.Parameter(tensor.detach().clone()))
            else:
                self.slots.append(("buffer", index))
                self.register_buffer(f"b{index}", tensor.detach().clone(), persistent=False)

    def _tensor(self, index: int) -> torch.Tensor:
        kind, at = self.slots[index]
        return self.params[at] if kind == "param" else getattr(self, f"b{at}")

    def _unlift(self, value: Any) -> Any:
        if isinstance(value, tuple) and len(value) == 2 and value[0] == "tensor":
            return self._tensor(value[1])
        if isinstance(value, (list, tuple)):
            return type(value)(self._unlift(v) for v in value)
        if isinstance(value, dict):
            return {k: self._unlift(v) for k, v in value.items()}
        return value

    def forward(self, _unused: torch.Tensor) -> torch.Tensor:
        inputs, args, kwargs = self._unlift(self.spec)
        outputs = [t for t in _tensors_in(self.op(inputs, *args, **kwargs)) if t.requires_grad]
        return sum((t.abs() if t.is_complex() else t).float().square().mean() for t in outputs)


def _tensors_in(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() or value.is_complex() else []
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors_in(v)]
    return []


def cases(ops: set[str] | None, samples: int) -> list[tuple[str, Any, Any]]:
    """(name, op, sample) for the OpInfo samples that make a model with a gradient to take."""
    from torch.testing._internal.common_methods_invocations import op_db

    torch.backends.flags_frozen.__globals__["__allow_nonbracketed_mutation_flag"] = True  # op_db freezes them
    found = []
    for op in op_db:
        name = op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")
        if not op.supports_autograd or any(s in op.name for s in SKIPPED) or (ops and op.name not in ops):
            continue
        try:
            drawn = list(op.sample_inputs("cpu", torch.float32, requires_grad=True))[:samples]
        except Exception:  # noqa: BLE001, S112 - a sample generator OpInfo cannot run here: no case
            continue
        for number, sample in enumerate(drawn):
            try:
                model = OpModel(op, sample)
                loss = model(torch.zeros(1))
            except Exception:  # noqa: BLE001, S112 - a sample whose op fails eagerly as it stands: no case
                continue
            if len(model.params) and isinstance(loss, torch.Tensor) and loss.requires_grad:
                found.append((f"{name}#{number}", op, sample))
    return found


def _attempt(function: Any, *args: Any, **kwargs: Any) -> tuple[Any, str | None]:
    try:
        return function(*args, **kwargs), None
    except Exception as error:  # noqa: BLE001 - a row, not the end of the table
        return None, f"{type(error).__name__}: {str(error).splitlines()[0][:90] if str(error) else ''}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--ops", default="", help="OpInfo names, comma-separated (default: all)")
    parser.add_argument("--samples", type=int, default=2, help="samples per op")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    started = time.perf_counter()
    config = StepConfig(precision=args.precision, optimizer="sgd", steps=2)
    counts = {"exact": 0, "off": 0, "refused as eager refuses": 0, "estimate fails only": 0, "eager fails only": 0}
    rows = []
    for name, op, sample in cases(set(args.ops.split(",")) if args.ops else None, args.samples):
        workload = Workload(name, lambda batch_size=1, op=op, sample=sample: (OpModel(op, sample), (torch.zeros(1),)),
                            1, {})
        predicted, estimate_error = _attempt(estimate, workload, config, device="cpu")
        measured, eager_error = _attempt(measure, workload, config, device="cpu")
        if estimate_error or eager_error:
            kind = ("refused as eager refuses" if estimate_error and eager_error
                    else "estimate fails only" if estimate_error else "eager fails only")
            counts[kind] += 1
            if kind != "refused as eager refuses":
                rows.append([name, kind, "", estimate_error or eager_error])
            continue
        off = {phase: predicted.phase_peaks[phase] - measured.phase_peaks.get(phase, 0) for phase in predicted.phase_peaks}
        if any(off.values()):
            counts["off"] += 1
            rows.append([name, "off", measured.measured_peak_bytes,
                         " ".join(f"{phase} {bytes_:+,}" for phase, bytes_ in off.items() if bytes_)])
        else:
            counts["exact"] += 1
    print(f"# {args.precision}, SGD, 2 steps; {sum(counts.values())} cases in {time.perf_counter() - started:.0f} s")
    print(tabulate([counts.values()], headers=list(counts)))
    print()
    print(tabulate(rows, headers=["case", "result", "measured peak B", "estimate - measured, by phase (or error)"]))


if __name__ == "__main__":
    main()
