"""`memplan estimate`: predict a training step's peak memory for each precision x optimizer."""

from __future__ import annotations

from typing import Annotated

import typer
from tabulate import tabulate

from cli.common import BatchOpt, GradAccumOpt, JsonOpt, ModelArg, SetOpt, handles_errors, print_json
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
    as_json: JsonOpt = False,
) -> None:
    """Predict the peak memory of a training step, without allocating it, for each precision x optimizer."""
    workload = resolve_workload(model, batch_size, parse_options(set_ or []))
    configs = [
        StepConfig(precision=p, optimizer=o, grad_accum=grad_accum, steps=steps)
        for p in precision or ["fp32"]
        for o in optimizer or ["adamw"]
    ]
    results = [estimate(workload, config, device=device) for config in configs]
    if as_json:
        print_json({"model": model, "results": [r.to_json() for r in results]})
        return
    headers = ["precision", "optimizer", *CATEGORIES, "peak", "peak phase"]
    rows = [
        [r.precision, r.optimizer, *(format_bytes(getattr(r.breakdown, c)) for c in CATEGORIES),
         format_bytes(r.peak_bytes) + ("*" if r.approximate else ""), r.peak_phase]
        for r in results
    ]
    batch = results[0].batch_size
    typer.echo(f"{model}, batch {batch}, grad-accum {grad_accum}, device {device}: categories at the peak moment")
    typer.echo(tabulate(rows, headers=[h.replace("_", " ") for h in headers], stralign="right"))
    if any(r.approximate for r in results):
        ops = sorted({op for r in results for op in r.approximate_ops})
        typer.echo(f"* approximate: data-dependent shapes assumed all-selected in {', '.join(ops)}", err=True)
