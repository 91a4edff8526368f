"""Predict a training step's peak memory from its trace, for a target device, without allocating it.

`simulate` replays the trace's allocation timeline through the device's allocator model;
`estimate` traces the workload and returns the peak, its phase, the categories live at the peak,
per-phase peaks and the first step apart from later ones.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from torch import nn

from memplan.devices import DeviceModel, device_model
from memplan.step import PHASES, StepConfig
from memplan.trace import ROLES, Event, Trace, trace_step
from memplan.workload import Workload

TRACED_STEPS = 2
JSON_TOP_MODULES = 10


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
    phase_breakdowns: dict[str, Breakdown]  # the categories at each phase's own peak
    first_step_peak_bytes: int
    later_steps_peak_bytes: int | None
    reserved_bytes: int | None
    top_modules: tuple[tuple[str, int], ...]  # (module path, activation bytes live at the peak), largest first
    timeline: Timeline | None = None
    # by the steps' order of running (a skipped update keeps the step's number): (nth step, phase) -> peak
    step_phase_peaks: dict[tuple[int, str], int] = field(default_factory=dict)
    step_end_bytes: tuple[int, ...] = ()  # live bytes when each step ends, in order


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
            "phase_breakdowns": {
                p: b.as_dict() for p, b in (self.simulation.phase_breakdowns.items() if self.simulation else ())
            },
            "first_step_peak_bytes": self.first_step_peak_bytes,
            "later_steps_peak_bytes": self.later_steps_peak_bytes,
            "step_flops": self.step_flops,
            "top_modules": [{"module": m, "activation_bytes": b} for m, b in self.top_modules[:JSON_TOP_MODULES]],
            "approximate": self.approximate,
            "approximate_ops": list(self.approximate_ops),
        }


def simulate(trace: Trace, device: DeviceModel, with_timeline: bool = False) -> Simulation:
    """Replay the trace's allocations and frees through the device's allocator model."""
    size = {sid: device.block_bytes(s.nbytes) for sid, s in trace.storages.items()}
    baseline = {sid: size[sid] for sid, s in trace.storages.items() if s.allocated_by is None}
    allocator = device.allocator(baseline)
    workspaces: set[str] = set()  # threads whose cuBLAS workspace is allocated
    phase, step = "setup", -1
    peak, peak_event, peak_phase, peak_step = allocator.allocated, -1, phase, step
    phase_peaks: dict[str, int] = defaultdict(int)
    phase_peak_events: dict[str, int] = {}
    step_peaks: dict[int, int] = defaultdict(int)
    step_phase_peaks: dict[tuple[int, str], int] = defaultdict(int)
    step_end_bytes: list[int] = []
    timeline_live, timeline_phases = [], []
    by_role = _by_role(trace, size, set(baseline)) if with_timeline else None

    def record(index: int) -> None:
        nonlocal peak, peak_event, peak_phase, peak_step
        moment = allocator.allocated
        if phase in PHASES:
            if moment > phase_peaks[phase]:
                phase_peaks[phase], phase_peak_events[phase] = moment, index
            step_peaks[step] = max(step_peaks[step], moment)
            nth = len(step_end_bytes)
            step_phase_peaks[nth, phase] = max(step_phase_peaks[nth, phase], moment)
        if moment > peak:
            peak, peak_event, peak_phase, peak_step = moment, index, phase, step

    events = eager_events(trace)
    for index, event in enumerate(events):  # index: the position in eager order
        if event.kind == "phase":
            phase, step = event.phase, event.step
            if phase == "end":
                step_end_bytes.append(allocator.allocated)
        elif event.kind == "alloc":
            thread = opened_workspace(device, workspaces, phase, trace.ops[event.op].name)
            if thread is not None:
                workspaces.add(thread)  # the library's workspace comes from the same allocator, once a thread
                allocator.alloc(("workspace", thread), device.workspace_bytes)
            allocator.alloc(event.storage, size[event.storage])
            if by_role is not None:
                by_role[trace.storages[event.storage].role] += size[event.storage]
        elif event.kind == "free":
            allocator.free(event.storage)
            if by_role is not None and event.storage in size:
                by_role[trace.storages[event.storage].role] -= size[event.storage]
        elif event.kind == "scratch":
            scratch = device.block_bytes(event.nbytes)
            allocator.alloc("scratch", scratch)
            record(index)
            allocator.free("scratch")
            if by_role is not None:  # the moment the scratch is live, so that plots show its spike
                timeline_live.append(dict(by_role, temporaries=by_role["temporaries"] + scratch,
                                          workspace=device.workspace_bytes * len(workspaces)))
                timeline_phases.append((phase, step))
        record(index)
        if by_role is not None:
            timeline_live.append(dict(by_role, workspace=device.workspace_bytes * len(workspaces)))
            timeline_phases.append((phase, step))

    breakdown, top = _at_event(trace, events, size, peak_event, peak)
    phase_breakdowns = {
        p: _at_event(trace, events, size, phase_peak_events[p], phase_peaks[p])[0]
        for p in PHASES
        if p in phase_peak_events
    }
    steps = sorted(step_peaks)
    return Simulation(
        peak_bytes=peak,
        peak_event=peak_event,
        peak_phase=peak_phase,
        peak_step=peak_step,
        breakdown=breakdown,
        phase_peaks={p: phase_peaks.get(p, 0) for p in PHASES},
        phase_breakdowns=phase_breakdowns,
        first_step_peak_bytes=step_peaks[steps[0]] if steps else peak,
        later_steps_peak_bytes=max(step_peaks[s] for s in steps[1:]) if len(steps) > 1 else None,
        reserved_bytes=allocator.peak_reserved,
        top_modules=top,
        timeline=Timeline(tuple(timeline_live), tuple(timeline_phases)) if by_role is not None else None,
        step_phase_peaks=dict(step_phase_peaks),
        step_end_bytes=tuple(step_end_bytes),
    )


def eager_events(trace: Trace) -> list[Event]:
    """The events in eager order. Where the trace has an out-of-place op into `old` (a sum `old + new`,
    a backward scatter into fresh zeros) that eager PyTorch does in place (Op.accumulates_in_place)
    and `old` is freed right after it, eager wrote into `old`: replay that free before the op's
    allocation, so the two never count at once."""
    return _replay_in_place_sums(trace)[0]


def in_place_sums(trace: Trace) -> dict[int, int]:
    """Each storage that eager PyTorch sums into in place (see eager_events): the op summing."""
    return _replay_in_place_sums(trace)[1]


def _replay_in_place_sums(trace: Trace) -> tuple[list[Event], dict[int, int]]:
    events = list(trace.events)
    sums = {}
    for position, event in enumerate(events):
        later = _in_place_summand(trace, events, position)
        if later is not None:
            sums[events[later].storage] = event.op
            events.insert(position, events.pop(later))
    return events, sums


def _in_place_summand(trace: Trace, events: Sequence[Event], position: int) -> int | None:
    """Where `events[position]` allocates an in-place sum: the position of the free of its summand."""
    event = events[position]
    if event.kind != "alloc" or not trace.ops[event.op].accumulates_in_place:
        return None
    op = trace.ops[event.op]
    size = trace.storages[event.storage].nbytes
    for later in range(position + 1, len(events)):
        candidate = events[later]
        if candidate.kind == "scratch" and candidate.op == event.op:
            continue  # the sum's own scratch (SDPA's add converting its mask): while it runs
        if candidate.kind != "free" or candidate.op != event.op:
            return None  # only frees that happen before the next op runs
        if op.reads and candidate.storage == op.reads[0] and trace.storages[candidate.storage].nbytes == size:
            return later  # the first operand, which eager writes into
    return None


def _thread(phase: str) -> str:
    """The thread running a phase: CUDA's autograd engine runs backward on a device thread of its own."""
    return "autograd" if phase == "backward" else "main"


