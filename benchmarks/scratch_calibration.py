"""Measure, op by op, the bytes a CPU kernel allocates inside itself beyond its outputs, and check
memplan/scratch.py's rules against them.

A dispatch mode on real tensors wraps every aten op of a real training step (memplan/step.py) in a
profiler range; the CPU allocator's own events (torch.profiler, profile_memory=True) then land under
that range in the profiler's event tree. For each op:

    out      bytes of the storages it returns that none of its inputs shares (what the trace allocates)
    net      allocations minus frees inside the op (== out unless the kernel keeps or frees something)
    extra    peak of the running allocation total inside the op, minus `out`: the scratch that
             `memplan.estimate.simulate` adds on top of the live bytes once the outputs are allocated
    rule     what memplan/scratch.py gives for the op (evaluated afterwards on meta copies of the
             operands and outputs, laid out as they were)

Allocations that no op range encloses are listed separately (the Python argument parser's wrapped
numbers, created before the op is dispatched: the rules count them with the op).

    python benchmarks/scratch_calibration.py MODELS [PRECISIONS] [OPTIMIZERS] [--threads N]
            [--all] [--each] [--events OP,...]      per-op table (default: only rows that disagree)
    python benchmarks/scratch_calibration.py MODELS PRECISIONS OPTIMIZERS --diff
            the trace's live bytes against the real run's, op by op: where a tracer issue begins
    python benchmarks/scratch_calibration.py sweep:pointwise [--threads N]
            every pointwise aten op over dtype combinations (wrapped numbers, promotion copies)
    python benchmarks/scratch_calibration.py sweep:opinfo [--grad] [--threads N]
            every op of PyTorch's OpInfo database (torch.testing; needs `pip install expecttest`), its
            first 4 sample inputs in float32 and bfloat16 (--grad: and their backward): each aten op
            they dispatch, grouped by (op, dtypes), where the rule and the allocator disagree

MODELS are zoo names (tiny sizes, batch 2), comma-separated. By default ops are grouped by (op,
shapes, dtypes) and only groups whose extra differs from the rule, or whose net differs from out,
are printed; --all prints every group, --each every op call.
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

from memplan.scratch import scratch_of
from memplan.step import StepConfig, prepare_step, run_steps

_TAG = "memplan.calibrate#"
_NO_ALLOCATION = frozenset({"aten.detach.default", "aten.alias.default", "aten.t.default", "aten.view.default",
                            "aten._unsafe_view.default", "aten.expand.default", "aten.as_strided.default"})


@dataclass
class OpCall:
    index: int
    func: Any
    phase: str
    shapes: str
    dtypes: str
    out_bytes: int
    rule: int | None  # memplan/scratch.py's figure, filled in after the run
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

    activities = [torch.profiler.ProfilerActivity.CPU]
    config = StepConfig(precision=precision, optimizer=optimizer, steps=steps)
    with torch.profiler.profile(activities=activities, profile_memory=True) as prof, probe:
        run_steps(prepared, config, on_phase=on_phase)
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
        print(f"{c.func!s:42s} {c.shapes[:60]:60s} {c.dtypes:18s} {len(group):4d} {c.out_bytes:10d} {c.net:10d} "
              f"{c.extra:10d} {rule:>10s}{flag}  [{c.phase}]")
        if events_of and any(name in str(c.func) for name in events_of.split(",")):
            print("    events:", " ".join(f"{n:+d}" for n in c.events))
    if outside:
        allocs = [n for _, n in outside if n > 0]
        print(f"outside any op: {len(allocs)} allocations, {sum(allocs)} bytes: {allocs[:20]}")


def trace_diff(name: str, precision: str, optimizer: str, steps: int = 2) -> None:
    """Print where the live bytes the trace assumes before each op stop matching the real run's
    (difference real - trace, each time it changes). Ops are paired in order; the fake run's extra
    prim ops and the real run's extra detaches are skipped."""
    from memplan.devices import device_model
    from memplan.trace import trace_step
    from memplan.workload import resolve_workload
    from models import TINY_OVERRIDES

    workload = resolve_workload(name, 2, TINY_OVERRIDES.get(name, {}))
    config = StepConfig(precision=precision, optimizer=optimizer, steps=steps)
    trace = trace_step(workload, config, device_model("cpu").trace_rules(config))
    live_after: dict[int, int] = {}
    total = 0
    for event in trace.events:
        if event.kind in ("alloc", "free"):
            total += trace.storages[event.storage].nbytes * (1 if event.kind == "alloc" else -1)
            # the op that allocated, or the last op before the free (trace.py's Event takes it as
            # `op`; older versions passed it positionally into `nbytes`)
            live_after[event.op if event.op >= 0 else event.nbytes] = total
    fake_before, current = [], 0
    for index in range(len(trace.ops)):
        fake_before.append(current)
        current = live_after.get(index, current)

    torch.manual_seed(0)
    model, inputs = workload.build()
    prepared = prepare_step(model, inputs, config, "cpu")
    del model, inputs
    probe = Probe()
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, profile_memory=True) as prof, probe:
        run_steps(prepared, config)
    starts: dict[int, int] = {}
    memory: list[tuple[int, int]] = []

    def visit(node: Any) -> None:
        if node.typed[0] == _EventType.Allocation:
            memory.append((node.start_time_ns, node.typed[1].alloc_size))
            return
        if node.name.startswith(_TAG):
            starts[int(node.name[len(_TAG):])] = node.start_time_ns
        for child in node.children:
            visit(child)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        visit(root)
    memory.sort()
    real_before, k, total = [], 0, 0
    for index in range(len(probe.calls)):
        while k < len(memory) and memory[k][0] < starts[index]:
            total += memory[k][1]
            k += 1
        real_before.append(total)

    # Pair ops in order. Views and prim ops allocate nothing and differ between the runs (the fake
    # run queries devices, the real one detaches saved tensors): leave them out; otherwise look a few
    # ops ahead on either side before giving up.
    def significant(names: list[str]) -> list[int]:
        return [i for i, n in enumerate(names) if not n.startswith("prim.") and n not in _NO_ALLOCATION]

    real_names = [str(call.func) for call in probe.calls]
    fake_names = [op.name for op in trace.ops]
    real_ix = significant(real_names)
    first = next(op.index for op in trace.ops if op.phase == "forward")
    fake_ix = [i for i in significant(fake_names) if i >= first]
    pairs, a, b = [], 0, 0
    while a < len(real_ix) and b < len(fake_ix):
        if real_names[real_ix[a]] == fake_names[fake_ix[b]]:
            pairs.append((real_ix[a], fake_ix[b]))
            a, b = a + 1, b + 1
            continue
        ahead = next(((da, db) for da in range(4) for db in range(4) if (da or db) and a + da < len(real_ix)
                      and b + db < len(fake_ix) and real_names[real_ix[a + da]] == fake_names[fake_ix[b + db]]), None)
        if ahead is None:
            print(f"ops diverge: real #{real_ix[a]} {real_names[real_ix[a]]}, trace #{fake_ix[b]} "
                  f"{fake_names[fake_ix[b]]}")
            break
        a, b = a + ahead[0], b + ahead[1]
    print(f"{len(pairs)} ops paired")
    r0, f0 = pairs[0]
    previous = 0
    for ri, fi in pairs:
        difference = (real_before[ri] - real_before[r0]) - (fake_before[fi] - fake_before[f0])
        if difference != previous:
            op = trace.ops[fi]
            before = ", ".join(trace.ops[j].name for j in range(max(f0, fi - 3), fi))
            print(f"before {op.phase}{op.step} #{fi} {op.name}: real - trace = {difference:+d} "
                  f"(was {previous:+d}); preceding: {before}")
            previous = difference


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", help="zoo names, comma-separated, or sweep:pointwise")
    parser.add_argument("precisions", nargs="?", default="fp32")
    parser.add_argument("optimizers", nargs="?", default="sgd")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--all", action="store_true", help="print every (op, shapes) group")
    parser.add_argument("--each", action="store_true", help="print every op call")
    parser.add_argument("--events", metavar="OP", help="also print the allocator events inside ops named like OP")
    parser.add_argument("--diff", action="store_true", help="the trace's live bytes against the real run's")
    parser.add_argument("--grad", action="store_true", help="sweep:opinfo: run each sample's backward too")
    options = parser.parse_args()
    if options.threads:
        torch.set_num_threads(options.threads)
    if options.models == "sweep:pointwise":
        print(f"{sweep(_pointwise_ops())} mismatches")
        return
    if options.models == "sweep:opinfo":
        try:
            import expecttest  # noqa: F401 - torch.testing's OpInfo database imports it
        except ImportError:
            parser.error("sweep:opinfo needs expecttest (pip install expecttest)")
        print(f"{sweep_opinfo(options.grad)} (op, dtypes) groups disagree")
        return
    for name in options.models.split(","):
        for precision in options.precisions.split(","):
            for optimizer in options.optimizers.split(","):
                print(f"== {name} {precision} {optimizer} threads={torch.get_num_threads()}")
                if options.diff:
                    trace_diff(name, precision, optimizer, options.steps)
                    continue
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
    from memplan.scratch import measure

    rule = scratch_of("cpu")
    mismatches = 0
    for op in ops:
        arguments = op._schema.arguments
        for pattern in _OPERAND_PATTERNS:
            specs, position, ok = [], 0, True
            for argument in arguments:
                kind = str(argument.type)
                if kind in ("Tensor", "number"):
                    spec = pattern[min(position, len(pattern) - 1)]
                    if kind == "number" and isinstance(spec, str):
                        spec = 2.5 if "float" in spec else 2
                    if kind == "Tensor" and argument.name in ("mask", "condition"):
                        spec = "bool"
                    specs.append(spec)
                    position += 1
                elif argument.has_default_value() or argument.kwarg_only:
                    break
                else:
                    ok = False
                    break
            if not ok or not specs:
                break
            seen: list[tuple] = []

            def call(args: list, op: Any = op, seen: list = seen) -> Any:
                out = op(*args)
                seen.append((_to_meta(tuple(args), {}), _to_meta(out, {})))
                return out

            try:
                measured = measure(call, lambda specs=specs: [_operand(spec) for spec in specs])
            except (RuntimeError, TypeError, ValueError, IndexError, NotImplementedError):
                continue  # this op does not take this dtype combination
            args, out = seen[0]
            predicted = rule(op, args, {}, out)
            if measured.extra != predicted:
                mismatches += 1
                described = [f"{a.dtype}{list(a.shape)}" if isinstance(a, torch.Tensor) else repr(a) for a in args]
                print(f"{op!s:40s} {' '.join(described):60s} measured {measured.extra:6d} rule {predicted:6d}  "
                      f"events {' '.join(f'{n:+d}' for n in measured.events)}")
    return mismatches


