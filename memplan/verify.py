"""Verify: run the training step for real and measure its memory, the ground truth a prediction is
checked against.

The step is the one in memplan/step.py (`prepare_step` + `run_steps`), the same contract the estimator
traces, so a prediction and its measurement always mean the same step. The workload is built for real
(fp32, on the CPU, seeded), optionally checkpointed by a plan, then moved to the device.

CUDA: the caching allocator's own counters. At each phase boundary (run_steps' on_phase callback) the
device is synchronized, `max_memory_allocated` is read for the phase just ended and the peak is reset;
the overall peak is the largest phase peak. The CUDA context is what the device reports in use
(`mem_get_info`) beyond what the caching allocator has reserved.

CPU: the CPU allocator's own events. The profiler (profile_memory=True) records every allocation and
free with its size, kernels' internal scratch included; sorted by time, their running total plus the
bytes already live when measuring starts (unique storages of the parameters, buffers, inputs, grads,
optimizer and scaler state) gives the live bytes at every moment. Phase boundaries are profiler
markers (record_function) in the same event stream, so there is no clock to reconcile.

Nothing here prints: `measure`, `predict` and `compare` return dataclasses; the CLI prints.
"""

from __future__ import annotations

import copy
import gc
import importlib.util
import inspect
import random
import re
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch._C._profiler import _EventType

from memplan.cpu_profiler import quiet_stderr
from memplan.errors import BadInput, MemplanError
from memplan.plan import Plan
from memplan.step import (
    PHASES,
    PreparedStep,
    StepConfig,
    call_model,
    collector_off,
    loss_of,
    memory_parts,
    model_caches_emptied_after,
    optimizer_rule,
    prepare_step,
    run_steps,
)
from memplan.workload import Workload, same_model

SEED = 0
SNAPSHOT_MAX_ENTRIES = 100_000
_MARK = "memplan::phase::"  # profiler marker name prefix: memplan::phase::<phase>::<step>
_FREED = "freed"  # marker phase: a storage of the state was freed (the marker's number: its data pointer)
_STEPS = "steps"  # marker phase: the steps begin (before it, the model is built)
_CPU_MEMORY_DEVICES = ("CPU", "MKLDNN", "IDEEP")  # as torch.autograd.profiler counts CPU memory
_CPU_OOM = re.compile(r"can't allocate memory|cannot allocate memory|not enough memory|out of memory", re.IGNORECASE)


# --------------------------------------------------------------------------------------------------
# Results


@dataclass(frozen=True)
class Measurement:
    device: str  # "cpu" or "cuda[:N]"
    device_name: str  # the GPU's name, or "cpu"
    steps: int  # steps asked for
    measured_peak_bytes: int  # most bytes live at once (allocated, not reserved), over all steps
    measured_reserved_bytes: int | None  # CUDA: most bytes the caching allocator held; CPU: None
    phase_peaks: Mapping[str, int]  # "forward" / "backward" / "optimizer" -> peak within that phase, all steps
    step_peaks: tuple[int, ...]  # peak within each step (steps that ran)
    first_step_peak_bytes: int
    later_steps_peak_bytes: int | None  # None with a single step (or an OOM in the first)
    baseline_bytes: int  # live when measuring starts: parameters, buffers, inputs (and any state)
    cuda_context_bytes: int | None  # CUDA: device memory in use outside the caching allocator
    total_memory_bytes: int | None  # CUDA: the device's memory
    oom: bool = False
    oom_phase: str | None = None  # the phase that ran out of memory
    oom_step: int | None = None  # 1-based step that ran out of memory
    oom_message: str | None = None
    plan_method: str | None = None  # the plan applied, if any
    snapshot_path: str | None = None  # CUDA memory snapshot written, if asked for
    skipped_updates: int = 0  # steps run again because the GradScaler skipped their update (run_steps)

    @property
    def fits(self) -> bool:
        return not self.oom

    def to_json(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "device_name": self.device_name,
            "steps": self.steps,
            "measured_peak_bytes": self.measured_peak_bytes,
            "measured_reserved_bytes": self.measured_reserved_bytes,
            "phase_peaks": dict(self.phase_peaks),
            "step_peaks": list(self.step_peaks),
            "first_step_peak_bytes": self.first_step_peak_bytes,
            "later_steps_peak_bytes": self.later_steps_peak_bytes,
            "baseline_bytes": self.baseline_bytes,
            "cuda_context_bytes": self.cuda_context_bytes,
            "total_memory_bytes": self.total_memory_bytes,
            "fits": self.fits,
            "oom": self.oom,
            "oom_phase": self.oom_phase,
            "oom_step": self.oom_step,
            "oom_message": self.oom_message,
            "plan": self.plan_method,
            "snapshot": self.snapshot_path,
            "skipped_updates": self.skipped_updates,
        }


