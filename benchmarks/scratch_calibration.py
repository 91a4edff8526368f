"""Measure, op by op, the bytes a CPU kernel allocates inside itself beyond its outputs.

A dispatch mode on real tensors wraps every aten op of a real training step (memplan/step.py) in a
profiler range; the CPU allocator's own events (torch.profiler, profile_memory=True) then land under
that range in the profiler's event tree. For each op:

    out      bytes of the storages it returns that none of its inputs shares (what the trace allocates)
    net      allocations minus frees inside the op (== out unless the kernel keeps or frees something)
    extra    peak of the running allocation total inside the op, minus `out`: the scratch that
             `memplan.estimate.simulate` adds on top of the live bytes once the outputs are allocated
    rule     what memplan/scratch.py predicts for the op ("-" where no rule exists)

Allocations that no op range encloses (the tracer cannot see them at all) are listed separately.

    python benchmarks/scratch_calibration.py lstm,unet fp32,bf16 sgd [--threads 1] [--all] [--each]

By default ops are grouped by (op, shapes, dtypes) and only groups whose extra or net differs from
what the rules and the trace assume are printed; --all prints every group, --each every op call.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch._C._profiler import _EventType
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from memplan.scratch import scratch_of  # noqa: E402
from memplan.step import StepConfig, prepare_step, run_steps  # noqa: E402

_TAG = "memplan.calibrate#"


@dataclass
class OpCall:
    index: int
    func: Any
    phase: str
    shapes: str
    dtypes: str
    out_bytes: int
    rule: int | None
    net: int = 0
    peak: int = 0  # running maximum of allocations minus frees inside the op
    events: tuple[int, ...] = ()  # the allocator events inside the op, in order (+alloc, -free)

    @property
    def extra(self) -> int:
        return max(0, self.peak - self.out_bytes)


def _describe(args: Any, kwargs: dict) -> tuple[str, str]:
    shapes, dtypes = [], []
    for value in tree_flatten((args, kwargs))[0]:
        if isinstance(value, torch.Tensor):
            shapes.append("x".join(map(str, value.shape)) or "()")
            dtypes.append(str(value.dtype).replace("torch.", ""))
        elif isinstance(value, (int, float, bool)) and not isinstance(value, bool):
            shapes.append(repr(value))
    return " ".join(shapes), ",".join(sorted(set(dtypes)))


def _to_meta(tree: Any, storages: dict[int, Any]) -> Any:
    """Meta tensors laid out like the tensors of `tree`, sharing storages as they do."""

    def convert(value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or value.device.type != "cpu":
            return value
        key = value.untyped_storage()._cdata
        if key not in storages:
            storages[key] = torch.empty(value.untyped_storage().nbytes(), dtype=torch.uint8,
                                        device="meta").untyped_storage()
        meta = torch.empty(0, dtype=value.dtype, device="meta")
        meta.set_(storages[key], value.storage_offset(), value.shape, value.stride())
        return meta

    return tree_map(convert, tree)


class Probe(TorchDispatchMode):
    """Runs each op for real inside a profiler range named after its index; keeps a meta copy of its
    operands and outputs to evaluate the rules on afterwards (rules may profile ops themselves)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[OpCall] = []
        self.metas: list[tuple] = []
        self.phase = "setup"

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        index = len(self.calls)
        storages: dict[int, Any] = {}
        before = _to_meta((args, kwargs), storages)  # before the op: in-place ops keep the layout
        with torch.profiler.record_function(f"{_TAG}{index}"):
            out = func(*args, **kwargs)
        from memplan.scratch import new_storage_bytes

        out_bytes = new_storage_bytes(out, (args, kwargs))
        shapes, dtypes = _describe(args, kwargs)
        self.calls.append(OpCall(index, func, self.phase, shapes, dtypes, out_bytes, None))
        self.metas.append((*before, _to_meta(out, storages)))
        return out

    def evaluate_rules(self) -> None:
        rule = scratch_of("cpu")
        for call, (args, kwargs, out) in zip(self.calls, self.metas):
            call.rule = int(rule(call.func, args, kwargs, out))


