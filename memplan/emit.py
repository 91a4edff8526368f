"""Turn a checkpoint plan into checkpointed modules: `apply_plan` wraps a model in place, and
`emit_module` writes the same wrapping as a standalone Python module that needs only PyTorch.

Each planned segment's forward is replaced *on the instance* by one that runs under
`torch.utils.checkpoint.checkpoint(use_reentrant=False)`, so module paths, parameter names and
state_dict keys stay the same, and the wrapped model still runs under FakeTensorMode. Non-reentrant
checkpoints nest, so a segment may sit inside another; RNG state is preserved, so dropout draws the
same masks when recomputed and the gradients equal the uncheckpointed model's.

A run of siblings (children of an nn.Sequential, blocks an nn.ModuleList is looped over, or any
parent's children that it chains, like a CNN's stem or a feed-forward's `fc2(act(fc1(x)))`), listed
in the order the parent calls them, whatever the order it registered them in, becomes ONE checkpoint
without touching the parent's forward: the run's first module computes the whole run, the others hand
their first argument back unchanged. This assumes the parent calls the run's modules one after
another, each with the previous one's output as its first argument and the same other arguments
(`for block in self.blocks: x = block(x, mask)`). Each member still
returns its own output (the checkpoint returns them all), and the pass-through modules check by
identity that they receive exactly the previous member's output and the same other arguments,
and raise otherwise.

The runtime half of this file (between the markers below) uses only PyTorch and is copied verbatim
into emitted modules, so the library and the emitted code cannot drift apart.
"""

from __future__ import annotations

import inspect
import json

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from memplan.errors import BadInput
from memplan.plan import Plan, Segment
from memplan.units import format_bytes

EMIT_LINE_LENGTH = 100

# --- runtime: plain PyTorch, copied into emitted modules -------------------------------------------
# Laid out for the emitted code's 100 columns, not this project's 120: the formatter stays out.
# fmt: off


def checkpoint_segment(modules: list[nn.Module], saved_ops: list | None = None) -> None:
    """Recompute `modules` (one module, or a run of consecutive siblings) in backward.

    saved_ops: None recomputes everything; otherwise the op outputs to keep, the rest being
    recomputed (selective checkpointing): an aten op (torch.ops.aten.mm.default) keeps the outputs
    of all its calls, (op, n) those of its n-th call (from 0) in one forward of the segment.
    """
    for module in modules:
        if is_checkpointed(module):
            raise ValueError(f"{type(module).__name__} is already checkpointed")
    if len(modules) == 1:
        modules[0].forward = _Checkpointed(modules[0].forward, saved_ops)
    else:
        run = _Run(modules, saved_ops)
        for index, module in enumerate(modules):
            module.forward = _RunMember(run, index)


def is_checkpointed(module: nn.Module) -> bool:
    return isinstance(module.__dict__.get("forward"), (_Checkpointed, _RunMember))


def _checkpoint(function, saved_ops, args, kwargs, modules):
    # Keyword arguments travel as positional ones: checkpoint looks only at positional tensors to
    # find the device whose RNG state it preserves, and a model's keyword could clash with its own.
    names = tuple(kwargs)
    calls = 0
    restoring = [False]  # while buffers are copied: ops the policy must not count

    def call(*flat):
        nonlocal calls
        positional = len(flat) - len(names)
        recomputing, calls = calls > 0, calls + 1
        # Forward may change the segment's buffers (BatchNorm's running statistics): recompute on
        # copies, so that the state changes once per step, as without checkpoints. Checkpoint's
        # selective mode numbers each op's calls and wants the same numbers in both passes, so a
        # selective segment copies them in forward too (and the policy does not count the copies).
        owners = [owner for module in modules for owner in module.modules()]
        slots = [(o, name, b) for o in owners for name, b in o.named_buffers(recurse=False)]
        restoring[0] = True
        copy_now = recomputing or saved_ops is not None
        copies = [buffer.clone() for _, _, buffer in slots] if copy_now else []
        restoring[0] = False
        if recomputing:
            for (owner, name, _), copy in zip(slots, copies):
                setattr(owner, name, copy)
        try:
            return function(*flat[:positional], **dict(zip(names, flat[positional:])))
        finally:
            if recomputing:
                for owner, name, buffer in slots:
                    setattr(owner, name, buffer)

    options = {} if saved_ops is None else {"context_fn": _keep_policy(saved_ops, restoring)}
    return checkpoint(call, *args, *kwargs.values(), use_reentrant=False, **options)