@dataclass(frozen=True)
class Prediction:
    peak_bytes: int
    phase_peaks: Mapping[str, int] = field(default_factory=dict)  # may be empty (a plan's figure only)
    source: str = "estimate"  # "estimate", or "plan" (the plan's own predicted_peak_bytes)


@dataclass(frozen=True)
class PhaseComparison:
    phase: str  # "forward", "backward", "optimizer" or "peak"
    measured_bytes: int | None
    predicted_bytes: int | None
    error_pct: float | None  # (predicted - measured) / measured * 100


@dataclass(frozen=True)
class Comparison:
    rows: tuple[PhaseComparison, ...]  # the phases, then "peak"
    predicted_peak_bytes: int | None
    error_pct: float | None  # of the overall peak

    def within(self, tolerance_pct: float) -> bool:
        return self.error_pct is not None and abs(self.error_pct) <= tolerance_pct


class PredictionUnavailable(MemplanError):
    """No prediction can be made (no estimator in this build, or it failed on this workload)."""

    exit_code = 1


# --------------------------------------------------------------------------------------------------
# Input checks


def resolve_device(device: str | None) -> str:
    """`None` -> "cuda" when a GPU is available, else "cpu". Rejects unknown devices and CUDA without a GPU."""
    if device is None or device == "":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise BadInput(f"unknown device {device!r}; expected cuda, cuda:N or cpu") from None
    if parsed.type == "cpu":
        return "cpu"
    if parsed.type != "cuda":
        raise BadInput(f"unsupported device {device!r}; expected cuda, cuda:N or cpu")
    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        raise BadInput(
            f"--device {device} needs a CUDA GPU, but none is available (torch {torch.__version__}, {build})"
        )
    if parsed.index is not None and parsed.index >= torch.cuda.device_count():
        raise BadInput(f"--device {device}: there are only {torch.cuda.device_count()} CUDA device(s)")
    return str(parsed)


def check_supported(config: StepConfig, device: str) -> None:
    """Reject optimizer/device combinations that cannot run here, before building anything."""
    rule = optimizer_rule(config.optimizer)
    if rule.needs_cuda and torch.device(device).type != "cuda":
        raise BadInput(f"optimizer {config.optimizer} needs a CUDA GPU (--device cuda); it cannot run on {device}")
    if config.optimizer == "adamw-8bit" and importlib.util.find_spec("bitsandbytes") is None:
        raise BadInput("optimizer adamw-8bit needs bitsandbytes (pip install bitsandbytes) and a CUDA GPU")


def check_plan(plan: Plan, workload: Workload) -> None:
    if not same_model(plan.model, workload.spec):
        raise BadInput(f"plan is for model {plan.model}, not {workload.spec}")


def plan_mismatches(plan: Plan, workload: Workload, config: StepConfig) -> list[str]:
    """Settings the plan was made for that differ from this run (worth a note, not an error)."""
    notes = []
    for name, planned, actual in (
        ("batch size", plan.batch_size, workload.effective_batch_size),
        ("precision", plan.precision, config.precision),
        ("optimizer", plan.optimizer, config.optimizer),
        ("grad accum", plan.grad_accum, config.grad_accum),
        ("options", dict(plan.options or {}), dict(workload.options)),
    ):
        if planned is not None and planned != actual:
            notes.append(f"the plan was made for {name} {planned}, this run uses {actual}")
    return notes


