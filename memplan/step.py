"""The training step: the one contract that the tracer (under fake tensors) and the verifier (on real
memory) both run, so that a prediction and its measurement always mean the same step.

    model, inputs = NAME(batch_size)                  # fp32, CPU
    move to the target device; cast for the precision
    optimizer = OPTIMIZERS[name](trainable params)    # torch defaults for that device, lr=1e-3
    repeat for each step:
        for each of grad_accum micro-batches:         # each micro-batch is `inputs`
            [autocast] loss = loss_of(model(inputs)) / grad_accum; [scaled] backward
            (the output and the loss are released after backward)
        [unscale] optimizer.step(); [scaler.update()]; optimizer.zero_grad(set_to_none=True)
        a step whose update the GradScaler skipped (inf/NaN gradients) runs again, as training would

Precisions and optimizers are registries (name -> rule); `run_steps` reports each phase boundary
through a callback so that the caller can measure or tag what happens in between.
"""

from __future__ import annotations

import contextlib
import functools
import gc
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import tree_map

from memplan.errors import BadInput
from memplan.optim8bit import AdamW8bitLayout

LEARNING_RATE = 1e-3
PHASES = ("forward", "backward", "optimizer")


# --------------------------------------------------------------------------------------------------
# Precisions


@dataclass(frozen=True)
class Precision:
    name: str
    description: str
    param_dtype: torch.dtype = torch.float32  # what the model's floating parameters and buffers hold
    autocast_dtype: torch.dtype | None = None  # autocast around forward and loss, when set
    loss_scaling: bool = False  # dynamic loss scale (torch.amp.GradScaler)
    master_weights: bool = False  # the optimizer updates fp32 copies of the model's parameters
    norm_layers_fp32: bool = False  # BatchNorm keeps fp32 parameters and statistics (Apex O2)
    tf32: bool = False  # TF32 matmuls and convolutions on CUDA


PRECISIONS: dict[str, Precision] = {
    p.name: p
    for p in (
        Precision("fp32", "fp32 everywhere"),
        Precision("tf32", "fp32 storage, TF32 matmuls and convolutions on CUDA", tf32=True),
        Precision(
            "amp-fp16",
            "fp32 weights, fp16 autocast, dynamic loss scaling (Apex O1)",
            autocast_dtype=torch.float16,
            loss_scaling=True,
        ),
        Precision("amp-bf16", "fp32 weights, bf16 autocast", autocast_dtype=torch.bfloat16),
        Precision(
            "fp16-master",
            "fp16 model, fp32 master weights in the optimizer, loss scaling, BatchNorm in fp32 (Apex O2)",
            param_dtype=torch.float16,
            loss_scaling=True,
            master_weights=True,
            norm_layers_fp32=True,
        ),
        Precision("bf16", "whole model in bf16 (Apex O3 style)", param_dtype=torch.bfloat16),
        Precision("fp16", "whole model in fp16, no loss scaling (Apex O3)", param_dtype=torch.float16),
    )
}


# --------------------------------------------------------------------------------------------------
# Optimizers


def _bitsandbytes_adamw8bit(params: list[nn.Parameter], foreach: bool | None) -> torch.optim.Optimizer:
    try:
        import bitsandbytes
    except ImportError:
        raise BadInput("optimizer adamw-8bit needs bitsandbytes (pip install bitsandbytes) and a CUDA GPU") from None
    return bitsandbytes.optim.AdamW8bit(params, lr=LEARNING_RATE)


@dataclass(frozen=True)
class OptimizerRule:
    name: str
    description: str
    # build(trainable params, foreach) -> optimizer; foreach=None leaves torch's default for the device
    build: Callable[[list[nn.Parameter], bool | None], torch.optim.Optimizer]
    needs_cuda: bool = False
    # what the tracer runs instead, when the real optimizer cannot run under fake tensors
    stand_in: Callable[[list[nn.Parameter], bool | None], torch.optim.Optimizer] | None = None


def _torch_optimizer(cls: type, **kwargs: Any) -> Callable[[list[nn.Parameter], bool | None], torch.optim.Optimizer]:
    def build(params: list[nn.Parameter], foreach: bool | None) -> torch.optim.Optimizer:
        return cls(params, lr=LEARNING_RATE, foreach=foreach, **kwargs)

    return build


