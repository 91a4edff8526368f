"""`memplan plan` and `memplan max-batch`: checkpoint plans that fit a memory budget."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from tabulate import tabulate

from cli.common import (
    BUDGET,
    MAX_BATCH,
    OVERHEAD,
    PEAK,
    PEAK_PHASE,
    BatchOpt,
    GpuOpt,
    GradAccumOpt,
    JsonOpt,
    ModelArg,
    PlotOpt,
    QuietOpt,
    SetOpt,
    budget_or_gpu,
    fits_column,
    format_pct,
    gpu_json,
    gpu_line,
    handles_errors,
    note,
    overhead_pct,
    print_json,
    progress,
    resolve_gpu,
    yes_no,
)
from cli.estimate_cmd import DeviceOpt
from memplan.closed_loop import EstimateCache
from memplan.errors import BadInput, DoesNotFit
from memplan.plan import check_output_path, save_plan, write_atomically
from memplan.planner import alternatives, max_batch, plan_checkpoints
from memplan.solvers import SOLVERS
from memplan.step import StepConfig
from memplan.timing import time_model_for
from memplan.units import format_bytes
from memplan.workload import Workload, parse_options, resolve_workload

if TYPE_CHECKING:
    from memplan.gpus import GpuSpec

BudgetOpt = Annotated[
    str | None,
    typer.Option(
        "--budget",
        help="Memory budget: 24GiB, 80GB (10^9 bytes), 512MiB or bytes. Default with --gpu: its memory less the "
        "assumed CUDA context.",
    ),
]
PrecisionOpt = Annotated[str, typer.Option("--precision", "-p", help="Precision mode.")]
OptimizerOpt = Annotated[str, typer.Option("--optimizer", "-o", help="Optimizer.")]
# brute-force is the solvers' test oracle, not a method for users.
METHODS = tuple(m for m in SOLVERS if m != "brute-force")
MethodOpt = Annotated[
    str | None,
    typer.Option("--method", help=f"Block-level solver: {', '.join(METHODS)} (default {METHODS[0]}).")
]


# Past this, counted from the start (llama2-7b's unplanned trace alone takes 11-12 s), --selective
# stops refining its search and checks the best plan so far with the estimator (a re-trace, as long); a
# plan that fits within half a minute beats a slightly cheaper one later.
SELECTIVE_TIME_LIMIT_S = 10.0
# The same for the block-level planner, whose bisection solves the chain a dozen times (seconds each for
# a 7B model's modules at every depth).
PLAN_TIME_LIMIT_S = 30.0
# max-batch searches batch sizes up to this; a result equal to it means "at least".
MAX_BATCH_LIMIT = 1 << 16


@handles_errors
def plan_command(
    model: ModelArg,
    budget: BudgetOpt = None,
    batch_size: BatchOpt = None,
    set_: SetOpt = None,
    precision: PrecisionOpt = "fp32",
    optimizer: OptimizerOpt = "adamw",
    grad_accum: GradAccumOpt = 1,
    device: DeviceOpt = "cuda",
    method: MethodOpt = None,
    selective: Annotated[
        bool, typer.Option("--selective", help="Op-level save policies inside segments: keep chosen op calls' outputs.")
    ] = False,
    gpu: GpuOpt = None,
    calibrate_cpu: Annotated[
        bool, typer.Option("--calibrate-cpu", help="With --device cpu: price recomputation with CPU time constants "
                           "measured on this machine first (about 10 s), not the built-in ones.")
    ] = False,
    out: Annotated[str | None, typer.Option("--out", help="Write the plan as JSON to this file.")] = None,
    emit: Annotated[str | None, typer.Option("--emit", help="Write a Python module applying the plan.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing --emit file.")] = False,
    plot: PlotOpt = None,
    quiet: QuietOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Choose the cheapest activation checkpoints that make the training step fit the budget (or the --gpu)."""
    from memplan import report

    card, budget_bytes = _card_and_budget(gpu, precision, device, budget)
    if method is not None and method not in METHODS:
        raise BadInput(f"unknown method {method!r}; expected one of: {', '.join(METHODS)}")
    if method is not None and selective:
        raise BadInput("--method chooses the block-level solver; --selective plans with its own")
    method = method or METHODS[0]
    if calibrate_cpu and device != "cpu":
        raise BadInput("--calibrate-cpu prices a step on this machine's CPU; use it with --device cpu")
    if plot:
        report.check_plot_path(plot)
    # Before any work: a plan that takes minutes should not fail on a path at the end.
    for path, may_overwrite in ((out, True), (emit, force)):
        if path:
            check_output_path(path, may_overwrite)
    if out and emit and Path(out).resolve() == Path(emit).resolve():
        raise BadInput(f"--out and --emit name the same file ({out}): the module would replace the plan")
    workload, config = _workload_and_step(model, batch_size, set_, precision, optimizer, grad_accum)
    processor = card and card.name
    if calibrate_cpu:
        from memplan.cpu_calibration import measure_cpu_model

        with progress("measuring this CPU's time model ...", quiet):
            processor = measure_cpu_model()
    cache = EstimateCache()
    with progress(f"planning {model}: solving and re-estimating the checkpointed step ...", quiet):
        if selective:
            from memplan.selective import plan_selective

            result = plan_selective(workload, config, budget_bytes, device, processor=processor,
                                    time_limit_s=SELECTIVE_TIME_LIMIT_S, cache=cache)
        else:
            result = plan_checkpoints(workload, config, budget_bytes, device, method, gpu=card and card.name,
                                      processor=processor, time_limit_s=PLAN_TIME_LIMIT_S, cache=cache)
    plan, floor = result.plan, result.floor
    bound = None
    if plan.feasible and plan.segments:
        with progress("bounding what any plan recomputes ...", quiet):
            bound = _least_recompute(workload, config, budget_bytes, device, processor, cache)
    others = ()
    if not plan.feasible:
        with progress("looking for what would fit instead ...", quiet):
            others = alternatives(workload, config, budget_bytes, device, gpu=card and card.name)
    if out:
        save_plan(plan, out)
    if emit and plan.feasible:
        from memplan.emit import emit_module

        write_atomically(emit, emit_module(plan), force=force)
    elif emit:
        note(f"not writing {emit}: no plan fits the budget")
    if plot:
        _plot_before_after(plot, workload, config, device, plan, budget_bytes, card, quiet)
    overhead = overhead_pct(plan.recompute_flops, plan.step_flops)
    recompute_s = plan.recompute_seconds or 0.0
    clock = time_model_for(device, processor, precision)
    usable = report.usable_bytes(card) if card else None
    if as_json:
        print_json({
            "command": "plan",
            "model": model,
            "batch_size": workload.effective_batch_size,
            "precision": precision,
            "optimizer": optimizer,
            "grad_accum": grad_accum,
            "device": device,
            "gpu": gpu_json(card),
            "feasible": plan.feasible,
            "budget_bytes": plan.budget_bytes,
            "predicted_peak_bytes": plan.predicted_peak_bytes,
            "predicted_peak_phase": result.planned.peak_phase,
            "unplanned_peak_bytes": plan.unplanned_peak_bytes,
            "unplanned_peak_phase": result.unplanned.peak_phase,
            "fits_gpu": None if usable is None else plan.predicted_peak_bytes <= usable,
            "recompute_flops": plan.recompute_flops,
            "step_flops": plan.step_flops,
            "recompute_overhead_pct": round(overhead, 3),
            "recompute_seconds": recompute_s,
            "recompute_bound_seconds": bound and bound.cost,
            "time_model": clock.name,
            "method": plan.method,
            "peak_floor_bytes": floor.peak_bytes,
            "peak_floor_op": floor.op,
            "peak_floor_phase": floor.phase,
            "segments": [
                {"modules": list(s.modules), "policy": s.policy, "saved_ops": list(s.saved_ops)} for s in plan.segments
            ],
            "excluded": [{"module": e.path, "reason": e.reason} for e in result.candidates.excluded],
            "alternatives": [
                {"change": a.description, "batch_size": a.batch_size, "grad_accum": a.grad_accum,
                 "precision": a.precision, "optimizer": a.optimizer, "peak_bytes": a.peak_bytes}
                for a in others
            ],
        })
    else:
        segments = [[", ".join(s.modules), _kept(s)] for s in plan.segments]
        segments = segments or [["(none needed)" if plan.feasible else "(none)", ""]]
        typer.echo(tabulate(segments, headers=["checkpointed segments", "outputs kept (rest recomputed)"]))
        typer.echo()
        headers = ["", PEAK, PEAK_PHASE, BUDGET, *([fits_column(card)] if card else []), OVERHEAD]

        def row(label: str, peak: int, phase: str, pct: float) -> list[str]:
            fits = [yes_no(peak <= usable)] if usable is not None else []
            return [label, format_bytes(peak), phase, format_bytes(budget_bytes), *fits, format_pct(pct)]

        typer.echo(tabulate([
            row("without a plan", plan.unplanned_peak_bytes, result.unplanned.peak_phase, 0.0),
            row("with the plan", plan.predicted_peak_bytes, result.planned.peak_phase, overhead),
        ], headers=headers, colalign=("left", *["right"] * (len(headers) - 1))))
        typer.echo(f"memory saved: {format_bytes(plan.unplanned_peak_bytes - plan.predicted_peak_bytes)}")
        typer.echo(f"recompute ≈ {1000 * recompute_s:.1f} ms per step on {clock.description}")
        if bound:
            typer.echo(f"no plan recomputes in less than {1000 * bound.cost:.1f} ms per step "
                       "(a proven lower bound, whatever the segments and the outputs kept)")
        if card:
            typer.echo(gpu_line(card))
        for excluded in result.candidates.excluded:
            note(f"not a candidate: {excluded.path}: {excluded.reason}")
        for alt in others:
            typer.echo(f"would fit instead: {alt.description}: peak {format_bytes(alt.peak_bytes)}")
    if plot:
        note(f"wrote {plot}")
    if not plan.feasible:
        reached = f"the smallest reached is {_smallest_reached(plan)}"
        if floor.peak_bytes > budget_bytes:
            raise DoesNotFit(
                f"does not fit: no checkpoint plan brings the peak under {format_bytes(budget_bytes)}; {reached}; "
                f"none can: at {floor.op} in {floor.phase} the step holds {format_bytes(floor.peak_bytes)} whatever is recomputed")
        # the floor proves nothing here: a plan the planners do not consider could lie between
        raise DoesNotFit(
            f"does not fit: no plan found brings the peak under {format_bytes(budget_bytes)}; {reached}; "
            f"none is proven impossible (no plan goes under {format_bytes(floor.peak_bytes)})")