def apply_plan(model: nn.Module, plan: Plan) -> nn.Module:
    try:
        from memplan.emit import apply_plan as emit_apply_plan
    except ImportError as error:
        raise BadInput(f"--plan needs memplan.emit, which is not available ({error})") from error
    result = emit_apply_plan(model, plan)
    return result if isinstance(result, nn.Module) else model


# --------------------------------------------------------------------------------------------------
# Measuring


def gradients_equal(workload: Workload, plan: Plan, rtol: float = 1e-5, atol: float = 1e-6) -> bool:
    """Whether the planned model's parameter gradients equal eager's: one fp32 forward and backward on the
    CPU of the built model and of a second build, checkpointed, each from the same seeds (dropout draws the
    same masks; so does code drawing from Python's or NumPy's generator, where nothing recomputes it)
    and its own copy of the inputs (a model may scale its batch in place), compared with torch.allclose.
    Each is built from the same seeds, not deep-copied: a copy loses the hooks the model registered on its
    tensors (peft's OSF projects its parameters' gradients through them)."""
    gradients = []
    with model_caches_emptied_after():
        for planned in (False, True):
            torch.manual_seed(0)
            random.seed(0)
            np.random.seed(0)
            model, inputs = workload.build()
            candidate = apply_plan(model, plan) if planned else model
            torch.manual_seed(123)
            random.seed(123)
            np.random.seed(123)
            candidate.train()
            loss_of(call_model(candidate, copy.deepcopy(inputs))).backward()
            gradients.append({name: p.grad for name, p in candidate.named_parameters() if p.grad is not None})
    eager, planned = gradients
    return eager.keys() == planned.keys() and all(
        torch.allclose(planned[name], grad, rtol=rtol, atol=atol) for name, grad in eager.items())


def measure(
    workload: Workload,
    config: StepConfig,
    device: str | None = None,
    plan: Plan | None = None,
    *,
    snapshot: str | Path | None = None,
    foreach: bool | None = None,
) -> Measurement:
    """Build the workload for real, run `config.steps` training steps on `device` and measure them.
    Running out of memory is a result (`oom=True`), not an exception."""
    device = resolve_device(device)
    check_supported(config, device)
    if plan is not None:
        check_plan(plan, workload)
    cuda = torch.device(device).type == "cuda"
    if snapshot is not None and not cuda:
        raise BadInput("--snapshot records the CUDA caching allocator; it needs --device cuda")
    if snapshot is not None:
        snapshot = Path(snapshot)
        if not (snapshot.parent if str(snapshot.parent) else Path(".")).is_dir():
            raise BadInput(f"directory not found: {snapshot.parent}")
    with model_caches_emptied_after():
        if cuda:
            with torch.cuda.device(torch.device(device)):
                return _measure_cuda(workload, config, device, plan, snapshot, foreach)
        return _measure_cpu(workload, config, plan, foreach)


def _prepare(
    workload: Workload, config: StepConfig, device: str, plan: Plan | None, foreach: bool | None
) -> PreparedStep:
    torch.manual_seed(SEED)
    with torch.device("cpu"):
        model, inputs = workload.build()
    if plan is not None:
        model = apply_plan(model, plan)
    prepared = prepare_step(model, inputs, config, device, foreach=foreach)
    del model, inputs  # the fp32 CPU originals: only the prepared copies stay live
    return prepared


class _PhaseTracker:
    """Remembers which phase of which step is running, for the on_phase callback and OOM reports."""

    def __init__(self) -> None:
        self.phase: str | None = None
        self.step = 0

    def update(self, phase: str, step: int) -> None:
        self.phase, self.step = (None if phase == "end" else phase), step


def _is_cpu_oom(error: BaseException) -> bool:
    return isinstance(error, MemoryError) or (isinstance(error, RuntimeError) and bool(_CPU_OOM.search(str(error))))


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}".strip()


