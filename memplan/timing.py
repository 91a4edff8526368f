"""How long an op takes on the processor that runs the step: the time that prices recomputation.

Two kinds of processor, one rule each:

- a GPU: the roofline, its FLOPs at the card's peak rate for the precision or the bytes it moves at
  the card's bandwidth, whichever takes longer (memplan.gpus). A lower bound: it leaves out the host's
  kernel launches and dispatch, which overlap the device's work once ops are large enough.
- the CPU: one thread of control runs everything, so compute, memory traffic and the host's dispatch
  add up, and the host time that selective checkpointing's Python dispatch modes add per op of a
  segment is part of the step. The built-in constants were measured on the 2-core CI machine by
  `python benchmarks/cpu_calibration.py` (benchmarks/results/cpu_calibration.txt); on another CPU they
  are a model, not a measurement: memplan.cpu_calibration.measure_cpu_model measures them there, and
  the planners take the model it returns in place of a processor's name.

A model's name is a GPU's (see memplan.gpus.GPUS) or "cpu".
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
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
    # torch.utils.checkpoint's host time: per segment (one checkpoint call: its frame, RNG state and
    # hooks set up in forward and again for the recomputation; more with a selective policy, whose
    # dispatch modes are made, entered and left), per tensor autograd saves inside a segment (its pack and
    # unpack hooks), per op of a selective segment's forward (the policy's dispatch modes, both passes),
    # and per op whose output it keeps (recomputation dispatches it again to hand back the cached output)
    checkpoint_seconds_per_segment: float = 0.0
    selective_seconds_per_segment: float = 0.0
    checkpoint_seconds_per_saved_tensor: float = 0.0
    selective_seconds_per_op: float = 0.0
    selective_seconds_per_kept_op: float = 0.0
    # ops that compute far more per element than they move: seconds per byte of output (serial models only),
    # by op name, or "name[variant]" where an argument changes the cost (memplan.trace.Op.variant)
    seconds_per_output_byte: Mapping[str, float] = field(default_factory=dict)
    measured_on: str = ""  # where a serial model's constants come from

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
                    f"{1e6 * self.seconds_per_op:.1f} us per op, measured on {self.measured_on})")
        return f"{self.name} (roofline over each op's FLOPs and bytes at peak rates: a lower bound)"


# benchmarks/results/cpu_calibration.txt: 2 threads, fp32 (other precisions are priced alike); each constant
# the median of three runs on the CI machine (2026-12-02)
CPU = TimeModel(
    CPU_NAME, flops_per_s=130e9, bytes_per_s=110e9, serial=True, seconds_per_op=4.7e-6,
    checkpoint_seconds_per_segment=180e-6, selective_seconds_per_segment=78e-6,
    checkpoint_seconds_per_saved_tensor=18e-6, selective_seconds_per_op=27e-6, selective_seconds_per_kept_op=16e-6,
    seconds_per_output_byte=MappingProxyType({
        "aten.bernoulli_.float": 2.2e-9,
        "aten.bernoulli_.Tensor": 1.8e-9,
        "aten.native_dropout.default": 2.4e-9,
        "aten.gelu.default": 7.2e-11,
        "aten.gelu.default[tanh]": 2.8e-10,
        "aten.silu.default": 7.6e-11,
        "aten.sigmoid.default": 6.7e-11,
        "aten.tanh.default": 4.5e-10,
        "aten.exp.default": 1.5e-10,
        "aten.erf.default": 2.5e-10,
        "aten.rsqrt.default": 4.1e-11,
        "aten._softmax.default": 1.1e-10,
        "aten._safe_softmax.default": 4.3e-10,
        "aten._log_softmax.default": 1.3e-10,
        "aten.native_layer_norm.default": 2.0e-10,
        "aten.where.self": 5.4e-10,
    }),
    measured_on="the 2-core CI machine",
)


def time_model(name: str, precision: str = "fp32") -> TimeModel:
    """The CPU's model, or a GPU's roofline for `precision` (a GPU name as memplan.gpus.gpu_spec takes it)."""
    if name.lower() == CPU_NAME:
        return CPU
    spec = gpu_spec(name)
    return TimeModel(spec.name, peak_flops(spec, precision), spec.bandwidth_bytes_per_s, serial=False)


def time_model_for(device: str, processor: str | TimeModel | None = None, precision: str = "fp32") -> TimeModel:
    """The model of `processor` where given (a name, or a model itself, as
    memplan.cpu_calibration.measure_cpu_model returns), else of what a step on `device` runs on: the CPU,
    or the default GPU."""
    if isinstance(processor, TimeModel):
        return processor
    return time_model(processor or (CPU_NAME if device == "cpu" else DEFAULT_GPU), precision)


def gpu_named(device: str, processor: str | TimeModel | None) -> str | None:
    """The GPU whose library workspaces the estimator models: `processor` where the step runs on CUDA
    and `processor` names a GPU (a step traced for the CPU may still be priced on a GPU's roofline)."""
    named = isinstance(processor, str) and processor.lower() != CPU_NAME
    return processor if device == "cuda" and named else None


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
    variant = f"{op.name}[{op.variant}]"  # "aten.gelu.default[tanh]"; priced as the op where not measured
    priced_as = variant if op.variant and variant in model.seconds_per_output_byte else op.name
    return model.seconds(op.flops, bytes_moved(trace, op), priced_as, output_bytes(trace, op))


def step_seconds(trace: Trace, model: TimeModel, step: int = 0) -> float:
    """The modelled time of one traced step (its forward, backward and optimizer ops)."""
    return sum(op_seconds(op, trace, model) for op in trace.ops if op.step == step)


def kept_ops(ops: Iterable[Op], saved_ops: Sequence[str]) -> set[int]:
    """The indices of `ops` (one forward of a segment) whose outputs a selective policy naming `saved_ops`
    keeps: an op name keeps every call of it, "name#k" its k-th call among the ops the policy sees."""
    saved = set(saved_ops)
    seen: dict[str, int] = defaultdict(int)
    kept = set()
    for op in ops:
        if op.name in POLICY_BLIND:
            continue
        position = seen[op.name]
        seen[op.name] += 1
        if op.name in saved or f"{op.name}#{position}" in saved:
            kept.add(op.index)
    return kept


def segment_seconds(model: TimeModel, selective: bool) -> float:
    """Host time one checkpoint call adds, whatever it runs."""
    return model.checkpoint_seconds_per_segment + (model.selective_seconds_per_segment if selective else 0.0)


def checkpoint_seconds(ops: Sequence[Op], trace: Trace, model: TimeModel, selective: bool, kept: int = 0) -> float:
    """Host time a checkpointed segment whose forward runs `ops` adds beyond recomputing them: the
    checkpoint call itself, the hooks on every tensor autograd saves, a selective policy's dispatch of
    every op it sees, and the dispatch of the `kept` ops whose outputs recomputation hands back from its
    cache."""
    saved = sum(trace.saved_tensors.get(op.index, 0) for op in ops)
    seen = sum(op.name not in POLICY_BLIND for op in ops) if selective else 0
    return (segment_seconds(model, selective) + saved * model.checkpoint_seconds_per_saved_tensor
            + seen * model.selective_seconds_per_op + kept * model.selective_seconds_per_kept_op)


def plan_checkpoint_seconds(trace: Trace, plan: Plan, model: TimeModel) -> float:
    """Host time the plan's segments add beyond recomputation (checkpoint_seconds over each segment's
    modules, as their first forward call runs them in `trace`, the unplanned step)."""
    seconds = 0.0
    for segment in plan.segments:
        calls = [trace.first_forward_call(path) for path in segment.modules]
        ops = [op for call in calls for op in trace.ops[call.first_op : call.end_op]]
        selective = segment.policy == "selective"
        kept = len(kept_ops(ops, segment.saved_ops)) if selective else 0
        seconds += checkpoint_seconds(ops, trace, model, selective, kept)
    return seconds


def recompute_seconds(trace: Trace, planned_trace: Trace, plan: Plan, model: TimeModel) -> float:
    """What `plan` (re-estimated as `planned_trace`) adds to the step's time: its recomputed ops, and
    checkpointing's own host time."""
    return step_seconds(planned_trace, model) - step_seconds(trace, model) + plan_checkpoint_seconds(trace, plan, model)