def _allocations(node: Any) -> list[tuple[int, int]]:
    """(time, bytes) of every allocator event under a profiler node."""
    found = []
    stack = list(node.children)
    while stack:
        child = stack.pop()
        if child.typed[0] == _EventType.Allocation:
            found.append((child.start_time_ns, child.typed[1].alloc_size))
        stack.extend(child.children)
    return found


def attribute(prof: Any, calls: list[OpCall]) -> list[tuple[int, int]]:
    """Fill net and peak of each call from the event tree; return allocations outside every op."""
    outside: list[tuple[int, int]] = []

    def visit(node: Any) -> None:
        if node.typed[0] == _EventType.Allocation:
            outside.append((node.start_time_ns, node.typed[1].alloc_size))
            return
        if node.name.startswith(_TAG):
            call = calls[int(node.name[len(_TAG):])]
            running = 0
            events = [nbytes for _, nbytes in sorted(_allocations(node), key=lambda e: e[0])]
            for nbytes in events:
                running += nbytes
                call.peak = max(call.peak, running)
            call.net, call.events = running, tuple(events)
            return
        for child in node.children:
            visit(child)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        visit(root)
    return outside


def calibrate(name: str, precision: str, optimizer: str, steps: int = 2) -> tuple[list[OpCall], list[tuple[int, int]]]:
    from memplan.workload import resolve_workload
    from models import TINY_OVERRIDES

    workload = resolve_workload(name, 2, TINY_OVERRIDES.get(name, {}))
    torch.manual_seed(0)
    model, inputs = workload.build()
    prepared = prepare_step(model, inputs, StepConfig(precision=precision, optimizer=optimizer, steps=steps), "cpu")
    del model, inputs
    probe = Probe()

    def on_phase(phase: str, step: int) -> None:
        probe.phase = f"{phase}{step}"

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        with probe:
            run_steps(prepared, StepConfig(precision=precision, optimizer=optimizer, steps=steps), on_phase=on_phase)
    outside = attribute(prof, probe.calls)
    probe.evaluate_rules()
    return probe.calls, outside


def report(calls: list[OpCall], outside: list[tuple[int, int]], show_all: bool, each: bool,
           events_of: str | None = None) -> None:
    header = f"{'op':42s} {'shapes':60s} {'dtype':18s} {'n':>4s} {'out':>10s} {'net':>10s} {'extra':>10s} {'rule':>10s}"
    print(header)
    rows: dict[tuple, list[OpCall]] = defaultdict(list)
    for call in calls:
        key = (call.index,) if each else (str(call.func), call.shapes, call.dtypes, call.out_bytes, call.net, call.extra,
                                          call.rule)
        rows[key].append(call)
    for group in rows.values():
        c = group[0]
        expected = c.rule or 0
        if not show_all and c.extra == expected and c.net == c.out_bytes:
            continue
        rule = str(c.rule)
        flag = "" if c.extra == expected else "  <-- scratch"
        if c.net != c.out_bytes:
            flag += "  <-- net!=out"
        print(f"{str(c.func):42s} {c.shapes[:60]:60s} {c.dtypes:18s} {len(group):4d} {c.out_bytes:10d} {c.net:10d} "
              f"{c.extra:10d} {rule:>10s}{flag}  [{c.phase}]")
        if events_of and any(name in str(c.func) for name in events_of.split(",")):
            print("    events:", " ".join(f"{n:+d}" for n in c.events))
    if outside:
        allocs = [n for _, n in outside if n > 0]
        print(f"outside any op: {len(allocs)} allocations, {sum(allocs)} bytes: {allocs[:20]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", help="zoo names, comma-separated; or 'sweep:pointwise' to sweep single ops")
    parser.add_argument("precisions", nargs="?", default="fp32")
    parser.add_argument("optimizers", nargs="?", default="sgd")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--all", action="store_true", help="print every (op, shapes) group")
    parser.add_argument("--each", action="store_true", help="print every op call")
    parser.add_argument("--events", metavar="OP", help="also print the allocator events inside ops named like OP")
    options = parser.parse_args()
    if options.threads:
        torch.set_num_threads(options.threads)
    if options.models == "sweep:pointwise":
        print(f"{sweep(_pointwise_ops())} mismatches")
        return
    for name in options.models.split(","):
        for precision in options.precisions.split(","):
            for optimizer in options.optimizers.split(","):
                print(f"== {name} {precision} {optimizer} threads={torch.get_num_threads()}")
                calls, outside = calibrate(name, precision, optimizer, options.steps)
                report(calls, outside, options.all, options.each, options.events)