def _keep_policy(saved_ops, restoring=(False,)):
    """checkpoint's context_fn for a selective segment: MUST_SAVE for the listed op calls,
    PREFER_RECOMPUTE for every other op; ops run while `restoring[0]` is true are not counted."""
    every_call = {entry for entry in saved_ops if not isinstance(entry, tuple)}
    one_call = {entry for entry in saved_ops if isinstance(entry, tuple)}

    def context_fn():
        # Fresh counts for each checkpoint call. checkpoint asks the policy about each op of the
        # forward, in order, but not about those it ignores (detach, ...: SAC_IGNORED_OPS); older
        # PyTorch asks again while recomputing (ctx.is_recompute), so each pass counts its own.
        calls_seen = {False: {}, True: {}}

        def policy(ctx, op, *args, **kwargs):
            if restoring[0]:
                return CheckpointPolicy.PREFER_RECOMPUTE
            seen = calls_seen[bool(ctx.is_recompute)]
            call = seen.get(op, 0)
            seen[op] = call + 1
            if op in every_call or (op, call) in one_call:
                return CheckpointPolicy.MUST_SAVE
            return CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy)

    return context_fn


class _Checkpointed:
    """A module's forward, run under checkpoint. A callable object rather than a closure, so that
    copy.deepcopy(model) rebinds it to the copied module."""

    def __init__(self, forward, saved_ops):
        self.forward = forward
        self.saved_ops = saved_ops

    def __call__(self, *args, **kwargs):
        return _checkpoint(self.forward, self.saved_ops, args, kwargs, _owner(self.forward))


def _owner(forward):
    """The module whose forward this is (none for a plain function)."""
    owner = getattr(forward, "__self__", None)
    return [owner] if isinstance(owner, nn.Module) else []


class _Run:
    """Consecutive sibling modules checkpointed as one segment."""

    def __init__(self, modules, saved_ops):
        self.modules = list(modules)
        self.forwards = [module.forward for module in modules]
        self.saved_ops = saved_ops
        self.computing = False  # inside the checkpointed function: members do their real work
        self.waiting = None  # (next member to pass through, all outputs, other args, kwargs)

    def start(self, args, kwargs):
        if not args:
            raise RuntimeError("a checkpointed run's first module needs a positional input")
        self.waiting = None
        outputs = list(_checkpoint(self._compute, self.saved_ops, args, kwargs, self.modules))
        self.waiting = (1, outputs, args[1:], kwargs)
        return outputs[0]

    def _compute(self, x, *args, **kwargs):
        # Every member's output comes back, so that each member hands out its own: the parent may
        # use one for more than feeding the next member (its shape, a skip connection).
        self.computing = True
        try:
            outputs = [self.forwards[0](x, *args, **kwargs)]
            for module in self.modules[1:]:
                # through __call__, so its hooks run in order
                outputs.append(module(outputs[-1], *args, **kwargs))
            return tuple(outputs)
        finally:
            self.computing = False

    def pass_through(self, index, args, kwargs):
        expected, outputs, other_args, other_kwargs = self.waiting or (None, None, (), {})
        same = (
            index == expected
            and len(args) == len(other_args) + 1
            and args[0] is outputs[index - 1]
            and all(a is b for a, b in zip(args[1:], other_args))
            and kwargs.keys() == other_kwargs.keys()
            and all(kwargs[k] is other_kwargs[k] for k in kwargs)
        )
        if not same:
            self.waiting = None
            raise RuntimeError(
                f"{type(self.modules[index]).__name__} #{index} of a checkpointed run of "
                f"{len(self.modules)} modules was not called with the previous module's output "
                "and the same other arguments; a run needs its parent to call the modules in "
                "order, as in `for block in self.blocks: x = block(x, ...)`"
            )
        output, outputs[index - 1] = outputs[index], None  # hold no output longer than needed
        # Drop the references once the last member has passed, so the run holds no tensors.
        self.waiting = (index + 1, *self.waiting[1:]) if index + 1 < len(self.modules) else None
        return output


class _RunMember:
    """The forward of one module of a run."""

    def __init__(self, run, index):
        self.run = run
        self.index = index

    def __call__(self, *args, **kwargs):
        if self.run.computing:
            return self.run.forwards[self.index](*args, **kwargs)
        if self.index == 0:
            return self.run.start(args, kwargs)
        return self.run.pass_through(self.index, args, kwargs)


# fmt: on
# --- end of runtime --------------------------------------------------------------------------------