OPTIMIZERS: dict[str, OptimizerRule] = {
    r.name: r
    for r in (
        OptimizerRule("sgd", "plain SGD, no state", _torch_optimizer(torch.optim.SGD)),
        OptimizerRule("sgd-momentum", "SGD, momentum 0.9", _torch_optimizer(torch.optim.SGD, momentum=0.9)),
        OptimizerRule("adam", "Adam", _torch_optimizer(torch.optim.Adam)),
        OptimizerRule("adamw", "AdamW", _torch_optimizer(torch.optim.AdamW)),
        OptimizerRule("adagrad", "Adagrad", _torch_optimizer(torch.optim.Adagrad)),
        OptimizerRule("rmsprop", "RMSprop", _torch_optimizer(torch.optim.RMSprop)),
        OptimizerRule("adafactor", "torch.optim.Adafactor (factored second moment)", _torch_optimizer(torch.optim.Adafactor)),
        OptimizerRule(
            "adamw-8bit",
            "bitsandbytes AdamW8bit (blockwise 8-bit state)",
            _bitsandbytes_adamw8bit,
            needs_cuda=True,
            stand_in=lambda params, foreach: AdamW8bitLayout(params, lr=LEARNING_RATE),
        ),
    )
}


def precision_rule(name: str) -> Precision:
    return _lookup(PRECISIONS, name, "precision")


def optimizer_rule(name: str) -> OptimizerRule:
    return _lookup(OPTIMIZERS, name, "optimizer")


def _lookup(registry: Mapping[str, Any], name: str, what: str) -> Any:
    if name not in registry:
        raise BadInput(f"unknown {what} {name!r}; expected one of: {', '.join(registry)}")
    return registry[name]


# --------------------------------------------------------------------------------------------------
# The step


@dataclass(frozen=True)
class StepConfig:
    precision: str = "fp32"
    optimizer: str = "adamw"
    grad_accum: int = 1
    steps: int = 3

    def __post_init__(self) -> None:
        precision_rule(self.precision)
        optimizer_rule(self.optimizer)
        if self.grad_accum < 1:
            raise BadInput(f"--grad-accum must be at least 1, got {self.grad_accum}")
        if self.steps < 1:
            raise BadInput(f"--steps must be at least 1, got {self.steps}")


@dataclass
class PreparedStep:
    """Everything the step holds on the device between steps."""

    model: nn.Module
    inputs: tuple | dict
    device: torch.device
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None
    # (model parameter, fp32 master copy) pairs for precisions with master weights
    master_pairs: list[tuple[nn.Parameter, nn.Parameter]] = field(default_factory=list)


def _is_norm_layer(module: nn.Module) -> bool:
    return isinstance(module, nn.modules.batchnorm._BatchNorm)