# --------------------------------------------------------------------------------------------------
# Sweeping single ops: the rules against the allocator, dtype combination by combination


def _decomposes(op: Any) -> bool:
    """CompositeImplicitAutograd ops decompose before a dispatch mode (the tracer) sees them."""
    try:
        has = torch._C._dispatch_has_kernel_for_dispatch_key
        return not has(op.name(), "CPU") and has(op.name(), "CompositeImplicitAutograd")
    except RuntimeError:  # not a registered aten operator (Python-only overloads)
        return True


def _pointwise_ops() -> list[Any]:
    ops = []
    for name in dir(torch.ops.aten):
        try:
            packet = getattr(torch.ops.aten, name)
            overloads = packet.overloads()
        except (AttributeError, RuntimeError):
            continue
        for overload in overloads:
            op = getattr(packet, overload)
            # CompositeImplicitAutograd ops decompose before a dispatch mode (the tracer) sees them
            if torch.Tag.pointwise in op.tags and not _decomposes(op) and not any(
                    a.name == "out" for a in op._schema.arguments):
                ops.append(op)
    return ops


_OPERAND_PATTERNS = [
    # one entry per Tensor/Scalar argument, cycled: dtype (a tensor of shape (4, 8)), "0d:<dtype>", or a number
    ("float32", "float32", "float32"),
    ("bfloat16", "float32", "float32"),
    ("float32", "bfloat16", "bfloat16"),
    ("float32", 2.5, 2.5),
    ("bfloat16", 2, 2),
    ("int64", 2.5, 2.5),
    ("int64", 3, 3),
    ("float32", "0d:float32", "0d:float32"),
    ("bfloat16", "0d:float32", "0d:float32"),
    ("float64", "float32", "float32"),
]


def _operand(spec: Any) -> Any:
    if not isinstance(spec, str):
        return spec
    if spec.startswith("0d:"):
        return torch.ones((), dtype=getattr(torch, spec[3:])) * 2
    dtype = getattr(torch, spec)
    if dtype == torch.bool:
        return torch.rand(4, 8) > 0.5
    return (torch.rand(4, 8) + 1).to(dtype)


def sweep(ops: list[Any]) -> int:
    """Run each op over `_OPERAND_PATTERNS`; print where the rule and the allocator disagree."""
    from memplan.scratch import allocator_events, extra_bytes, new_storage_bytes

    rule = scratch_of("cpu")
    mismatches = 0
    for op in ops:
        arguments = op._schema.arguments
        for pattern in _OPERAND_PATTERNS:
            args, position, ok = [], 0, True
            for argument in arguments:
                kind = str(argument.type)
                if kind in ("Tensor", "number"):
                    spec = pattern[min(position, len(pattern) - 1)]
                    if kind == "number" and isinstance(spec, str):
                        spec = 2.5 if "float" in spec else 2
                    if kind == "Tensor" and argument.name in ("mask", "condition"):
                        spec = "bool"
                    args.append(_operand(spec))
                    position += 1
                elif argument.has_default_value() or argument.kwarg_only:
                    break
                else:
                    ok = False
                    break
            if not ok or not args:
                break
            try:
                events, out = allocator_events(lambda: op(*args))
            except Exception:
                continue
            measured = extra_bytes(events, new_storage_bytes(out, args))
            predicted = rule(op, tuple(args), {}, out)
            if measured != predicted:
                mismatches += 1
                described = [f"{a.dtype}{list(a.shape)}" if isinstance(a, torch.Tensor) else repr(a) for a in args]
                print(f"{str(op):40s} {' '.join(described):60s} measured {measured:6d} rule {predicted:6d}  "
                      f"events {' '.join(f'{n:+d}' for n in events)}")
    return mismatches


if __name__ == "__main__":
    main()
