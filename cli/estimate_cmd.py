"""`memplan estimate`: predict a training step's peak memory for each precision x optimizer."""

from __future__ import annotations

from typing import Annotated

import typer
from tabulate import tabulate

from cli.common import (
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
    fits_column,
    gpu_json,
    gpu_line,
    handles_errors,
    note,
    print_json,
    progress,
    resolve_gpu,
    yes_no,
)
from memplan.estimate import estimate
from memplan.step import StepConfig
from memplan.units import format_bytes
from memplan.workload import parse_options, resolve_workload

PrecisionsOpt = Annotated[
    list[str] | None, typer.Option("--precision", "-p", help="Precision mode (repeatable); default fp32.")
]
OptimizersOpt = Annotated[
    list[str] | None, typer.Option("--optimizer", "-o", help="Optimizer (repeatable); default adamw.")
]
DeviceOpt = Annotated[str, typer.Option("--device", help="Target device: cuda or cpu.")]
StepsOpt = Annotated[int, typer.Option("--steps", help="Training steps in the contract (the first creates optimizer state).")]

CATEGORIES = ("weights", "gradients", "optimizer_state", "activations", "temporaries", "inputs")


@handles_errors
def estimate_command(
    model: ModelArg,
    batch_size: BatchOpt = None,
    set_: SetOpt = None,
    precision: PrecisionsOpt = None,
    optimizer: OptimizersOpt = None,
    grad_accum: GradAccumOpt = 1,
    device: DeviceOpt = "cuda",
    steps: StepsOpt = 3,
    gpu: GpuOpt = None,
    plot: PlotOpt = None,
    quiet: QuietOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Predict the peak memory of a training step, without allocating it, for each precision x optimizer."""
    from memplan import report

    precisions = precision or ["fp32"]
    card = resolve_gpu(gpu, precisions, device)
    if plot:
        report.check_plot_path(plot)
    workload = resolve_workload(model, batch_size, parse_options(set_ or []))
    configs = [
        StepConfig(precision=p, optimizer=o, grad_accum=grad_accum, steps=steps)
        for p in precisions
        for o in optimizer or ["adamw"]
    ]
    results = []
    for index, config in enumerate(configs):
        with progress(f"tracing {model} ({config.precision}, {config.optimizer}) ...", quiet):
            # Only the plotted (first) row needs the per-event timeline.
            results.append(
                estimate(workload, config, device=device, with_timeline=bool(plot) and index == 0, gpu=card and card.name)
            )
    usable = report.usable_bytes(card) if card else None
    if plot:
        first = results[0]
        report.plot_timelines(
            plot,
            [report.panel(f"{first.precision}, {first.optimizer}", first)],
            f"{model}, batch {first.batch_size}: live memory over the traced steps ({device})",
            gpu=card,
        )
    if as_json:
        rows = []
        for r in results:
            rows.append({
                **r.to_json(),
                "dominant": report.dominant(r).to_json(),
                "fits_gpu": None if usable is None else r.peak_bytes <= usable,
            })
        print_json({"command": "estimate", "model": model, "gpu": gpu_json(card), "results": rows})
        return
    headers = ["precision", "optimizer", *(c.replace("_", " ") for c in CATEGORIES), PEAK, PEAK_PHASE]
    if card:
        headers.append(fits_column(card))
    rows = [
        [r.precision, r.optimizer, *(format_bytes(getattr(r.breakdown, c)) for c in CATEGORIES),
         format_bytes(r.peak_bytes) + ("*" if r.approximate else ""), r.peak_phase,
         *([yes_no(r.peak_bytes <= usable)] if usable is not None else [])]
        for r in results
    ]
    batch = results[0].batch_size
    batch = "default" if batch is None else batch  # a factory without a batch_size parameter
    typer.echo(f"{model}, batch {batch}, grad-accum {grad_accum}, device {device}: categories at the peak moment")
    typer.echo(tabulate(rows, headers=headers, stralign="right"))
    for r in results:
        prefix = f"{r.precision}, {r.optimizer}: " if len(results) > 1 else ""
        typer.echo(prefix + report.dominant(r).describe())
    if card:
        typer.echo(gpu_line(card))
    if plot:
        note(f"wrote {plot}")
    if any(r.approximate for r in results):
        ops = sorted({op for r in results for op in r.approximate_ops})
        note(f"* approximate: values no trace can know were assumed in {', '.join(ops)} "
             "(README: Data-dependent shapes)")
