"""The closed loop both planners run (memplan.planner, memplan.selective): solve, replay, tighten, bisect;
then check with the estimator (verified_search).

A solver chooses a plan by its cost model, which is only a model: a replay of the plan from the unplanned
trace (memplan.replay, `Replays`) says what it peaks at, in milliseconds; the estimator, run on the model
with the plan applied, says so for the plan returned. So a planner

1. `until_fits`: solves at a setting (what the solver is asked to fit: the block-level planner's budget,
   the selective planner's margins per phase), re-estimates the plan, and where it does not fit,
   tightens the setting by what the estimator found over (twice as hard each time the solver returns a
   plan already seen) and solves again, until a plan fits or the solver finds none;
2. `bisect`: the cost model was optimistic at the last setting whose plan did not fit, and may have been
   pessimistic at the one whose plan fits: a plan solved in between may still fit and cost less.

A planner says how to solve at a setting, how to re-estimate a plan and how to tighten a setting; which
of the plans re-estimated it returns is its own choice. Each plan is re-estimated once: `realised`
keeps every one by its segments, in the order first seen.

The planners leave out the modules they know to be unsafe to recompute (memplan.planner.unsafe_reason).
One they do not know of, whose recomputation fails the estimator (a forward that reads global state and
recomputes other shapes), ends a planner's search (`EstimateCache.realise_checked` raises
Unrecomputable); `refusing_failures` then plans again without it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Generic, TypeVar

from memplan.emit import apply_plan
from memplan.estimate import Estimate, estimate_and_trace
from memplan.plan import Plan, Segment
from memplan.step import StepConfig
from memplan.trace import Trace
from memplan.workload import Workload

S = TypeVar("S")  # a solver's own record of a solution, carried to the planner's result
R = TypeVar("R")

Setting = tuple[int, ...]  # what the solver is asked to fit, as the planner defines it


@dataclass(frozen=True)
class Candidate(Generic[S]):
    """A solver's answer, not yet re-estimated."""

    draft: Plan  # its segments as a plan; feasibility, peak and recompute cost not filled in yet
    modelled_fit: bool  # whether the solver's cost model says it fits
    solution: S


@dataclass(frozen=True)
class Outcome(Generic[S]):
    """A plan as the estimator sees it on the model with the plan applied."""

    plan: Plan  # feasible, predicted peak and recompute cost: the estimator's
    planned: Estimate
    solution: S  # of the first candidate that gave these segments


@dataclass(frozen=True)
class Tightened(Generic[S]):
    """Where `until_fits` stopped."""

    outcomes: tuple[Outcome[S], ...]  # one per round, in order
    setting: Setting  # the last setting solved at (where the last plan fits, if it does)
    loose: Setting | None  # the setting before it, whose plan did not fit; None where the first one fits

    @property
    def fits(self) -> bool:
        return self.outcomes[-1].plan.feasible