_RUNTIME = (
    checkpoint_segment, is_checkpointed, _checkpoint, _keep_policy, _Checkpointed, _owner, _Run, _RunMember
)


def apply_plan(model: nn.Module, plan: Plan) -> nn.Module:
    """Checkpoint the plan's segments of `model` in place and return it. Every segment is checked
    against the model before any is wrapped, so a mismatch (BadInput) leaves the model unchanged."""
    resolved = [(_resolve(model, plan, segment), _saved_ops(segment)) for segment in plan.segments]
    seen: dict[int, str] = {}
    for segment, (modules, _) in zip(plan.segments, resolved):
        for path, module in zip(segment.modules, modules):
            if id(module) in seen:
                raise BadInput(f"module {path!r} is in two segments (also as {seen[id(module)]!r})")
            if is_checkpointed(module):
                raise BadInput(f"module {path!r} is already checkpointed")
            seen[id(module)] = path
    for modules, saved_ops in resolved:
        checkpoint_segment(modules, saved_ops)
    return model


def _resolve(model: nn.Module, plan: Plan, segment: Segment) -> list[nn.Module]:
    """The segment's modules, after checking that they exist and can form a segment."""
    _check_paths(segment)
    modules = []
    for path in segment.modules:
        try:
            modules.append(model.get_submodule(path))
        except AttributeError:
            raise BadInput(f"the model has no module {path!r} (the plan is for {plan.model})") from None
    if len(modules) == 1:
        # a container is never called itself, unless its class gives it a forward (timm's DenseBlock, a ModuleDict)
        if isinstance(modules[0], (nn.ModuleList, nn.ModuleDict)) and type(modules[0]).forward is nn.Module.forward:
            raise BadInput(
                f"{segment.modules[0]!r} is an {type(modules[0]).__name__}, which is never called "
                "itself; checkpoint a run of its blocks instead"
            )
        return modules
    return modules


def _check_paths(segment: Segment) -> None:
    """What can be checked without the model: paths are strings, and a run's share one parent."""
    if not segment.modules:
        raise BadInput("a segment in the plan has no modules")
    if not all(isinstance(path, str) for path in segment.modules):
        raise BadInput(f"segment {_show(segment)}: module paths must be strings")
    if len(segment.modules) > 1:
        if "" in segment.modules or len({path.rpartition(".")[0] for path in segment.modules}) > 1:
            raise BadInput(f"run {_show(segment)}: the modules are not siblings of one parent")
        if len(set(segment.modules)) < len(segment.modules):
            raise BadInput(f"run {_show(segment)}: a module appears twice")


def _saved_ops(segment: Segment) -> list | None:
    """None for a full segment; what a selective segment keeps, as checkpoint_segment takes it."""
    if segment.policy == "full":
        return None
    if segment.policy != "selective":
        raise BadInput(f"segment {_show(segment)}: unknown policy {segment.policy!r} (full or selective)")
    saved = []
    for name in segment.saved_ops:
        op_name, call = _parse_saved_op(name)
        saved.append(_aten_op(op_name) if call is None else (_aten_op(op_name), call))
    return saved


def _parse_saved_op(name: object) -> tuple[str, int | None]:
    """("aten.mm.default", None) from "aten.mm.default" (every call), ("aten.mm.default", 2) from
    "aten.mm.default#2" (its third call in one forward of the segment)."""
    op_name, hash_sign, call = name.partition("#") if isinstance(name, str) else ("", "", "")
    if hash_sign and not (call.isascii() and call.isdigit()):
        raise BadInput(f"saved op {name!r}: the call after '#' must be a number, as in 'aten.mm.default#2'")
    return op_name or repr(name), int(call) if hash_sign else None


def _aten_op(name: str) -> object:
    """torch.ops.aten.mm.default from "aten.mm.default"; identifiers only, as the name goes into code."""
    parts = name.split(".")
    if len(parts) != 3 or not all(part.isidentifier() for part in parts):
        raise BadInput(f"saved op {name!r} is not an op name like 'aten.mm.default' or 'aten.mm.default#2'")
    try:
        return getattr(getattr(getattr(torch.ops, parts[0]), parts[1]), parts[2])
    except (AttributeError, RuntimeError):
        raise BadInput(f"saved op {name!r} is not an op of this PyTorch") from None


def _show(segment: Segment) -> str:
    return "[" + ", ".join(map(repr, segment.modules)) + "]"


# --------------------------------------------------------------------------------------------------
# Emitting