def _least_recompute(workload, config, budget_bytes, device, processor, cache):
    """memplan.recompute_bound's bound in seconds on the plan's time model; None without scipy, whose
    MILP solver it needs (the `plan` extra)."""
    try:
        import scipy.optimize  # noqa: F401
    except ImportError:
        note("not bounding what any plan recomputes: that needs scipy (pip install scipy)")
        return None
    from memplan.recompute_bound import least_recompute

    bound = least_recompute(workload, config, budget_bytes, device, processor, cache=cache)
    return bound if math.isfinite(bound.cost) else None  # finite wherever a plan fits; JSON has no infinity


def _smallest_reached(plan) -> str:
    """The lower of the returned plan's peak and the peak without checkpoints. The exact methods already
    return no plan when that is lower; a baseline (--method every-block, ...) returns its own plan, which
    can come back above the unplanned step, and "smallest" must not say so."""
    if plan.unplanned_peak_bytes < plan.predicted_peak_bytes:
        return f"{format_bytes(plan.unplanned_peak_bytes)}, with no checkpoints"
    return format_bytes(plan.predicted_peak_bytes)


def _card_and_budget(
    gpu: str | None, precision: str, device: str, budget: str | None
) -> tuple[GpuSpec | None, int]:
    """The --gpu card (after warning if it lacks hardware for the precision) and the budget: --budget,
    else the card's usable memory."""
    card = resolve_gpu(gpu, [precision], device)
    return card, budget_or_gpu(budget, card, device)


