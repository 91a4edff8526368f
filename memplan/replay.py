"""A checkpoint plan's allocations, rewritten from the unplanned step's trace: the estimator's answer for
a planned model in milliseconds, where tracing the planned model takes a second.

What torch.utils.checkpoint (non-reentrant, with or without a selective policy) changes, per segment
and per forward call of it, is when the segment's own storages live:

- forward: a storage autograd saved only for the segment's backward (freed in backward, read by no op
  outside the segment) is freed once its last reader, or the last module call it was passed to, is
  done, and autocast's casts of the weights when the forward ends (its cache lets them go as autocast
  exits); what the policy keeps stays cached, and the segment's inputs and the CPU RNG state that the
  checkpoint stashes (host memory: counted on a CPU target) stay referenced, until the segment's backward;
- backward: at the first backward op that reads one of those storages, the segment's forward runs
  again up to the last of them (early stop), allocating as it did the first time but for the kept
  ops' outputs; what it recreates is freed where the unplanned step freed the original, the rest as
  the recomputation ends, but kept outputs past the early stop, which the policy's cache holds until
  the checkpoint lets go of its inputs.

Everything else (the other ops, gradients, the optimizer, the allocator model) is the unplanned trace.
`replay_plan` returns a trace that memplan.estimate.simulate replays like a traced one, and the ops the
plan recomputes; `estimate_replayed` the estimate of it. The estimator on the planned model stays the
reported truth (the planners run it on the plan they return, memplan.closed_loop.verified_search); this
is how they search without tracing every candidate.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass, replace

import torch

from memplan.estimate import Estimate, estimate_of_trace
from memplan.plan import Plan, Segment
from memplan.step import StepConfig, precision_rule
from memplan.timing import kept_ops
from memplan.trace import Event, ModuleCall, Storage, Trace
from memplan.workload import Workload

RNG_STATE_BYTES = torch.get_rng_state().nbytes  # checkpoint stashes the CPU generator's state per call


@dataclass(frozen=True)
class Replayed:
    trace: Trace  # the planned step's events over the unplanned step's ops and storages (and new ones)
    recomputed_ops: tuple[int, ...]  # op indices the plan runs again in backward (step 0)


class Timeline:
    """The unplanned events, with where each op's and each storage's events are."""

    def __init__(self, trace: Trace) -> None:
        self.trace = trace
        self.events = trace.events
        self.at_op: list[int] = []  # the last op that ran at each event
        current = -1
        for event in self.events:
            current = max(current, event.op)
            self.at_op.append(current)
        self.phases = {(e.phase, e.step): i for i, e in reversed(list(enumerate(self.events))) if e.kind == "phase"}
        self.alloc = {e.storage: i for i, e in enumerate(self.events) if e.kind == "alloc"}
        self.free = {e.storage: i for i, e in enumerate(self.events) if e.kind == "free"}
        self.readers: dict[int, list[int]] = defaultdict(list)
        for op in trace.ops:
            for s in op.reads:
                self.readers[s].append(op.index)

    def first_event_of(self, op: int) -> int:
        """The position of the first event at or after `op` that is not a phase mark."""
        i = bisect.bisect_left(self.at_op, op)
        while i < len(self.events) and self.events[i].kind == "phase":
            i += 1
        return i

    def after_op(self, op: int, start: int) -> int:
        """The position just after op `op`'s events, searching from `start`."""
        return bisect.bisect_right(self.at_op, op, lo=start)

    def phase_start(self, phase: str, step: int) -> int:
        return self.phases.get((phase, step), len(self.events))

    def forward_reads_within(self, storage: int, first: int, end: int) -> bool:
        """Whether every forward op that reads the storage is among ops [first, end)."""
        return all(first <= r < end or self.trace.ops[r].phase != "forward" for r in self.readers[storage])

    def freed_in(self, storage: int, phase: str, step: int) -> bool:
        position = self.free.get(storage)
        if position is None:
            return False
        op = self.trace.ops[self.at_op[position]]
        return op.phase == phase and op.step == step


def casts_weight(trace: Trace, storage: Storage) -> bool:
    """Whether the storage is a copy of a weight (autocast's cast of a parameter)."""
    op = trace.ops[storage.allocated_by]
    return op.name == "aten._to_copy.default" and any(trace.storages[s].role == "weights" for s in op.reads)


def _segment_calls(trace: Trace, segment: Segment) -> list[tuple[ModuleCall, ModuleCall]]:
    """(first module's call, last module's call) of each forward call of the segment, every step."""
    def forward_calls(path: str) -> list[ModuleCall]:
        return sorted((c for c in trace.calls if c.phase == "forward" and c.path == path), key=lambda c: c.first_op)

    return list(zip(forward_calls(segment.modules[0]), forward_calls(segment.modules[-1]), strict=False))


