"""Predict a training step's peak memory from its trace, for a target device, without allocating it.

`simulate` replays the trace's allocation timeline through the device's allocator model;
`estimate` traces the workload and returns the peak, its phase, the categories live at the peak,
per-phase peaks and the first step apart from later ones.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

from memplan.devices import DeviceModel, device_model
from memplan.step import PHASES, StepConfig
from memplan.trace import ROLES, Trace, trace_step
from memplan.workload import Workload


@dataclass(frozen=True)
class Breakdown:
    weights: int = 0
    gradients: int = 0
    optimizer_state: int = 0
    activations: int = 0
    temporaries: int = 0
    inputs: int = 0

    def as_dict(self) -> dict[str, int]:
        return {role: getattr(self, role) for role in ROLES}


@dataclass(frozen=True)
class Timeline:
    """Live bytes by role after each event of the trace (for plots), with the phase in force."""

    live: tuple[dict[str, int], ...]
    phases: tuple[tuple[str, int], ...]  # (phase, step) at each point


@dataclass(frozen=True)
class Simulation:
    peak_bytes: int
    peak_event: int
    peak_phase: str
    peak_step: int
    breakdown: Breakdown
    phase_peaks: dict[str, int]
    first_step_peak_bytes: int
    later_steps_peak_bytes: int | None
    reserved_bytes: int | None
    top_modules: tuple[tuple[str, int], ...]  # (module path, activation bytes live at the peak)
    timeline: Timeline | None = None


@dataclass(frozen=True)
class Estimate:
    model: str
    precision: str
    optimizer: str
    batch_size: int | None
    grad_accum: int
    device: str
    peak_bytes: int
    reserved_bytes: int | None
    peak_phase: str
    breakdown: Breakdown
    phase_peaks: dict[str, int]
    first_step_peak_bytes: int
    later_steps_peak_bytes: int | None
    step_flops: int
    top_modules: tuple[tuple[str, int], ...]
    approximate: bool
    approximate_ops: tuple[str, ...] = ()
    simulation: Simulation | None = field(default=None, repr=False, compare=False)

    def to_json(self) -> dict:
        return {
            "precision": self.precision,
            "optimizer": self.optimizer,
            "batch_size": self.batch_size,
            "grad_accum": self.grad_accum,
            "device": self.device,
            "peak_bytes": self.peak_bytes,
            "reserved_bytes": self.reserved_bytes,
            "peak_phase": self.peak_phase,
            "breakdown": self.breakdown.as_dict(),
            "phase_peaks": dict(self.phase_peaks),
            "first_step_peak_bytes": self.first_step_peak_bytes,
            "later_steps_peak_bytes": self.later_steps_peak_bytes,
            "step_flops": self.step_flops,
            "top_modules": [{"module": m, "activation_bytes": b} for m, b in self.top_modules],
            "approximate": self.approximate,
            "approximate_ops": list(self.approximate_ops),
        }


def simulate(trace: Trace, device: DeviceModel, with_timeline: bool = False) -> Simulation:
    """Replay the trace's allocations and frees through the device's allocator accounting."""
    size = {sid: device.block_bytes(s.nbytes) for sid, s in trace.storages.items()}
    live = {sid for sid, s in trace.storages.items() if s.allocated_by is None}
    total = sum(size[sid] for sid in live)
    workspaces: set[str] = set()  # threads whose cuBLAS workspace is allocated
    phase, step = "setup", -1
    peak, peak_event, peak_phase, peak_step = total, -1, phase, step
    phase_peaks: dict[str, int] = defaultdict(int)
    step_peaks: dict[int, int] = defaultdict(int)
    timeline_live, timeline_phases = [], []
    by_role = _by_role(trace, size, live) if with_timeline else None
    reserved = device.new_reserved_tracker(total) if device.new_reserved_tracker else None

    def record(moment_bytes: int, index: int) -> None:
        nonlocal peak, peak_event, peak_phase, peak_step
        if phase in PHASES:
            phase_peaks[phase] = max(phase_peaks[phase], moment_bytes)
            step_peaks[step] = max(step_peaks[step], moment_bytes)
        if moment_bytes > peak:
            peak, peak_event, peak_phase, peak_step = moment_bytes, index, phase, step

    for index, event in enumerate(trace.events):
        if event.kind == "phase":
            phase, step = event.phase, event.step
            record(total, index)
            continue
        if event.kind == "alloc":
            thread = _thread(phase)
            if device.workspace_bytes and thread not in workspaces and trace.ops[event.op].name in device.workspace_ops:
                workspaces.add(thread)  # the library's workspace comes from the same allocator, once a thread
                total += device.workspace_bytes
                if reserved:
                    reserved.alloc(f"workspace-{thread}", device.workspace_bytes)
            live.add(event.storage)
            total += size[event.storage]
            if reserved:
                reserved.alloc(event.storage, size[event.storage])
            if by_role is not None:
                by_role[trace.storages[event.storage].role] += size[event.storage]
            record(total, index)
        elif event.kind == "free":
            if event.storage in live:
                live.discard(event.storage)
                total -= size[event.storage]
                if reserved:
                    reserved.free(event.storage)
                if by_role is not None:
                    by_role[trace.storages[event.storage].role] -= size[event.storage]
        elif event.kind == "scratch":
            scratch = device.block_bytes(event.nbytes)
            if reserved:
                reserved.alloc("scratch", scratch)
                reserved.free("scratch")
            record(total + scratch, index)
        if by_role is not None:
            timeline_live.append(dict(by_role, workspace=device.workspace_bytes * len(workspaces)))
            timeline_phases.append((phase, step))

    breakdown, top = _at_event(trace, size, peak_event, device)
    steps = sorted(step_peaks)
    return Simulation(
        peak_bytes=peak,
        peak_event=peak_event,
        peak_phase=peak_phase,
        peak_step=peak_step,
        breakdown=breakdown,
        phase_peaks={p: phase_peaks.get(p, 0) for p in PHASES},
        first_step_peak_bytes=step_peaks[steps[0]] if steps else peak,
        later_steps_peak_bytes=max(step_peaks[s] for s in steps[1:]) if len(steps) > 1 else None,
        reserved_bytes=reserved.peak_reserved if reserved else None,
        top_modules=top,
        timeline=Timeline(tuple(timeline_live), tuple(timeline_phases)) if by_role is not None else None,
    )


def _thread(phase: str) -> str:
    """The thread running a phase: CUDA's autograd engine runs backward on a device thread of its own."""
    return "autograd" if phase == "backward" else "main"