def _workload_and_step(
    model: str, batch_size: int | None, set_: list[str] | None, precision: str, optimizer: str, grad_accum: int
) -> tuple[Workload, StepConfig]:
    """The model with its --set options at `batch_size` (None: the factory's default), and the step to plan."""
    workload = resolve_workload(model, batch_size, parse_options(set_ or []))
    return workload, StepConfig(precision=precision, optimizer=optimizer, grad_accum=grad_accum)


def _kept(segment) -> str:
    """What a selective segment keeps, as short op names: "addmm#0, mm" (call 0 of addmm, every mm);
    nothing for a full one."""
    if segment.policy != "selective":
        return "-"
    return ", ".join(name.split(".")[1] + "".join(name.partition("#")[1:]) for name in segment.saved_ops)


def _plot_before_after(path, workload, config, device, plan, budget_bytes, card, quiet) -> None:
    """Both timelines traced again with per-event detail (the planner keeps none), in one figure."""
    from memplan import report
    from memplan.emit import apply_plan
    from memplan.estimate import estimate

    with progress("tracing the step before and after checkpointing for the plot ...", quiet):
        before = estimate(workload, config, device, with_timeline=True, gpu=card and card.name)
        after = estimate(
            workload, config, device, transform=lambda m: apply_plan(m, plan), with_timeline=True, gpu=card and card.name
        )
    segments = f"{len(plan.segments)} checkpointed segment{'s' if len(plan.segments) != 1 else ''}"
    report.plot_timelines(
        path,
        [report.panel("without checkpointing", before), report.panel(f"with the plan ({segments})", after)],
        f"{workload.spec}, batch {before.batch_size}, {config.precision}, {config.optimizer}: live memory ({device})",
        budget_bytes=budget_bytes,
        gpu=card,
    )


