"""Trace a training step under fake tensors: every aten op, every storage it allocates, and the
moment eager PyTorch frees it.

The step of memplan/step.py runs for real under `FakeTensorMode`, so no weight or activation memory
is allocated. A dispatch mode above the fake mode sees each aten op; an output storage that no input
shares is a new allocation, and a weak reference to it fires exactly when eager PyTorch would free it
(when the last Python or autograd reference goes). That is what makes the trace match the allocator:
outputs that Python holds (logits, the loss) live as long as they really do, not merely until their
last use in the graph.

What the trace cannot see, the rules of the target device add: scratch that kernels allocate inside
themselves (`memplan.devices`), CUDA's optimizer defaults and autocast op lists.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import networkx as nx
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from memplan.step import PreparedStep, StepConfig, prepare_step, run_steps
from memplan.workload import Workload

ROLES = ("weights", "gradients", "optimizer_state", "activations", "temporaries", "inputs")

# Ops whose output shape depends on data. Policy: every element is selected (an upper bound), and
# the estimate is marked approximate, naming the op.
_DATA_DEPENDENT = {torch.ops.aten.nonzero.default, torch.ops.aten.masked_select.default}
# Writes to its `found_inf` argument: reading it back (GradScaler) must say "no overflow".
_FOUND_INF_WRITERS = {torch.ops.aten._amp_foreach_non_finite_check_and_unscale_.default}


@dataclass(frozen=True)
class Op:
    """One aten op as eager PyTorch runs it."""

    index: int
    name: str  # "aten.mm.default"
    phase: str  # "forward", "backward", "optimizer"
    step: int
    module: str  # innermost module path running it ("" for the top level)
    flops: int
    reads: tuple[int, ...]  # storage ids of its tensor inputs
    writes: tuple[int, ...]  # storage ids its schema says it mutates in place (add_, relu_, copy_, ...)
    allocates: tuple[int, ...]  # storage ids it creates
    scratch_bytes: int  # kernel-internal scratch, allocated and freed inside the op (device rule)
    # autograd's gradient accumulation, which eager PyTorch does in place (see _is_grad_accumulation)
    accumulates_in_place: bool = False


def _rnn_layer_flops(input: torch.Tensor, w_ih: torch.Tensor, w_hh: torch.Tensor, *_) -> int:
    """One RNN layer's forward: the input and hidden matrix products at every step, 2 FLOPs per multiply-add."""
    return 2 * (input.numel() // input.shape[-1]) * (w_ih.numel() + w_hh.numel())


# FLOP formulas for ops that torch.utils.flop_counter has none for, by the same convention (its registry first)
MORE_FLOPS = {
    torch.ops.aten.mkldnn_rnn_layer: _rnn_layer_flops,
    # gradients of the input and of both weights: twice the forward's products
    torch.ops.aten.mkldnn_rnn_layer_backward: lambda *args: 2 * _rnn_layer_flops(*args),
}


@dataclass(frozen=True)
class Storage:
    id: int
    nbytes: int
    role: str  # one of ROLES
    allocated_by: int | None  # op index; None: live before the step began
    module: str  # module path of the op that allocated it


@dataclass(frozen=True)
class ModuleCall:
    """One forward call of a submodule, as the planner needs it."""

    path: str
    type_name: str
    phase: str
    step: int
    first_op: int  # ops [first_op, end_op) ran inside the call
    end_op: int
    inputs: tuple[int, ...]  # storage ids of its tensor arguments
    outputs: tuple[int, ...]


@dataclass(frozen=True)
class Event:
    """One entry of the allocation timeline, in the order eager PyTorch does it."""

    kind: str  # "alloc", "free", "scratch" (an op's kernel-internal bytes, freed inside it), "phase"
    storage: int = -1
    nbytes: int = 0  # scratch bytes
    op: int = -1  # alloc: the op; free: the last op that ran before it
    phase: str = ""
    step: int = -1


@dataclass(frozen=True)
class Trace:
    ops: tuple[Op, ...]
    storages: dict[int, Storage]
    events: tuple[Event, ...]
    calls: tuple[ModuleCall, ...]
    module_types: dict[str, str]  # path -> class name, for every submodule
    approximate_ops: tuple[str, ...]  # ops whose data-dependent results were assumed (see policy)

    def graph(self) -> nx.DiGraph:
        """Ops as nodes, an edge from the op that allocated a storage to each op that reads it."""
        g = nx.DiGraph()
        producer: dict[int, int] = {}
        for op in self.ops:
            g.add_node(op.index, op=op)
            for sid in op.reads:
                if sid in producer and producer[sid] != op.index:
                    g.add_edge(producer[sid], op.index, storage=sid)
            for sid in op.allocates:
                producer[sid] = op.index
        return g


# A device's hooks into tracing: extra scratch bytes per op, and how autocast behaves.
ScratchRule = Callable[[Any, tuple, dict, Any], int]


@dataclass(frozen=True)
class TraceRules:
    scratch: Callable[[Any, tuple, dict, Any], int] = lambda func, args, kwargs, out: 0
    foreach: bool | None = None  # the optimizer's foreach flag (None: torch's default for CPU tensors)
    autocast: Callable[[str, torch.dtype], contextlib.AbstractContextManager] | None = None
    # corrects an op's fake outputs where its fake kernel allocates differently from the real one
    fix_outputs: Callable[[Any, tuple, dict, Any], Any] = lambda func, args, kwargs, out: out
    # a context standing in for device-specific kernel choices (e.g. CUDA's fused attention)
    function_mode: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext


class _Recorder(TorchDispatchMode):
    """Sees every aten op above the fake mode; records storages and their lifetimes."""

    def __init__(self, rules: TraceRules) -> None:
        super().__init__()
        self.rules = rules
        self.ids: weakref.WeakKeyDictionary[torch.UntypedStorage, int] = weakref.WeakKeyDictionary()
        self.counter = itertools.count()
        self.ops: list[Op] = []
        self.storages: dict[int, dict[str, Any]] = {}
        self.events: list[Event] = []
        self.phase, self.step, self.module_stack = "setup", -1, [""]
        self.found_inf: weakref.WeakSet[torch.UntypedStorage] = weakref.WeakSet()
        self.approximate: list[str] = []

    # -- storages -------------------------------------------------------------------------------

    def register(self, tensor: torch.Tensor, role: str, op: int | None = None) -> int:
        storage = tensor.untyped_storage()
        sid = self.ids.get(storage)
        if sid is None:
            sid = next(self.counter)
            self.ids[storage] = sid
            self.storages[sid] = {
                "nbytes": storage.nbytes(),
                "role": role,
                "op": op,
                "module": self.module_stack[-1],
            }
            weakref.finalize(storage, self._freed, sid)
            if op is not None:
                self.events.append(Event("alloc", sid, op=op))
        return sid

    def _freed(self, sid: int) -> None:
        self.events.append(Event("free", sid, op=len(self.ops) - 1))

    def set_role(self, tensor: torch.Tensor, role: str) -> None:
        sid = self.ids.get(tensor.untyped_storage())
        if sid is not None and self.storages[sid]["role"] in ("temporaries", "activations"):
            self.storages[sid]["role"] = role

    def begin_phase(self, phase: str, step: int) -> None:
        self.phase, self.step = phase, step
        self.events.append(Event("phase", op=len(self.ops) - 1, phase=phase, step=step))

    # -- ops --------------------------------------------------------------------------------------

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            return self._scalar(args[0])
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if func in _DATA_DEPENDENT:
            out = self._assume_all_selected(func, args)
        else:
            out = self.rules.fix_outputs(func, args, kwargs, func(*args, **kwargs))
        if func in _FOUND_INF_WRITERS:
            self.found_inf.add(args[1].untyped_storage())
        index = len(self.ops)
        read_storages = {t.untyped_storage() for t in inputs}
        reads = tuple(self.ids[s] for s in read_storages if s in self.ids)
        writes = tuple(
            self.ids[t.untyped_storage()]
            for t in _written_arguments(func, args, kwargs)
            if t.untyped_storage() in self.ids
        )
        allocates = []
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            if storage not in self.ids and storage not in read_storages:
                allocates.append(self.register(t, "temporaries", index))
        scratch = int(self.rules.scratch(func, args, kwargs, out))
        if scratch:
            self.events.append(Event("scratch", op=index, nbytes=scratch))
        flops = 0
        if func._overloadpacket in flop_registry:
            flops = int(flop_registry[func._overloadpacket](*args, **kwargs, out_val=out))
        elif func._overloadpacket in MORE_FLOPS:
            flops = int(MORE_FLOPS[func._overloadpacket](*args))
        self.ops.append(
            Op(
                index=index,
                name=str(func),
                phase=self.phase,
                step=self.step,
                module=self.module_stack[-1],
                flops=flops,
                reads=reads,
                writes=writes,
                allocates=tuple(allocates),
                scratch_bytes=scratch,
                accumulates_in_place=self._is_grad_accumulation(func),
            )
        )
        return out

    def _is_grad_accumulation(self, func: Any) -> bool:
        """The autograd engine sums two gradients of one tensor with `old.add_(new)` when it holds the
        last reference to `old` (input_buffer.cpp, can_accumulate_inplace); a fake tensor is a tensor
        subclass, so under tracing the engine takes the out-of-place branch instead. Such an add runs
        in backward, outside any module (a recomputed forward runs inside one), with grad mode off."""
        return (
            func is torch.ops.aten.add.Tensor
            and self.phase == "backward"
            and self.module_stack == [""]
            and not torch.is_grad_enabled()
        )

    def _scalar(self, tensor: torch.Tensor) -> Any:
        # A data-dependent scalar: GradScaler's overflow flag reads "no overflow"; any other value
        # (optimizer step counters) reads 1, which changes no shape or allocation.
        if tensor.untyped_storage() in self.found_inf:
            return 0.0
        return True if tensor.dtype == torch.bool else 1 if not tensor.is_floating_point() else 1.0

    def _assume_all_selected(self, func: Any, args: tuple) -> torch.Tensor:
        self.approximate.append(str(func))
        x = args[0]
        if func is torch.ops.aten.nonzero.default:
            return torch.empty((x.numel(), x.dim()), dtype=torch.long, device=x.device)
        return torch.empty((x.numel(),), dtype=x.dtype, device=x.device)


def _written_arguments(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors an op mutates, from its schema's alias annotations (Tensor(a!))."""
    written = []
    for position, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[position] if position < len(args) else kwargs.get(argument.name)
        written.extend(t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor))
    return written


@contextlib.contextmanager
def _module_scopes(recorder: _Recorder, model: nn.Module, calls: list[ModuleCall]) -> Iterator[None]:
    """Track which submodule is running (global hooks: they also see recomputation in backward)."""
    paths = {id(m): name for name, m in model.named_modules(remove_duplicate=False)}
    open_calls: list[tuple[str, int, tuple[int, ...]]] = []

    def tensor_ids(value: Any) -> tuple[int, ...]:
        return tuple(
            recorder.ids[t.untyped_storage()]
            for t in tree_flatten(value)[0]
            if isinstance(t, torch.Tensor) and t.untyped_storage() in recorder.ids
        )

    def pre(module: nn.Module, args: Any, kwargs: Any = None) -> None:
        path = paths.get(id(module))
        if path is not None:
            recorder.module_stack.append(path)
            open_calls.append((path, len(recorder.ops), tensor_ids((args, kwargs))))

    def post(module: nn.Module, args: Any, kwargs: Any, output: Any = None) -> None:
        path = paths.get(id(module))
        if path is not None and open_calls and open_calls[-1][0] == path:
            recorder.module_stack.pop()
            _, first, inputs = open_calls.pop()
            calls.append(
                ModuleCall(
                    path, type(module).__name__, recorder.phase, recorder.step, first, len(recorder.ops), inputs,
                    tensor_ids(output),
                )
            )

    handles = [
        nn.modules.module.register_module_forward_pre_hook(lambda m, a: pre(m, a)),
        nn.modules.module.register_module_forward_hook(lambda m, a, k, o: post(m, a, k, o), with_kwargs=True),
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def trace_step(workload: Workload, config: StepConfig, rules: TraceRules = TraceRules(),
               transform: Callable[[nn.Module], nn.Module] | None = None) -> Trace:
    """Run the training step of `config` on `workload` under fake tensors and record it.
    `transform` is applied to the built model first (e.g. a checkpoint plan)."""
    recorder = _Recorder(rules)
    calls: list[ModuleCall] = []
    with FakeTensorMode(allow_non_fake_inputs=True):
        model, inputs = workload.build()
        if transform is not None:
            model = transform(model)
        prepared = prepare_step(model, inputs, config, "cpu", foreach=rules.foreach, stand_in=True)
        del model, inputs
        _register_baseline(recorder, prepared)
        module_types = {name: type(m).__name__ for name, m in prepared.model.named_modules()}

        def on_phase(phase: str, step: int) -> None:
            if phase == "optimizer":  # the gradients exist now: name their storages
                for p in _all_params(prepared):
                    if p.grad is not None:
                        recorder.set_role(p.grad, "gradients")
            if phase == "end":
                for tensor in _optimizer_state(prepared):
                    recorder.set_role(tensor, "optimizer_state")
            recorder.begin_phase(phase, step)

        def mark_saved(tensor: torch.Tensor) -> torch.Tensor:
            sid = recorder.ids.get(tensor.untyped_storage())
            if sid is not None and recorder.storages[sid]["role"] == "temporaries":
                recorder.storages[sid]["role"] = "activations"
            return tensor

        run_kwargs = {"autocast": rules.autocast} if rules.autocast else {}
        try:
            with rules.function_mode(), recorder, _module_scopes(recorder, prepared.model, calls), \
                    torch.autograd.graph.saved_tensors_hooks(mark_saved, lambda t: t):
                run_steps(prepared, config, on_phase=on_phase, **run_kwargs)
        finally:
            if hasattr(rules.autocast, "close"):
                rules.autocast.close()  # the emulated autocast kernels stay registered until closed
    storages = {
        sid: Storage(sid, s["nbytes"], s["role"], s["op"], s["module"]) for sid, s in recorder.storages.items()
    }
    events = _cut_after_last_step(tuple(recorder.events))
    return Trace(
        ops=tuple(recorder.ops),
        storages=storages,
        events=events,
        calls=tuple(calls),
        module_types=module_types,
        approximate_ops=tuple(dict.fromkeys(recorder.approximate)),
    )


def _cut_after_last_step(events: tuple[Event, ...]) -> tuple[Event, ...]:
    """Drop the frees that happen when the tracer lets go of the step's objects."""
    for i in range(len(events) - 1, -1, -1):
        if events[i].kind == "phase" and events[i].phase == "end":
            return events[: i + 1]
    return events


def _register_baseline(recorder: _Recorder, prepared: PreparedStep) -> None:
    for p in prepared.model.parameters():
        recorder.register(p, "weights")
    for b in prepared.model.buffers():
        recorder.register(b, "weights")
    for _, master in prepared.master_pairs:
        recorder.register(master, "optimizer_state")  # fp32 master copies: optimizer state, as in ZeRO
    values = prepared.inputs.values() if isinstance(prepared.inputs, dict) else prepared.inputs
    for value in values:
        if isinstance(value, torch.Tensor):
            recorder.register(value, "inputs")


def _all_params(prepared: PreparedStep) -> Iterator[torch.Tensor]:
    yield from prepared.model.parameters()
    for _, master in prepared.master_pairs:
        yield master


def _optimizer_state(prepared: PreparedStep) -> Iterator[torch.Tensor]:
    for state in prepared.optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                yield value