@dataclass
class _Peaks:
    """Peaks per (phase, step) segment, folded into the Measurement's figures."""

    by_segment: dict[tuple[str, int], int] = field(default_factory=dict)

    def add(self, phase: str, step: int, peak: int) -> None:
        key = (phase, step)
        self.by_segment[key] = max(self.by_segment.get(key, peak), peak)

    def phase_peaks(self) -> dict[str, int]:
        out = {phase: 0 for phase in PHASES}
        for (phase, _), peak in self.by_segment.items():
            out[phase] = max(out[phase], peak)
        return out

    def step_peaks(self) -> tuple[int, ...]:
        steps: dict[int, int] = {}
        for (_, step), peak in self.by_segment.items():
            steps[step] = max(steps.get(step, peak), peak)
        return tuple(steps[s] for s in sorted(steps))


def _result(
    device: str,
    device_name: str,
    config: StepConfig,
    peaks: _Peaks,
    baseline: int,
    overall: int,
    tracker: _PhaseTracker,
    oom_error: BaseException | None,
    plan: Plan | None,
    reserved: int | None = None,
    context: int | None = None,
    total: int | None = None,
    snapshot: Path | None = None,
    skipped_updates: int = 0,
) -> Measurement:
    step_peaks = peaks.step_peaks() or (baseline,)
    return Measurement(
        device=device,
        device_name=device_name,
        steps=config.steps,
        measured_peak_bytes=max(overall, baseline, *step_peaks),
        measured_reserved_bytes=reserved,
        phase_peaks=peaks.phase_peaks(),
        step_peaks=step_peaks,
        first_step_peak_bytes=step_peaks[0],
        later_steps_peak_bytes=max(step_peaks[1:]) if len(step_peaks) > 1 else None,
        baseline_bytes=baseline,
        cuda_context_bytes=context,
        total_memory_bytes=total,
        oom=oom_error is not None,
        oom_phase=(tracker.phase or "setup") if oom_error is not None else None,
        oom_step=tracker.step + 1 if oom_error is not None else None,
        oom_message=_first_line(oom_error) if oom_error is not None else None,
        plan_method=plan.method if plan is not None else None,
        snapshot_path=str(snapshot) if snapshot is not None else None,
        skipped_updates=skipped_updates,
    )


# ---------------------------------------------------------------------------------------------- CUDA


def _measure_cuda(
    workload: Workload,
    config: StepConfig,
    device: str,
    plan: Plan | None,
    snapshot: Path | None,
    foreach: bool | None,
) -> Measurement:
    dev = torch.device(device)
    gc.collect()
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    if snapshot is not None:
        torch.cuda.memory._record_memory_history(max_entries=SNAPSHOT_MAX_ENTRIES)
    tracker = _PhaseTracker()
    peaks = _Peaks()
    reserved = 0
    prepared = None
    oom_error: BaseException | None = None
    baseline = overall = skipped = 0
    context = total = None
    try:
        try:
            torch.cuda.reset_peak_memory_stats(dev)
            prepared = _prepare(workload, config, device, plan, foreach)
            gc.collect()
            torch.cuda.synchronize(dev)
            baseline = torch.cuda.memory_allocated(dev)
            reserved = torch.cuda.memory_reserved(dev)
            torch.cuda.reset_peak_memory_stats(dev)

            def close_segment() -> None:
                nonlocal reserved
                torch.cuda.synchronize(dev)
                if tracker.phase is not None:
                    peaks.add(tracker.phase, tracker.step, torch.cuda.max_memory_allocated(dev))
                reserved = max(reserved, torch.cuda.max_memory_reserved(dev))
                torch.cuda.reset_peak_memory_stats(dev)

            def on_phase(phase: str, step: int) -> None:
                close_segment()
                tracker.update(phase, step)

            skipped = run_steps(prepared, config, on_phase)
            close_segment()
        except torch.cuda.OutOfMemoryError as error:
            oom_error = error.with_traceback(None)  # the traceback would keep the step's tensors alive
            # the peak up to the failure (the allocation that failed is not counted)
            if tracker.phase is not None:
                peaks.add(tracker.phase, tracker.step, torch.cuda.max_memory_allocated(dev))
            reserved = max(reserved, torch.cuda.max_memory_reserved(dev))
            if prepared is None:
                baseline = torch.cuda.max_memory_allocated(dev)
        free, total = torch.cuda.mem_get_info(dev)
        context = max(0, (total - free) - torch.cuda.memory_reserved(dev))
        overall = max(peaks.by_segment.values(), default=baseline)
        if snapshot is not None:
            torch.cuda.memory._dump_snapshot(str(snapshot))
    finally:
        if snapshot is not None:
            torch.cuda.memory._record_memory_history(enabled=None)
        prepared = None
        gc.collect()
        torch.cuda.empty_cache()
    return _result(
        device,
        torch.cuda.get_device_name(dev),
        config,
        peaks,
        baseline,
        overall,
        tracker,
        oom_error,
        plan,
        reserved=reserved,
        context=context,
        total=total,
        snapshot=snapshot,
        skipped_updates=skipped,
    )


