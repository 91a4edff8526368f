"""How long an op takes on the processor that runs the step: the time that prices recomputation.

Two kinds of processor, one rule each:

- a GPU: the roofline, its FLOPs at the card's peak rate for the precision or the bytes it moves at
  the card's bandwidth, whichever takes longer (memplan.gpus). A lower bound: it leaves out the host's
  kernel launches and dispatch, which overlap the device's work once ops are large enough.
- the CPU: one thread of control runs everything, so compute, memory traffic and the host's dispatch
  add up, and the host time that selective checkpointing's Python dispatch modes add per op of a
  segment is part of the step. The constants were measured on the 2-core CI machine by
  `python benchmarks/cpu_calibration.py` (benchmarks/results/cpu_calibration.txt); on another CPU they
  are a model, not a measurement.

A model's name is a GPU's (see memplan.gpus.GPUS) or "cpu".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from torch.utils.checkpoint import SAC_IGNORED_OPS

from memplan.errors import BadInput
from memplan.gpus import gpu_spec, peak_flops
from memplan.plan import Plan
from memplan.trace import Op, Trace

DEFAULT_GPU = "h100"  # matches memplan.devices.DEFAULT_COMPUTE_CAPABILITY
CPU_NAME = "cpu"
# ops the runtime's selective-checkpoint policy never sees (detach, ...)
POLICY_BLIND = frozenset(str(op) for op in SAC_IGNORED_OPS)
# metadata queries (prim.device, aten.sym_size, ...): the tracer sees them because fake tensors are a
# tensor subclass, but a plain tensor answers them in C++ without a dispatch, so they cost nothing
METADATA_QUERIES = POLICY_BLIND - {"aten.detach.default"}
# ops that hand out memory without writing it (dropout's mask is made by empty_like, then bernoulli_)
UNINITIALISED = frozenset({
    "aten.empty.memory_format", "aten.empty_like.default", "aten.empty_strided.default",
    "aten.empty_permuted.default", "aten.new_empty.default", "aten.new_empty_strided.default",
})


@dataclass(frozen=True)
class TimeModel:
    name: str
    flops_per_s: float  # matmul rate for the precision
    bytes_per_s: float
    serial: bool  # compute, memory and host time add up (CPU); else the roofline's max (GPU)
    seconds_per_op: float = 0.0  # host dispatch, per op (serial models only)
    # torch.utils.checkpoint's host time: per tensor autograd saves inside a segment (its pack and unpack
    # hooks), and per op of a selective segment's forward (the policy's dispatch modes, both passes)
    checkpoint_seconds_per_saved_tensor: float = 0.0
    selective_seconds_per_op: float = 0.0
    # ops that compute far more per element than they move: seconds per byte of output (serial models only),
    # by op name, or "name[variant]" where an argument changes the cost (memplan.trace.Op.variant)
    seconds_per_output_byte: Mapping[str, float] = field(default_factory=dict)

    def seconds(self, flops: float, bytes_moved: float, op: str = "", output_bytes: int = 0) -> float:
        if flops < 0 or bytes_moved < 0:
            raise BadInput("flops and bytes moved must be non-negative")
        compute, memory = flops / self.flops_per_s, bytes_moved / self.bytes_per_s
        if not self.serial:
            return max(compute, memory)
        elementwise = max(memory, output_bytes * self.seconds_per_output_byte.get(op, 0.0))
        return compute + elementwise + self.seconds_per_op

    @property
    def description(self) -> str:
        if self.serial:
            return (f"the CPU time model ({self.flops_per_s / 1e9:.0f} GFLOP/s, {self.bytes_per_s / 1e9:.0f} GB/s, "
                    f"{1e6 * self.seconds_per_op:.1f} us per op, measured on a 2-core machine)")
        return f"{self.name} (roofline over each op's FLOPs and bytes at peak rates: a lower bound)"


# benchmarks/results/cpu_calibration.txt: 2 threads, fp32 (other precisions are priced alike); GELU's tanh
# form from its second run
CPU = TimeModel(
    CPU_NAME, flops_per_s=186e9, bytes_per_s=141e9, serial=True, seconds_per_op=2.8e-6,
    checkpoint_seconds_per_saved_tensor=11e-6, selective_seconds_per_op=18e-6,
    seconds_per_output_byte=MappingProxyType({
        "aten.bernoulli_.float": 1.5e-9,
        "aten.bernoulli_.Tensor": 1.5e-9,
        "aten.native_dropout.default": 1.6e-9,
        "aten.gelu.default": 6.0e-11,
        "aten.gelu.default[tanh]": 2.1e-10,
        "aten.silu.default": 5.4e-11,
        "aten.sigmoid.default": 5.7e-11,
        "aten.tanh.default": 3.4e-10,
        "aten.exp.default": 1.1e-10,
        "aten.erf.default": 1.8e-10,
        "aten.rsqrt.default": 3.5e-11,
        "aten._softmax.default": 8.3e-11,
        "aten._safe_softmax.default": 2.7e-10,
        "aten._log_softmax.default": 7.8e-11,
        "aten.native_layer_norm.default": 1.4e-10,
        "aten.where.self": 4.5e-10,
    }),
)


def time_model(name: str, precision: str = "fp32") -> TimeModel:
    """The CPU's model, or a GPU's roofline for `precision` (a GPU name as memplan.gpus.gpu_spec takes it)."""
    if name.lower() == CPU_NAME:
        return CPU
    spec = gpu_spec(name)
    return TimeModel(spec.name, peak_flops(spec, precision), spec.bandwidth_bytes_per_s, serial=False)


def time_model_for(device: str, processor: str | None = None, precision: str = "fp32") -> TimeModel:
    """The model of `processor` where given, else of what a step on `device` runs on: the CPU, or the
    default GPU."""
    return time_model(processor or (CPU_NAME if device == "cpu" else DEFAULT_GPU), precision)


def bytes_moved(trace: Trace, op: Op) -> int:
    """What one op reads and writes: its input storages and the storages it allocates; nothing for an
    op that allocates and writes nothing (a view: it only makes new metadata) or only allocates (empty)."""
    if (not op.allocates and not op.writes) or op.name in UNINITIALISED:
        return 0
    return sum(trace.storages[sid].nbytes for sid in (*op.reads, *op.allocates))


def output_bytes(trace: Trace, op: Op) -> int:
    """What the op produces: the storages it allocates, or for an in-place op, the largest it writes."""
    if op.allocates:
        return sum(trace.storages[sid].nbytes for sid in op.allocates)
    return max((trace.storages[sid].nbytes for sid in op.writes), default=0)


def op_seconds(op: Op, trace: Trace, model: TimeModel) -> float:
    if op.name in METADATA_QUERIES:
        return 0.0
    variant = f"{op.name}[{op.variant}]"  # "aten.gelu.default[tanh]"; priced as the op where not measured
    priced_as = variant if op.variant and variant in model.seconds_per_output_byte else op.name
    return model.seconds(op.flops, bytes_moved(trace, op), priced_as, output_bytes(trace, op))


def step_seconds(trace: Trace, model: TimeModel, step: int = 0) -> float:
    """The modelled time of one traced step (its forward, backward and optimizer ops)."""
    return sum(op_seconds(op, trace, model) for op in trace.ops if op.step == step)


def checkpoint_seconds(ops: Sequence[Op], trace: Trace, model: TimeModel, selective: bool) -> float:
    """Host time a checkpointed segment whose forward runs `ops` adds beyond recomputing them: the hooks
    on every tensor autograd saves, and a selective policy's dispatch of every op it sees."""
    saved = sum(trace.saved_tensors.get(op.index, 0) for op in ops)
    seen = sum(op.name not in POLICY_BLIND for op in ops) if selective else 0
    return saved * model.checkpoint_seconds_per_saved_tensor + seen * model.selective_seconds_per_op


def plan_checkpoint_seconds(trace: Trace, plan: Plan, model: TimeModel) -> float:
    """Host time the plan's segments add beyond recomputation (checkpoint_seconds over each segment's
    modules, as their first forward call runs them in `trace`, the unplanned step)."""
    seconds = 0.0
    for segment in plan.segments:
        for path in segment.modules:
            call = trace.first_forward_call(path)
            seconds += checkpoint_seconds(trace.ops[call.first_op : call.end_op], trace, model,
                                          segment.policy == "selective")
    return seconds


def recompute_seconds(trace: Trace, planned_trace: Trace, plan: Plan, model: TimeModel) -> float:
    """What `plan` (re-estimated as `planned_trace`) adds to the step's time: its recomputed ops, and
    checkpointing's own host time."""
    return step_seconds(planned_trace, model) - step_seconds(trace, model) + plan_checkpoint_seconds(trace, plan, model)