def opened_workspace(device: DeviceModel, opened: set[str], phase: str, op: str) -> str | None:
    """The thread whose library workspace op `op`, run in `phase`, allocates (None: none, or already
    `opened`): cuBLAS allocates one per thread, at its first matrix product."""
    thread = _thread(phase)
    return thread if device.workspace_bytes and thread not in opened and op in device.workspace_ops else None


def _by_role(trace: Trace, size: dict[int, int], live: set[int]) -> dict[str, int]:
    counts = dict.fromkeys(ROLES, 0)
    for sid in live:
        counts[trace.storages[sid].role] += size[sid]
    return counts


def _at_event(
    trace: Trace, events: list[Event], size: dict[int, int], stop: int, peak: int
) -> tuple[Breakdown, tuple]:
    """The storages live right after event `stop`, by role; and the modules whose activations they are.
    Bytes the allocator hands out beyond the requests (scratch, library workspaces, a large block it
    does not split) count as temporaries, so that the categories add up to the peak."""
    live = {sid for sid, s in trace.storages.items() if s.allocated_by is None}
    for event in events[: stop + 1]:
        if event.kind == "alloc":
            live.add(event.storage)
        elif event.kind == "free":
            live.discard(event.storage)
    counts = _by_role(trace, size, live)
    counts["temporaries"] += peak - sum(counts.values())
    modules: dict[str, int] = defaultdict(int)
    for sid in live:
        if trace.storages[sid].role == "activations":
            modules[trace.storages[sid].module] += size[sid]
    top = tuple(sorted(modules.items(), key=lambda item: -item[1]))
    return Breakdown(**counts), top