# ----------------------------------------------------------------------------------------------- CPU


def _tensors_in(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _tensors_in(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors_in(item)


def live_state_bytes(prepared: PreparedStep) -> int:
    """Bytes held by the step's state: unique storages (by data pointer) of the parameters and their
    grads, buffers, inputs, master weights, optimizer state and scaler tensors, on the step's device."""
    return sum(storage.nbytes() for storage in _state_storages(prepared).values())


def _state_storages(prepared: PreparedStep) -> dict[int, torch.UntypedStorage]:
    """live_state_bytes' storages, by data pointer."""
    tensors: list[torch.Tensor] = []
    for param in prepared.model.parameters():
        tensors += [param, param.grad] if param.grad is not None else [param]
    tensors += list(prepared.model.buffers())
    tensors += list(_tensors_in(prepared.inputs))
    for _, master in prepared.master_pairs:
        tensors += [master, master.grad] if master.grad is not None else [master]
    for group in prepared.optimizer.param_groups:
        for param in group["params"]:
            tensors += [param, param.grad] if param.grad is not None else [param]
    tensors += list(_tensors_in(list(prepared.optimizer.state.values())))
    if prepared.scaler is not None:
        tensors += [t for t in vars(prepared.scaler).values() if isinstance(t, torch.Tensor)]
    seen: dict[int, torch.UntypedStorage] = {}
    for part in (p for tensor in tensors for p in memory_parts(tensor)):
        if part.device != prepared.device or part.is_meta:
            continue
        storage = part.untyped_storage()
        if storage.data_ptr() != 0:
            seen[storage.data_ptr()] = storage
    return seen


def _mark_frees_of(storages: dict[int, torch.UntypedStorage]) -> list[weakref.finalize]:
    """A marker when each storage of the state (by data pointer) is freed (a buffer the forward replaces:
    `self.stat = ...`), for those allocated before profiling began (a factory's cached model), whose free
    the profiler does not report. Detach the finalizers returned when profiling stops: a later session
    must not see them."""
    finalizers = []
    for pointer, storage in storages.items():
        finalizer = weakref.finalize(storage, _mark, _FREED, pointer)
        finalizer.atexit = False
        finalizers.append(finalizer)
    return finalizers


def _mark(phase: str, step: int) -> None:
    """A zero-length profiler marker: its start time places the phase boundary in the event stream."""
    with torch.autograd.profiler.record_function(f"{_MARK}{phase}::{step}"):
        pass


def _measure_cpu(workload: Workload, config: StepConfig, plan: Plan | None, foreach: bool | None) -> Measurement:
    """The profiler records from before the model is built, so that it reports the frees of the state's
    own blocks during the steps (a buffer resized in place, `min_val.resize_(channels)` in a
    quantization observer, frees its old block), which it does not for blocks allocated before it began
    (such a block of a model built before its factory was called is still counted until the end)."""
    tracker = _PhaseTracker()
    profiler = torch.autograd.profiler.profile(use_kineto=True, use_cpu=True, profile_memory=True)
    oom_error: BaseException | None = None
    skipped = 0
    frees: list[weakref.finalize] = []
    with quiet_stderr():
        profiler.__enter__()
    try:
        prepared = _prepare(workload, config, "cpu", plan, foreach)
    except BaseException as error:  # any failure to build stops the profiler; running out of memory is a result
        with quiet_stderr():
            profiler.__exit__(None, None, None)
        if not _is_cpu_oom(error):
            raise
        return _result("cpu", "cpu", config, _Peaks(), 0, 0, tracker, error.with_traceback(None), plan)
    # Only the allocator's events while the steps run count, and the garbage collector is off meanwhile:
    # garbage left from building (or from earlier runs) is neither counted nor freed, so there is no
    # need to collect it first (a full collection costs more than a tiny model's steps).
    storages = _state_storages(prepared)
    state = {pointer: storage.nbytes() for pointer, storage in storages.items()}

    def on_phase(phase: str, step: int) -> None:
        tracker.update(phase, step)
        _mark(phase, step)

    try:
        with collector_off():  # as run_steps does, from before the steps until the profiler stops
            frees = _mark_frees_of(storages)
            del storages  # holding them would keep a replaced buffer's storage alive through the step
            _mark(_STEPS, 0)
            try:
                skipped = run_steps(prepared, config, on_phase)
            except (RuntimeError, MemoryError) as error:
                if not _is_cpu_oom(error):
                    raise
                oom_error = error.with_traceback(None)  # the traceback would keep the step's tensors alive
            finally:
                with quiet_stderr():
                    profiler.__exit__(None, None, None)
    finally:
        for finalizer in frees:
            finalizer.detach()
        del prepared
    peaks, overall = _cpu_timeline(profiler.kineto_results, state)
    return _result("cpu", "cpu", config, peaks, sum(state.values()), overall, tracker, oom_error, plan,
                   skipped_updates=skipped)


def _cpu_timeline(results: Any, state: dict[int, int]) -> tuple[_Peaks, int]:
    """Replay the allocator's events in time order from the steps' start, with the state (`state`: bytes
    by data pointer) live; the peak within each marked (phase, step) segment counts the bytes live when
    the segment begins.

    Only frees of blocks allocated in this session count: c10's ProfiledCPUMemoryReporter remembers
    the size of a block allocated while profiling and freed outside it, and would report that stale
    size against whatever block a later session places at the same address. A block of the state
    allocated before the profiler began is freed by its marker (_mark_frees_of) instead."""
    timeline: list[tuple[int, int, str | None, int, int]] = []  # (time, order, marker or None, bytes, address)
    nodes = list(results.experimental_event_tree())
    while nodes:
        node = nodes.pop()
        nodes.extend(node.children)
        kind, fields = node.typed
        if kind == _EventType.Allocation:
            if str(fields.device.type).upper() in _CPU_MEMORY_DEVICES:
                timeline.append((node.start_time_ns, fields.id, None, int(fields.alloc_size), int(fields.ptr)))
        elif node.name.startswith(_MARK):
            timeline.append((node.start_time_ns, -1, node.name[len(_MARK) :], 0, 0))
    timeline.sort(key=lambda item: (item[0], item[1]))
    peaks = _Peaks()
    live = overall = sum(state.values())
    allocated: set[int] = set()  # blocks allocated during the steps, live
    profiled_state: set[int] = set()  # blocks of the state allocated while profiling, live
    steps = False
    segment: tuple[str, int] | None = None
    for _, _, marker, nbytes, address in timeline:
        if not steps:  # building: which blocks of the state the profiler saw allocated
            if marker == f"{_STEPS}::0":
                steps = True
            elif marker is None and address in state:
                (profiled_state.add if nbytes > 0 else profiled_state.discard)(address)
            continue
        if marker is not None:
            phase, _, number = marker.rpartition("::")
            if phase == _FREED:  # a block of the state that the profiler did not see allocated
                if int(number) not in profiled_state:
                    live -= state[int(number)]
            else:
                segment = None if phase == "end" else (phase, int(number))
        elif nbytes > 0:
            allocated.add(address)
            live += nbytes
            overall = max(overall, live)
        elif address in allocated:
            allocated.discard(address)
            live += nbytes
        elif address in profiled_state:
            profiled_state.discard(address)
            live += nbytes
        if segment is not None:
            peaks.add(segment[0], segment[1], live)
    return peaks, overall


# --------------------------------------------------------------------------------------------------
# Prediction and comparison


def predict(workload: Workload, config: StepConfig, device: str, plan: Plan | None = None) -> Prediction:
    """The estimator's prediction for the same step (`memplan.estimate.estimate`). With a plan, the
    estimator is asked for the checkpointed step (through its `plan` or `transform` parameter, with
    the same `apply_plan` that measure() uses); failing that, the plan's own predicted peak is used. Raises PredictionUnavailable when there is no estimator or it fails."""
    try:
        from memplan.estimate import estimate
    except ImportError as error:
        if plan is not None and plan.predicted_peak_bytes:
            return Prediction(int(plan.predicted_peak_bytes), {}, source="plan")
        raise PredictionUnavailable(f"no estimator in this build ({error})") from None
    kind = torch.device(device).type
    try:
        parameters = inspect.signature(estimate).parameters
    except (TypeError, ValueError):
        parameters = {}
    kwargs: dict[str, Any] = {"device": kind}
    if kind == "cuda" and "gpu" in parameters:  # its compute capability sets cuBLAS's workspaces
        kwargs["gpu"] = _listed_gpu(device)
    if plan is not None:
        if "plan" in parameters:
            kwargs["plan"] = plan
        elif "transform" in parameters:  # estimate the model the plan checkpoints, as measure() runs it
            kwargs["transform"] = lambda model: apply_plan(model, plan)
        else:
            return Prediction(int(plan.predicted_peak_bytes), {}, source="plan")
    try:
        result = estimate(workload, config, **kwargs)
    except MemplanError as error:
        raise PredictionUnavailable(f"the estimator failed: {error}") from error
    except Exception as error:  # the estimator's bug must not hide the measurement
        raise PredictionUnavailable(f"the estimator failed: {type(error).__name__}: {error}") from error
    phases = {k: int(v) for k, v in (getattr(result, "phase_peaks", None) or {}).items() if k in PHASES}
    return Prediction(int(result.peak_bytes), phases, source="estimate")


def _listed_gpu(device: str) -> str | None:
    """The GPU running the step as memplan.gpus lists it (torch's name for it is an alias there); None
    for a card it does not list, which the estimator models as its default."""
    try:
        from memplan.gpus import gpu_spec

        name = torch.cuda.get_device_name(torch.device(device))
        gpu_spec(name)
        return name
    except Exception:  # noqa: BLE001 - an unlisted card, or no gpus registry in this build
        return None


def error_pct(predicted: int | None, measured: int | None) -> float | None:
    """(predicted - measured) / measured, in percent: positive when the prediction is too high."""
    if predicted is None or measured is None or measured <= 0:
        return None
    return (predicted - measured) / measured * 100.0


def compare(measurement: Measurement, prediction: Prediction | None) -> Comparison:
    rows = []
    for phase in PHASES:
        measured = measurement.phase_peaks.get(phase)
        predicted = prediction.phase_peaks.get(phase) if prediction is not None else None
        rows.append(PhaseComparison(phase, measured, predicted, error_pct(predicted, measured)))
    predicted_peak = prediction.peak_bytes if prediction is not None else None
    peak_error = error_pct(predicted_peak, measurement.measured_peak_bytes)
    rows.append(PhaseComparison("peak", measurement.measured_peak_bytes, predicted_peak, peak_error))
    return Comparison(tuple(rows), predicted_peak, peak_error)