def convert_module(model: nn.Module, device: torch.device, precision: Precision) -> nn.Module:
    """Move and cast parameters and buffers, each keeping its identity (_converted_in_place): a library
    that holds the model's tensors elsewhere too then feeds the network the objects the step converted
    and the optimizer holds. torchrl's losses keep the networks' parameters in a TensorDictParams and
    load them into the network at each call (SAC's target parameters as its buffers); pyro's modules
    read theirs back from its param store. Replaced by new objects, a pure-bf16 step failed there (bf16
    activations met the fp32 originals), and the optimizer held copies no gradient reached. Tied
    tensors stay tied; integer buffers keep their dtype. Each original is kept until the end, so its id
    is not reused: a module that registers a new Parameter while its modules are listed (peft's LoRA
    nn.MultiheadAttention, in named_modules) would otherwise be handed the conversion of another."""
    converted: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(original) -> (original, converted)

    def convert(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if id(tensor) not in converted:
            target = dtype if tensor.is_floating_point() else tensor.dtype
            with torch.no_grad():
                new = tensor.to(device=device, dtype=target)
            converted[id(tensor)] = (tensor, tensor if new is tensor else _converted_in_place(tensor, new))
        return converted[id(tensor)][1]

    for module in model.modules():
        dtype = torch.float32 if precision.norm_layers_fp32 and _is_norm_layer(module) else precision.param_dtype
        for name, param in list(module._parameters.items()):
            if param is not None:
                module._parameters[name] = convert(param, dtype)
        for name, buf in list(module._buffers.items()):
            if buf is not None:
                module._buffers[name] = convert(buf, dtype)
        if isinstance(module, nn.RNNBase):
            module._init_flat_weights()  # its cached list would keep a replaced weight alive
    return model


def _converted_in_place(tensor: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """`tensor` holding `new`'s contents by `tensor.data = new`, as torch's `Module._apply` converts a
    real parameter: the object keeps its identity, its autograd state (hooks; the gradient accumulator
    a graph built with the model refers to, weight_norm's) and the weak references to it (pyro's), where
    the `swap_tensors` that `Module._apply` takes for a fake tensor refuses the last two and drops the
    hooks. A fake tensor (the tracer's, which converts on the CPU, so its fake device holds) takes `new`'s
    `constant` too, the real value it keeps of a small tensor: left in the old dtype, ops on it came
    out in that dtype. A gradient is converted alike. A real tensor the tracer left its factory (a lazy
    module's) converts to a fake one: a new object, as `Module._apply` makes it."""
    if isinstance(new, FakeTensor) and not isinstance(tensor, FakeTensor):
        return nn.Parameter(new, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) else new
    tensor.data = new
    if isinstance(tensor, FakeTensor):
        tensor.constant = new.constant
    if isinstance(tensor, nn.Parameter) and tensor.grad is not None:
        tensor.grad = tensor.grad.to(device=new.device, dtype=new.dtype)
    return tensor


def convert_inputs(inputs: tuple | dict, device: torch.device, precision: Precision) -> tuple | dict:
    """Move inputs; floating inputs take the model's dtype (autocast precisions keep them fp32). Tensors
    nested in lists, tuples and dicts are converted too: left as built, a pure-bf16 step failed where a
    nested float32 tensor met bf16 weights (a diffusion wrapper taking its text embeddings in a tuple of
    conditions), and diffusers' SDXL UNet kept `added_cond_kwargs={"text_embeds", "time_ids"}` in float32
    (its training script casts them to the weights' dtype)."""

    def convert(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            dtype = precision.param_dtype if value.is_floating_point() else value.dtype
            return value.to(device=device, dtype=dtype)
        return value

    if isinstance(inputs, dict):
        return {k: tree_map(convert, v) for k, v in inputs.items()}
    return tuple(tree_map(convert, v) for v in inputs)


_COMPRESSED_PARTS = {
    torch.sparse_csr: ("crow_indices", "col_indices", "values"),
    torch.sparse_bsr: ("crow_indices", "col_indices", "values"),
    torch.sparse_csc: ("ccol_indices", "row_indices", "values"),
    torch.sparse_bsc: ("ccol_indices", "row_indices", "values"),
}


def memory_parts(tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The strided tensors that hold a tensor's memory: itself, or a sparse tensor's index and value
    tensors (a sparse tensor has no storage of its own)."""
    if tensor.layout is torch.strided:
        return (tensor,)
    if tensor.layout is torch.sparse_coo:
        return (tensor._indices(), tensor._values())
    return tuple(getattr(tensor, part)() for part in _COMPRESSED_PARTS[tensor.layout])


def prepare_step(
    model: nn.Module,
    inputs: tuple | dict,
    config: StepConfig,
    device: torch.device | str,
    foreach: bool | None = None,
    stand_in: bool = False,
) -> PreparedStep:
    """Move and cast the model and inputs, build the optimizer (and scaler, master weights).
    `stand_in` builds the optimizer's fake-tensor stand-in where it has one (for the tracer)."""
    device = torch.device(device)
    precision = precision_rule(config.precision)
    model = convert_module(model, device, precision)
    model.train()
    inputs = convert_inputs(inputs, device, precision)
    trainable = [p for p in model.parameters() if p.requires_grad]
    master_pairs = []
    if precision.master_weights:
        for p in trainable:
            master = p if p.dtype == torch.float32 else nn.Parameter(p.detach().float())
            master_pairs.append((p, master))
        trainable = [m for _, m in master_pairs]
    rule = optimizer_rule(config.optimizer)
    optimizer = (rule.stand_in if stand_in and rule.stand_in else rule.build)(trainable, foreach)
    scaler = torch.amp.GradScaler(device.type) if precision.loss_scaling else None
    return PreparedStep(model, inputs, device, optimizer, scaler, master_pairs)


def loss_of(output: Any) -> torch.Tensor:
    """A scalar tensor output is the loss; an output with a `loss` attribute or key uses that;
    otherwise the loss is `first_tensor_output.float().mean()`."""
    if isinstance(output, torch.Tensor) and output.dim() == 0:
        loss = output
    elif isinstance(output, Mapping) and isinstance(output.get("loss"), torch.Tensor):
        loss = output["loss"]
    elif isinstance(getattr(output, "loss", None), torch.Tensor):
        loss = output.loss
    else:
        first = _first_tensor(output)
        if first is None:
            raise BadInput(f"the model's output ({type(output).__name__}) holds no tensor to take a loss from")
        loss = first.float().mean()
    return loss


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    items = value.values() if isinstance(value, Mapping) else value if isinstance(value, (list, tuple)) else ()
    for item in items:
        found = _first_tensor(item)
        if found is not None:
            return found
    return None


@contextlib.contextmanager
def _tf32(enabled: bool) -> Iterator[None]:
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


PhaseCallback = Callable[[str, int], None]


@contextlib.contextmanager
def collector_off() -> Iterator[None]:
    """Python's cycle collector off while steps run (run_steps: the tracer's and the verifier's alike): a
    tensor only a reference cycle holds (a torch.distributions object's loc and scale, say) then lives
    to the end of the run in both, and no collection at a moment that depends on other Python
    allocations (the tracer's own, the profiler's) frees it early in one of them."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


# Packages whose functools caches hold no tensor of a step: torch's, and memplan's own.
_CACHES_WITHOUT_STEP_TENSORS = frozenset({"torch", "functorch", "memplan"})


@contextlib.contextmanager
def model_caches_emptied_after() -> Iterator[None]:
    """What the model's code memoised while steps ran (a functools cache: transformers' BEiT caches its
    relative position index, a tensor) would be handed to the next run in the process, traced or real,
    made before it began: that run would count it nowhere (and a traced run's fake tensor would fail a
    real one). Afterwards, every such cache that gained entries is emptied, so each run, the tracer's
    and the verifier's alike, makes what it caches as a fresh process would."""
    def model_caches() -> dict[Any, int]:
        return {cache: cache.cache_info().currsize for cache in gc.get_objects()
                if type(cache) is functools._lru_cache_wrapper  # isinstance would wake deprecated proxies
                and str(getattr(cache, "__module__", "")).partition(".")[0] not in _CACHES_WITHOUT_STEP_TENSORS}

    before = model_caches()
    try:
        yield
    finally:
        for cache, size in model_caches().items():
            if size > before.get(cache, 0):
                cache.cache_clear()


def default_autocast(device_type: str, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    return torch.autocast(device_type, dtype=dtype)


# GradScaler's first scale, 2**16, overflows the fp16 gradients of many models: it skips the update and
# halves the scale until the gradients are finite. Those steps hold no optimizer state yet, so a step
# whose update was skipped runs again, as training goes on, until the update is applied; after this
# many repeats (a scale of 1: the gradients overflow unscaled) the steps count as they are.
MAX_SKIPPED_UPDATES = 16


def run_steps(
    prepared: PreparedStep,
    config: StepConfig,
    on_phase: PhaseCallback = lambda phase, step: None,
    autocast: Callable[[str, torch.dtype], contextlib.AbstractContextManager] = default_autocast,
) -> int:
    """Run `config.steps` training steps whose updates were applied. `on_phase(phase, step)` is called as
    each phase begins ("forward", "backward", "optimizer") and with ("end", step) when a step is over; a
    step whose update the GradScaler skipped runs again under the same number. Returns how many ran
    again (at most MAX_SKIPPED_UPDATES). The steps run with the cycle collector off (collector_off)."""
    precision = precision_rule(config.precision)
    model, scaler = prepared.model, prepared.scaler
    device_type = prepared.device.type
    step = skipped = 0
    with _tf32(precision.tf32), collector_off():
        while step < config.steps:
            for _ in range(config.grad_accum):
                on_phase("forward", step)
                with autocast(device_type, precision.autocast_dtype) if precision.autocast_dtype else contextlib.nullcontext():
                    output = call_model(model, prepared.inputs)
                    loss = loss_of(output)
                if not loss.requires_grad:
                    raise BadInput("the model's loss does not depend on any trainable parameter: no gradient "
                                   "flows back from it (return a differentiable output)")
                loss = loss / config.grad_accum if config.grad_accum > 1 else loss
                on_phase("backward", step)
                (scaler.scale(loss) if scaler else loss).backward()
                del output, loss
            on_phase("optimizer", step)
            applied = _optimizer_step(prepared)
            on_phase("end", step)
            if applied or skipped == MAX_SKIPPED_UPDATES:
                step += 1
            else:
                skipped += 1
    return skipped


def _optimizer_step(prepared: PreparedStep) -> bool:
    """One update (unscaled, master weights copied back); False where the GradScaler skipped it."""
    optimizer, scaler = prepared.optimizer, prepared.scaler
    for param, master in prepared.master_pairs:
        if param is not master and param.grad is not None:
            master.grad = param.grad.float()
            param.grad = None
    applied = True
    if scaler:
        scaler.step(optimizer)  # unscales, skips the step on inf/nan
        # what GradScaler.step checked (under tracing a found-inf flag reads "none": memplan.trace)
        applied = not sum(v.item() for v in scaler._found_inf_per_device(optimizer).values())
        scaler.update()
    else:
        optimizer.step()
    with torch.no_grad():
        for param, master in prepared.master_pairs:
            if param is not master:
                param.copy_(master)
    optimizer.zero_grad(set_to_none=True)
    return applied


def call_model(model: nn.Module, inputs: tuple | dict) -> Any:
    """The model on its inputs: keyword arguments from a dict, positional ones from a tuple."""
    return model(**inputs) if isinstance(inputs, dict) else model(*inputs)