def estimate(
    workload: Workload,
    config: StepConfig,
    device: str = "cuda",
    transform: Callable[[nn.Module], nn.Module] | None = None,
    with_timeline: bool = False,
    gpu: str | None = None,
) -> Estimate:
    """Trace the step under fake tensors and predict its memory on `device` ("cuda" or "cpu").
    `transform` changes the built model first (e.g. applies a checkpoint plan); `gpu` names the
    CUDA GPU (memplan.gpus), whose compute capability sets library workspaces."""
    return estimate_and_trace(workload, config, device, transform, with_timeline, gpu)[0]


def estimate_and_trace(
    workload: Workload,
    config: StepConfig,
    device: str = "cuda",
    transform: Callable[[nn.Module], nn.Module] | None = None,
    with_timeline: bool = False,
    gpu: str | None = None,
) -> tuple[Estimate, Trace]:
    """`estimate`, and the trace it was made from (for the planner)."""
    # Steps after the second repeat it exactly (same allocations, same order): tracing two is enough.
    traced = replace(config, steps=min(config.steps, TRACED_STEPS))
    trace = trace_step(workload, traced, device_model(device, gpu).trace_rules(config), transform=transform)
    return estimate_of_trace(workload, config, device, trace, with_timeline=with_timeline, gpu=gpu), trace


def _with_later_steps(sim: Simulation, steps: int) -> Simulation:
    """The steps after the traced ones. Each repeats the last traced step's allocations, on top of
    whatever that step left live beyond the one before it: garbage that only Python's cycle collector
    frees (off while steps run: memplan.step.run_steps, traced or measured) is left by
    every step, so the later steps' peaks rise by that growth once per step."""
    ends = sim.step_end_bytes
    if len(ends) < 2 or steps <= len(ends):
        return sim
    last = len(ends) - 1
    growth = ends[-1] - ends[-2]
    if growth <= 0:
        return sim
    extra = growth * (steps - len(ends))
    last_step = {p: v + extra for (s, p), v in sim.step_phase_peaks.items() if s == last}
    if not last_step:
        return sim
    phase_peaks = {p: max(v, last_step.get(p, 0)) for p, v in sim.phase_peaks.items()}
    top = max(last_step, key=last_step.__getitem__)
    later = last_step[top]
    peak, peak_phase = (later, top) if later > sim.peak_bytes else (sim.peak_bytes, sim.peak_phase)
    return replace(sim, peak_bytes=peak, peak_phase=peak_phase, phase_peaks=phase_peaks,
                   later_steps_peak_bytes=max(sim.later_steps_peak_bytes or 0, later))


def _host_draws(trace: Trace) -> tuple[str, ...]:
    """The host generators a module draws from at every step (Trace.host_random_modules), named as the
    estimate's assumptions: their numbers steer Python (`if random.random() < 0.5:`, a self-conditioning
    pass half the time in denoising-diffusion-pytorch), and the traced step draws other numbers than a
    real one does, so a real step may take another branch."""
    drawing = trace.host_random_modules  # a module's callers draw with it: name the innermost
    inner = [path for path in drawing if not any(other != path and (not path or other.startswith(path + "."))
                                                   for other in drawing)]
    return tuple(dict.fromkeys(f"{drawing[path]} (drawn in {path or 'the model'})" for path in inner))


def estimate_of_trace(workload: Workload, config: StepConfig, device: str, trace: Trace, *,
                      with_timeline: bool = False, gpu: str | None = None, extra_flops: int = 0) -> Estimate:
    """The estimate a traced step gives (or one rewritten from it, memplan.replay: `extra_flops` are the
    ops it adds to step 0)."""
    sim = _with_later_steps(simulate(trace, device_model(device, gpu), with_timeline=with_timeline), config.steps)
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
        step_flops=sum(op.flops for op in trace.ops if op.step == 0) + extra_flops,
        top_modules=sim.top_modules,
        approximate=bool(trace.approximate_ops) or bool(trace.host_random_modules),
        approximate_ops=trace.approximate_ops + _host_draws(trace),
        simulation=sim,
    )