def emit_module(plan: Plan) -> str:
    """The source of a standalone module defining `apply_checkpointing(model) -> model`, which does
    what apply_plan(model, plan) does with nothing but PyTorch (formatted like black, lines <= 100)."""
    for segment in plan.segments:
        _check_paths(segment)
        _saved_ops(segment)
    entries = [_format_literal(_segment_literal(segment), 4, ",") for segment in plan.segments]
    segments = "SEGMENTS = [\n" + "".join(entries) + "]\n" if entries else "SEGMENTS = []\n"
    runtime = "\n\n".join(inspect.getsource(part) for part in _RUNTIME)
    return (
        _header(plan)
        + '"""Activation checkpointing planned by memplan; needs only PyTorch.\n\n'
        + "`model = apply_checkpointing(model)` wraps the planned modules in place: module paths,\n"
        + "parameter names and state_dict keys stay the same.\n"
        + '"""\n\n'
        + ("import torch\n" if any(segment.policy == "selective" for segment in plan.segments) else "")
        + "from torch import nn\n"
        + "from torch.utils.checkpoint import (\n"
        + "    CheckpointPolicy,\n"
        + "    checkpoint,\n"
        + "    create_selective_checkpoint_contexts,\n"
        + ")\n\n"
        + "# (module paths, outputs to keep): one path is a module, several are a run of siblings, in the\n"
        + "# order the parent calls them, checkpointed as one. None recomputes everything; otherwise the\n"
        + "# segment keeps the outputs of each op listed (all its calls) and of each (op, n): the op's n-th\n"
        + "# call (from 0) in one forward of the segment, and recomputes the rest in backward.\n"
        + segments
        + "\n\n"
        + "def apply_checkpointing(model: nn.Module) -> nn.Module:\n"
        + '    """Checkpoint the planned segments of `model` in place and return it."""\n'
        + "    for paths, saved_ops in SEGMENTS:\n"
        + "        checkpoint_segment([model.get_submodule(path) for path in paths], saved_ops)\n"
        + "    return model\n\n\n"
        + runtime
    )


def _header(plan: Plan) -> str:
    batch = "factory default" if plan.batch_size is None else plan.batch_size
    budget = "none" if plan.budget_bytes is None else format_bytes(plan.budget_bytes)
    overhead = f"{100 * plan.recompute_flops / plan.step_flops:.1f}%" if plan.step_flops else "unknown"
    fits = "" if plan.feasible else " -- does NOT fit the budget"
    lines = [
        "Generated by memplan; edits are lost when it is regenerated.",
        f"model: {plan.model}, batch {batch}, {plan.precision}, optimizer {plan.optimizer}, grad accum "
        + f"{plan.grad_accum}, device {plan.device}",
        f"budget: {budget}; predicted peak: {format_bytes(plan.predicted_peak_bytes)}{fits} "
        + f"(without checkpointing: {format_bytes(plan.unplanned_peak_bytes)})",
        f"recompute overhead: {overhead} of the step's FLOPs; {len(plan.segments)} segments chosen by {plan.method}",
    ]
    # Plan fields come from a file: fold any line breaks so that each stays inside its comment.
    return "".join("# " + " ".join(str(line).split()) + "\n" for line in lines)


def _segment_literal(segment: Segment) -> tuple:
    """(paths, ops) as nested lists of source atoms, for _format_literal."""
    paths = [json.dumps(path) for path in segment.modules]  # double quotes, valid Python escapes
    if segment.policy == "full":
        return (paths, "None")
    kept = []
    for name in segment.saved_ops:
        op_name, call = _parse_saved_op(name)
        kept.append(f"torch.ops.{op_name}" if call is None else (f"torch.ops.{op_name}", str(call)))
    return (paths, kept)


def _format_literal(value: object, indent: int, suffix: str) -> str:
    """Lines for a nested tuple/list literal the way black lays it out: on one line if it fits,
    otherwise one element per line with a trailing comma, recursively."""
    pad = " " * indent
    flat = _flat(value)
    if isinstance(value, str) or len(pad + flat + suffix) <= EMIT_LINE_LENGTH:
        return pad + flat + suffix + "\n"
    opening, closing = ("(", ")") if isinstance(value, tuple) else ("[", "]")
    inner = "".join(_format_literal(item, indent + 4, ",") for item in value)
    return pad + opening + "\n" + inner + pad + closing + suffix + "\n"


def _flat(value: object) -> str:
    if isinstance(value, str):
        return value
    text = ", ".join(_flat(item) for item in value)
    return f"({text})" if isinstance(value, tuple) else f"[{text}]"