@dataclass(frozen=True)
class ClosedLoop(Generic[S]):
    solve: Callable[[Setting], Candidate[S]]
    realise: Callable[[Plan], tuple[Plan, Estimate]]  # a draft -> (the plan re-estimated, the estimate)
    # (setting, its outcome that did not fit, scale) -> the next setting, the excess counted `scale` times;
    # the same setting: solve at it again (what the outcome taught the solver's model may change its plan);
    # None: give up
    tighten: Callable[[Setting, Outcome[S], int], Setting | None]
    realised: dict[tuple[Segment, ...], Outcome[S]] = field(default_factory=dict)  # may be shared by loops

    def outcome(self, candidate: Candidate[S]) -> Outcome[S]:
        """The candidate's plan re-estimated, once per distinct set of segments."""
        segments = candidate.draft.segments
        if segments not in self.realised:
            plan, planned = self.realise(candidate.draft)
            self.realised[segments] = Outcome(plan, planned, candidate.solution)
        return self.realised[segments]

    def until_fits(self, start: Setting, rounds: int, in_time: Callable[[], bool] = lambda: True) -> Tightened[S]:
        """Solve at `start`, then at ever tighter settings, until a plan fits, the solver's model finds
        none, `tighten` gives up, `rounds` are spent or, after the first, `in_time()` is false."""
        setting, loose, scale = start, None, 1
        outcomes = []
        for _ in range(rounds):
            if outcomes and not in_time():
                break
            candidate = self.solve(setting)
            repeated = candidate.draft.segments in self.realised
            outcome = self.outcome(candidate)
            outcomes.append(outcome)
            if outcome.plan.feasible or not candidate.modelled_fit:
                break
            if repeated:
                scale *= 2  # the same plan again: tighten harder
            tighter = self.tighten(setting, outcome, scale)
            if tighter is None:
                break
            loose, setting = (loose if tighter == setting else setting), tighter
        return Tightened(tuple(outcomes), setting, loose)

    def bisect(
        self, loose: Setting, tight: Setting, rounds: int, in_time: Callable[[], bool] = lambda: True
    ) -> tuple[Outcome[S], ...]:
        """Solve halfway between a setting whose plan does not fit and one whose plan does, and move the
        bracket to whichever side the plan lands on; stop early once `in_time()` is false."""
        outcomes = []
        for _ in range(rounds):
            if not in_time():
                break
            middle = tuple((a + b) // 2 for a, b in zip(loose, tight, strict=True))
            outcome = self.outcome(self.solve(middle))
            outcomes.append(outcome)
            loose, tight = (loose, middle) if outcome.plan.feasible else (middle, tight)
        return tuple(outcomes)


@dataclass
class Replays:
    """Plans replayed from the unplanned trace, each once: `replay(plan)` fills in the plan's figures but
    its feasibility, which `realise(correction)` judges against `target`, the replayed peak raised by
    the correction of the search under way (see verified_search)."""

    replay: Callable[[Plan], tuple[Plan, Estimate]]
    target: int
    done: dict[tuple[Segment, ...], tuple[Plan, Estimate]] = field(default_factory=dict)

    def realise(self, correction: int) -> Callable[[Plan], tuple[Plan, Estimate]]:
        """A ClosedLoop's `realise` for the search with this correction."""

        def realise(plan: Plan) -> tuple[Plan, Estimate]:
            if plan.segments not in self.done:
                self.done[plan.segments] = self.replay(plan)
            replayed, planned = self.done[plan.segments]
            return replace(replayed, feasible=planned.peak_bytes + correction <= self.target), planned

        return realise


def verified_search(
    search: Callable[[int], Sequence[Outcome[S]]],
    verify: Callable[[Plan], tuple[Plan, Estimate]],
    cost: Callable[[Outcome[S]], float],
    rounds: int,
    in_time: Callable[[], bool] = lambda: True,
    refinements: int = 2,
    worth_verifying: Callable[[Outcome[S]], bool] = lambda outcome: True,
) -> list[Outcome[S]]:
    """Search over a fast model of the planned step (memplan.replay), then check with the estimator.

    `search(correction)` runs the closed loops with `realise` replaying plans, their peaks raised by
    `correction` bytes, and returns the outcomes; the cheapest that fits by them is `verify`-ed (the
    estimator on the planned model). Where the estimator finds it over, the correction becomes at least
    what the estimator found above the replay and the search runs again, until a plan fits, `rounds`
    plans are verified or `in_time()` is false. The correction is global, so it may exclude plans that
    fit: then up to `refinements` more searches halve the bracket between the last correction whose plan
    did not fit and the one whose plan did, verifying any cheaper plan they find. A plan that
    `worth_verifying` rejects (by its replay: the caller has a cheaper one) ends the search unverified.
    Returns the outcomes verified, in order."""
    checked: dict[tuple[Segment, ...], Outcome[S]] = {}

    def cheapest(correction: int, than: Outcome[S] | None = None) -> Outcome[S] | None:
        fitting = [o for o in search(correction) if o.plan.feasible and o.plan.segments not in checked
                   and (than is None or cost(o) < cost(than))]
        return min(fitting, key=lambda o: (cost(o), o.planned.peak_bytes)) if fitting else None

    def verified(chosen: Outcome[S]) -> Outcome[S]:
        plan, planned = verify(chosen.plan)
        checked[plan.segments] = Outcome(plan, planned, chosen.solution)
        return checked[plan.segments]

    correction, failed, best = 0, -1, None
    while best is None and len(checked) < rounds:
        chosen = cheapest(correction)
        if chosen is None or not worth_verifying(chosen):
            return list(checked.values())
        outcome = verified(chosen)
        if outcome.plan.feasible:
            best = outcome
        elif not in_time():
            return list(checked.values())
        else:
            failed, correction = correction, max(correction + 1, outcome.planned.peak_bytes - chosen.planned.peak_bytes)
    for _ in range(refinements):
        if best is None or correction - failed <= 1 or len(checked) >= rounds or not in_time():
            break
        middle = (failed + correction + 1) // 2
        chosen = cheapest(middle, than=best)
        if chosen is not None and not worth_verifying(chosen):
            break
        outcome = None if chosen is None else verified(chosen)
        if outcome is None or outcome.plan.feasible:  # nothing cheaper, or a cheaper plan that fits
            best, correction = outcome or best, middle
        else:
            failed = middle
    return list(checked.values())


@dataclass
class EstimateCache:
    """Estimates of one workload, unplanned and per plan: a planner re-estimates the same plans across its
    searches, and a caller planning several budgets (or both planners, as plan_selective does) shares them."""

    unplanned: dict[tuple, tuple[Estimate, Trace]] = field(default_factory=dict)
    planned: dict[tuple, tuple[Estimate, Trace]] = field(default_factory=dict)

    @staticmethod
    def _key(workload: Workload, config: StepConfig, device: str, gpu: str | None) -> tuple:
        return (workload.spec, workload.factory, workload.batch_size, tuple(sorted(workload.options.items())),
                config, device, gpu)

    def estimate(self, workload: Workload, config: StepConfig, device: str,
                 gpu: str | None = None) -> tuple[Estimate, Trace]:
        key = self._key(workload, config, device, gpu)
        if key not in self.unplanned:
            self.unplanned[key] = estimate_and_trace(workload, config, device, gpu=gpu)
        return self.unplanned[key]

    def realise(self, workload: Workload, config: StepConfig, device: str, plan: Plan,
                gpu: str | None = None) -> tuple[Estimate, Trace]:
        """The estimator on the model with `plan` applied."""
        if not plan.segments:
            return self.estimate(workload, config, device, gpu)
        key = (*self._key(workload, config, device, gpu), plan.segments)
        if key not in self.planned:
            self.planned[key] = estimate_and_trace(workload, config, device, gpu=gpu,
                                                   transform=lambda m: apply_plan(m, plan))
        return self.planned[key]

    def realise_checked(self, workload: Workload, config: StepConfig, device: str, plan: Plan,
                        gpu: str | None = None) -> tuple[Estimate, Trace]:
        """`realise`, raising Unrecomputable where the estimator fails on the planned model: with the
        modules of each segment whose recomputation alone fails it, or of every segment where none does."""
        try:
            return self.realise(workload, config, device, plan, gpu)
        except Exception as error:
            failing: dict[str, str] = {}
            for segment in plan.segments if len(plan.segments) > 1 else ():
                try:
                    self.realise(workload, config, device, replace(plan, segments=(segment,)), gpu)
                except Exception as alone:  # noqa: BLE001 - whatever failed the plan, failing alone
                    failing.update(dict.fromkeys(segment.modules, _one_line(alone)))
            raise Unrecomputable(failing or {m: _one_line(error) for s in plan.segments for m in s.modules}) from error


class Unrecomputable(Exception):
    """The estimator failed on a planned model: these modules' recomputation (path -> the error) fails it."""

    def __init__(self, modules: dict[str, str]) -> None:
        super().__init__(", ".join(f"{path}: {error}" for path, error in modules.items()))
        self.modules = modules


def _one_line(error: Exception) -> str:
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"


def refusing_failures(plan: Callable[[dict[str, str], float | None], R], time_limit_s: float | None) -> R:
    """`plan(refused, time left)`, and again with the modules of each Unrecomputable it raises refused as
    well (path -> error, for memplan.planner.unsafe_reason), until it returns; each rerun refuses at
    least one more module, so it ends. The reruns share the time limit."""
    started = time.perf_counter()
    refused: dict[str, str] = {}
    while True:
        left = None if time_limit_s is None else max(0.0, time_limit_s - (time.perf_counter() - started))
        try:
            return plan(dict(refused), left)
        except Unrecomputable as failure:
            if failure.modules.keys() <= refused.keys():  # refused already, and failing still: not ours to mend
                raise failure.__cause__ or failure from None
            refused.update(failure.modules)