def _by_role(trace: Trace, size: dict[int, int], live: set[int]) -> dict[str, int]:
    counts = dict.fromkeys(ROLES, 0)
    for sid in live:
        counts[trace.storages[sid].role] += size[sid]
    return counts


def _at_event(trace: Trace, size: dict[int, int], stop: int, device: DeviceModel) -> tuple[Breakdown, tuple]:
    """The storages live right after event `stop`, by role; and the modules whose activations they are."""
    live = {sid for sid, s in trace.storages.items() if s.allocated_by is None}
    scratch = 0
    workspaces, phase = set(), "setup"
    for index, event in enumerate(trace.events[: stop + 1]):
        if event.kind == "phase":
            phase = event.phase
        elif event.kind == "alloc":
            live.add(event.storage)
            if device.workspace_bytes and trace.ops[event.op].name in device.workspace_ops:
                workspaces.add(_thread(phase))
        elif event.kind == "free":
            live.discard(event.storage)
        elif event.kind == "scratch" and index == stop:
            scratch = device.block_bytes(event.nbytes)
    counts = _by_role(trace, size, live)
    counts["temporaries"] += scratch + device.workspace_bytes * len(workspaces)
    modules: dict[str, int] = defaultdict(int)
    for sid in live:
        if trace.storages[sid].role == "activations":
            modules[trace.storages[sid].module] += size[sid]
    top = tuple(sorted(modules.items(), key=lambda item: -item[1])[:5])
    return Breakdown(**counts), top


def estimate(
    workload: Workload,
    config: StepConfig,
    device: str = "cuda",
    transform: Callable[[nn.Module], nn.Module] | None = None,
    with_timeline: bool = False,
) -> Estimate:
    """Trace the step under fake tensors and predict its memory on `device` ("cuda" or "cpu")."""
    model = device_model(device)
    trace = trace_step(workload, config, model.trace_rules(config), transform=transform)
    sim = simulate(trace, model, with_timeline=with_timeline)
    return Estimate(
        model=workload.spec,
        precision=config.precision,
        optimizer=config.optimizer,
        batch_size=workload.effective_batch_size,
        grad_accum=config.grad_accum,
        device=device,
        peak_bytes=sim.peak_bytes,
        reserved_bytes=sim.reserved_bytes,
        peak_phase=sim.peak_phase,
        breakdown=sim.breakdown,
        phase_peaks=sim.phase_peaks,
        first_step_peak_bytes=sim.first_step_peak_bytes,
        later_steps_peak_bytes=sim.later_steps_peak_bytes,
        step_flops=sum(op.flops for op in trace.ops if op.step == 0),
        top_modules=sim.top_modules,
        approximate=bool(trace.approximate_ops),
        approximate_ops=trace.approximate_ops,
        simulation=sim,
    )
