"""`memplan plan` and `memplan max-batch`: checkpoint plans that fit a memory budget."""

from __future__ import annotations

from typing import Annotated

import typer
from tabulate import tabulate

from cli.common import BatchOpt, GradAccumOpt, JsonOpt, ModelArg, SetOpt, handles_errors, print_json
from cli.estimate_cmd import DeviceOpt
from memplan.errors import DoesNotFit
from memplan.plan import save_plan, write_atomically
from memplan.planner import alternatives, max_batch, plan_checkpoints
from memplan.solvers import SOLVERS
from memplan.step import StepConfig
from memplan.units import format_bytes, parse_size
from memplan.workload import parse_options, resolve_workload

BudgetOpt = Annotated[str, typer.Option("--budget", help="Memory budget: 24GiB, 80GB (10^9 bytes), 512MiB or bytes.")]
PrecisionOpt = Annotated[str, typer.Option("--precision", "-p", help="Precision mode.")]
OptimizerOpt = Annotated[str, typer.Option("--optimizer", "-o", help="Optimizer.")]
MethodOpt = Annotated[str, typer.Option("--method", help=f"Solver: {', '.join(SOLVERS)}.")]


@handles_errors
def plan_command(
    model: ModelArg,
    budget: BudgetOpt,
    batch_size: BatchOpt = None,
    set_: SetOpt = None,
    precision: PrecisionOpt = "fp32",
    optimizer: OptimizerOpt = "adamw",
    grad_accum: GradAccumOpt = 1,
    device: DeviceOpt = "cuda",
    method: MethodOpt = "optimal-dp",
    out: Annotated[str | None, typer.Option("--out", help="Write the plan as JSON to this file.")] = None,
    emit: Annotated[str | None, typer.Option("--emit", help="Write a Python module applying the plan.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing --emit file.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Choose the cheapest activation checkpoints that make the training step fit the budget."""
    budget_bytes = parse_size(budget)
    if method not in SOLVERS or method == "brute-force":
        raise typer.BadParameter(f"unknown method {method!r}; expected one of: {', '.join(m for m in SOLVERS if m != 'brute-force')}")
    workload = resolve_workload(model, batch_size, parse_options(set_ or []))
    config = StepConfig(precision=precision, optimizer=optimizer, grad_accum=grad_accum)
    result = plan_checkpoints(workload, config, budget_bytes, device, method)
    plan = result.plan
    others = () if plan.feasible else alternatives(workload, config, budget_bytes, device)
    if out:
        save_plan(plan, out)
    if emit and plan.feasible:
        from memplan.emit import emit_module

        write_atomically(emit, emit_module(plan), force=force)
    overhead = plan.recompute_flops / plan.step_flops if plan.step_flops else 0.0
    if as_json:
        print_json({
            "feasible": plan.feasible,
            "budget_bytes": plan.budget_bytes,
            "predicted_peak_bytes": plan.predicted_peak_bytes,
            "unplanned_peak_bytes": plan.unplanned_peak_bytes,
            "recompute_flops": plan.recompute_flops,
            "step_flops": plan.step_flops,
            "recompute_overhead_pct": round(100 * overhead, 3),
            "method": plan.method,
            "segments": [{"modules": list(s.modules)} for s in plan.segments],
            "excluded": [{"module": e.path, "reason": e.reason} for e in result.candidates.excluded],
            "alternatives": [
                {"change": a.description, "batch_size": a.batch_size, "grad_accum": a.grad_accum,
                 "precision": a.precision, "optimizer": a.optimizer, "peak_bytes": a.peak_bytes}
                for a in others
            ],
        })
    else:
        rows = [[", ".join(s.modules)] for s in plan.segments] or [["(none needed)"]]
        typer.echo(tabulate(rows, headers=["checkpointed segments"]))
        typer.echo(tabulate([
            ["budget", format_bytes(budget_bytes)],
            ["predicted peak (re-estimated)", format_bytes(plan.predicted_peak_bytes)],
            ["peak without a plan", format_bytes(plan.unplanned_peak_bytes)],
            ["memory saved", format_bytes(plan.unplanned_peak_bytes - plan.predicted_peak_bytes)],
            ["recompute overhead", f"{100 * overhead:.1f}% of step FLOPs"],
        ], tablefmt="plain"))
        for excluded in result.candidates.excluded:
            typer.echo(f"not a candidate: {excluded.path}: {excluded.reason}", err=True)
        for alt in others:
            typer.echo(f"would fit instead: {alt.description}: peak {format_bytes(alt.peak_bytes)}")
    if not plan.feasible:
        raise DoesNotFit(
            f"does not fit: no checkpoint plan brings the peak under {format_bytes(budget_bytes)}; "
            f"the smallest reached is {format_bytes(plan.predicted_peak_bytes)}"
        )


@handles_errors
def max_batch_command(
    model: ModelArg,
    budget: BudgetOpt,
    set_: SetOpt = None,
    precision: PrecisionOpt = "fp32",
    optimizer: OptimizerOpt = "adamw",
    grad_accum: GradAccumOpt = 1,
    device: DeviceOpt = "cuda",
    as_json: JsonOpt = False,
) -> None:
    """The largest batch size that fits the budget, without and with an optimal checkpoint plan."""
    budget_bytes = parse_size(budget)
    workload = resolve_workload(model, None, parse_options(set_ or []))
    config = StepConfig(precision=precision, optimizer=optimizer, grad_accum=grad_accum)
    result = max_batch(workload, config, budget_bytes, device)
    plan = result.plan_at_max
    overhead = plan.recompute_flops / plan.step_flops if plan and plan.step_flops else 0.0
    if as_json:
        print_json({
            "budget_bytes": budget_bytes,
            "max_batch_without_plan": result.without_plan,
            "max_batch_with_plan": result.with_plan,
            "recompute_overhead_pct": round(100 * overhead, 3),
            "segments": [{"modules": list(s.modules)} for s in plan.segments] if plan else [],
        })
    else:
        typer.echo(tabulate([
            ["without checkpointing", result.without_plan, "0.0%"],
            ["with an optimal plan", result.with_plan, f"{100 * overhead:.1f}%"],
        ], headers=["", "max batch", "recompute overhead"]))
    if result.with_plan == 0:
        raise DoesNotFit(f"does not fit: not even batch 1 fits in {format_bytes(budget_bytes)}")