def replay_plan(trace: Trace, plan: Plan, line: Timeline | None = None) -> Replayed:
    """The events of the step with `plan` applied (see the module docstring). `line`: the trace's
    Timeline, where one is kept for several plans."""
    ops = trace.ops
    autocast = precision_rule(plan.precision).autocast_dtype is not None
    line = line or Timeline(trace)
    storages = dict(trace.storages)
    next_id = max(storages, default=-1) + 1
    before: dict[int, list[Event]] = defaultdict(list)  # position -> events inserted before it
    dropped: set[int] = set()  # positions of frees that happen elsewhere now
    renamed: dict[int, int] = {}  # position of a free -> the recomputed storage it frees instead
    recomputed_ops: list[int] = []

    def added(storage: Storage) -> int:
        """A storage the planned step allocates beyond the unplanned one's, under a new id."""
        nonlocal next_id
        sid, next_id = next_id, next_id + 1
        storages[sid] = replace(storage, id=sid)
        return sid

    for segment in plan.segments:
        for head, tail in _segment_calls(trace, segment):
            first, end, step = head.first_op, tail.end_op, head.step
            forward_end = next((op.index for op in ops[end:] if op.phase != "forward" or op.step != step), len(ops))
            kept = kept_ops(trace.ops[first:end], segment.saved_ops) if segment.policy == "selective" else set()
            allocated = [s for op in ops[first:end] for s in op.allocates]
            cached = {s for s in allocated if storages[s].allocated_by in kept}
            recreated = {s: None for s in allocated if s not in cached and line.freed_in(s, "backward", step)
                         and line.forward_reads_within(s, first, end)}  # an ordered set
            # forward: held until the last reader, or the last call it was passed to, is done; autocast's
            # casts of the weights until the forward ends (its cache lets go as autocast exits)
            held_until = {s: forward_end - 1 if autocast and casts_weight(trace, storages[s]) else
                          max([storages[s].allocated_by, *(r for r in line.readers[s] if first <= r < end)])
                          for s in recreated}
            for call in trace.calls:
                if call.phase == "forward" and first <= call.first_op and call.end_op <= end:
                    for s in call.inputs:
                        if s in held_until:
                            held_until[s] = max(held_until[s], call.end_op - 1)
            for s in recreated:
                before[line.after_op(held_until[s], line.alloc[s])].append(Event("free", s, op=held_until[s]))
                dropped.add(line.free[s])
            # referenced until the segment's backward: the policy's cache, the inputs, the RNG state
            waiting = [s for s in cached if line.freed_in(s, "forward", step)]
            inputs = [s for s in head.inputs if storages[s].allocated_by is not None and line.freed_in(s, "forward", step)]
            dropped.update(line.free[s] for s in (*waiting, *inputs))
            rng = ()  # host memory: on a CPU target only
            if plan.device == "cpu":
                rng = (added(Storage(-1, RNG_STATE_BYTES, "activations", first, segment.modules[0])),)
                before[line.first_event_of(first)].append(Event("alloc", rng[0], op=first))

            # backward: the recomputation, at the first backward op reading what it recreates or caches for
            # its own backward (not an output that ops after it read: their backward reads it unpacked)
            watched = set(recreated) | {s for s in cached if line.forward_reads_within(s, first, end)}
            readers = [r for s in watched for r in line.readers[s] if ops[r].phase == "backward" and ops[r].step == step]
            starts = [line.free[s] for s in recreated] + ([line.first_event_of(min(readers))] if readers else [])
            at = min(starts, default=line.phase_start("optimizer", step))
            # early stop: at the forward's last save for backward, where the trace puts it (an in-place
            # writer of a recreated tensor, dropout's bernoulli_ and div_ on its mask, runs too); never
            # before the last tensor it recreates, each of which the replay makes again (so in all 842
            # segment calls of benchmarks/replay.py's plans; the second term only guards that)
            stop = max(trace.early_stop(first, end, tail.closed),
                       max((storages[s].allocated_by for s in recreated), default=first - 1))
            if step == 0:
                recomputed_ops.extend(op.index for op in ops[first : stop + 1] if op.index not in kept)
            again: dict[int, int] = {}
            events = []
            for i in range(line.first_event_of(first), len(line.events)):
                event = line.events[i]
                if line.at_op[i] > stop:
                    break
                if event.kind == "alloc" and event.storage not in cached:
                    again[event.storage] = added(storages[event.storage])
                    events.append(Event("alloc", again[event.storage], op=event.op))
                elif event.kind == "free" and event.storage in again and event.storage not in recreated:
                    events.append(Event("free", again.pop(event.storage), op=event.op))
                elif event.kind == "scratch":
                    events.append(event)
            events += [Event("free", sid, op=stop) for s, sid in again.items() if s not in recreated]
            # the policy's cache hands a kept output back as the recomputation reaches its op; one past
            # the early stop it keeps, with the checkpoint's frame
            consumed = [s for s in waiting if storages[s].allocated_by <= stop]
            events += [Event("free", s, op=stop) for s in consumed]
            before[at].extend(events)
            for s in recreated:
                renamed[line.free[s]] = again[s]
            # the checkpoint's frame lets go of its inputs, RNG state and cache once its last saved
            # tensor is freed
            last = max((line.free[s] for s in recreated), default=at - 1)
            frame = (*inputs, *rng, *(s for s in waiting if s not in consumed))
            before[last + 1].extend(Event("free", s, op=line.at_op[last]) for s in frame)

    events = []
    for position, event in enumerate(line.events):
        events += before.get(position, ())
        if position in renamed:
            events.append(replace(event, storage=renamed[position]))
        elif position not in dropped:
            events.append(event)
    events += before.get(len(line.events), ())
    return Replayed(replace(trace, events=tuple(events), storages=storages), tuple(sorted(set(recomputed_ops))))


def estimate_replayed(workload: Workload, config: StepConfig, device: str, trace: Trace, plan: Plan,
                      line: Timeline | None = None, gpu: str | None = None) -> tuple[Estimate, Replayed]:
    """The estimate of `plan` replayed from the unplanned `trace`, and the replay itself."""
    replayed = replay_plan(trace, plan, line)
    planned = estimate_of_trace(workload, config, device, replayed.trace, gpu=gpu,
                                extra_flops=sum(trace.ops[i].flops for i in replayed.recomputed_ops))
    return planned, replayed