@handles_errors
def max_batch_command(
    model: ModelArg,
    budget: BudgetOpt = None,
    set_: SetOpt = None,
    precision: PrecisionOpt = "fp32",
    optimizer: OptimizerOpt = "adamw",
    grad_accum: GradAccumOpt = 1,
    device: DeviceOpt = "cuda",
    gpu: GpuOpt = None,
    quiet: QuietOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """The largest batch size that fits the budget (or the --gpu), without and with an optimal checkpoint plan."""
    card, budget_bytes = _card_and_budget(gpu, precision, device, budget)
    workload, config = _workload_and_step(model, None, set_, precision, optimizer, grad_accum)
    with progress(f"searching the largest batch of {model} that fits {format_bytes(budget_bytes)} ...", quiet):
        result = max_batch(workload, config, budget_bytes, device, limit=MAX_BATCH_LIMIT, gpu=card and card.name)
    plan = result.plan_at_max
    overhead = overhead_pct(plan.recompute_flops, plan.step_flops) if plan else 0.0
    if as_json:
        print_json({
            "command": "max-batch",
            "model": model,
            "precision": precision,
            "optimizer": optimizer,
            "grad_accum": grad_accum,
            "device": device,
            "gpu": gpu_json(card),
            "budget_bytes": budget_bytes,
            "max_batch_without_plan": result.without_plan,
            "max_batch_with_plan": result.with_plan,
            "max_batch_limit": MAX_BATCH_LIMIT,
            "recompute_overhead_pct": round(overhead, 3),
            "segments": [{"modules": list(s.modules)} for s in plan.segments] if plan else [],
        })
    else:
        budget_text = format_bytes(budget_bytes)

        def batch(n: int) -> str:
            return f">= {n}" if n >= MAX_BATCH_LIMIT else str(n)

        typer.echo(tabulate([
            ["without checkpointing", batch(result.without_plan), budget_text, format_pct(0.0)],
            ["with an optimal plan", batch(result.with_plan), budget_text, format_pct(overhead)],
        ], headers=["", MAX_BATCH, BUDGET, OVERHEAD], colalign=("left", "right", "right", "right")))
        if card:
            typer.echo(gpu_line(card))
    if result.with_plan >= MAX_BATCH_LIMIT:
        note(f"the search stops at batch {MAX_BATCH_LIMIT}: larger batches may fit too")
    if result.with_plan == 0:
        raise DoesNotFit(f"does not fit: not even batch 1 fits in {format_bytes(budget_bytes)}")