def sweep_opinfo(grad: bool, samples_per_dtype: int = 4) -> int:
    """Run the samples of every OpInfo (torch/testing/_internal/common_methods_invocations.py) under the
    Probe; print each (aten op, dtypes) group with a call whose scratch the rule does not give, with the
    OpInfos that reached it and the first such call's events."""
    import warnings

    from torch.testing._internal.common_methods_invocations import op_db

    warnings.filterwarnings("ignore")
    disagree: dict[tuple[str, str], list[tuple[str, OpCall]]] = defaultdict(list)
    failed = 0  # samples that raise on this build (or are meant to)
    for info in op_db:
        for dtype in (torch.float32, torch.bfloat16):
            if dtype not in info.supported_dtypes("cpu"):
                continue
            samples = []
            try:
                samples = list(info.sample_inputs("cpu", dtype, requires_grad=grad and info.supports_autograd))
            except Exception:  # noqa: BLE001 - a sample generator this build cannot run
                failed += 1
            probe = Probe()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
                for sample in samples[:samples_per_dtype]:
                    with probe:
                        try:
                            _run_sample(info, sample, grad)
                        except Exception:  # noqa: BLE001
                            failed += 1
            try:
                attribute(prof, probe.calls)
                probe.evaluate_rules()
            except Exception as error:  # noqa: BLE001
                print(f"skipped {info.name} {dtype}: {type(error).__name__}: {error}")
                continue
            for call in probe.calls:
                if call.extra != (call.rule or 0):
                    disagree[(str(call.func), call.dtypes)].append((info.name, call))
    print(f"{failed} samples or sample generators raised")
    print(f"{'op':52s} {'dtypes':22s} {'calls':>5s} {'extra':>8s} {'rule':>8s}  first call: shapes; OpInfos")
    for (func, dtypes), found in sorted(disagree.items()):
        call = found[0][1]
        infos = ",".join(sorted({n for n, _ in found}))
        print(f"{func:52s} {dtypes:22s} {len(found):5d} {call.extra:8d} {call.rule or 0:8d}  {call.shapes[:40]}; {infos[:60]}")
        print(f"{'':52s} events {' '.join(f'{n:+d}' for n in call.events[:12])}")
    return len(disagree)


def _run_sample(info: Any, sample: Any, grad: bool) -> None:
    out = info.op(sample.input, *sample.args, **sample.kwargs)
    if not grad:
        return
    outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor) and o.requires_grad]
    if outs:
        torch.autograd.backward([(o.abs() if o.is_complex() else o.float()).sum() for o in outs])


if __name__ == "__main__":
    main()
