"""`memplan verify`: run the training step for real, measure its memory, compare with the prediction."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from tabulate import tabulate

from cli.common import (
    BatchOpt,
    GradAccumOpt,
    JsonOpt,
    ModelArg,
    QuietOpt,
    SetOpt,
    handles_errors,
    note,
    print_json,
    progress,
)
from memplan.errors import BadInput, DoesNotFit, ToleranceExceeded
from memplan.plan import check_output_path, load_plan
from memplan.step import OPTIMIZERS, PRECISIONS, StepConfig
from memplan.units import format_bytes
from memplan.verify import (
    Comparison,
    Measurement,
    Prediction,
    PredictionUnavailable,
    check_plan,
    check_supported,
    compare,
    measure,
    plan_mismatches,
    predict,
    resolve_device,
)
from memplan.workload import Workload, parse_options, resolve_workload

PrecisionOpt = Annotated[str, typer.Option("--precision", "-p", help=f"Precision: {', '.join(PRECISIONS)}.")]
OptimizerOpt = Annotated[str, typer.Option("--optimizer", "-o", help=f"Optimizer: {', '.join(OPTIMIZERS)}.")]
StepsOpt = Annotated[
    int, typer.Option("--steps", help="Training steps to run (the first one creates optimizer state).")
]
DeviceOpt = Annotated[
    str | None, typer.Option("--device", help="cuda (default when a GPU is available), cuda:N or cpu.")
]
PlanOpt = Annotated[
    Path | None, typer.Option("--plan", help="A checkpoint plan (plan.json) to apply to the model before measuring.")
]
ToleranceOpt = Annotated[
    float | None,
    typer.Option(
        "--tolerance",
        help="Exit 3 when the measured peak differs from the predicted one by more than PCT %.",
        metavar="PCT",
    ),
]
SnapshotOpt = Annotated[
    Path | None,
    typer.Option(
        "--snapshot", help="CUDA: write a memory snapshot (open it at pytorch.org/memory_viz).", metavar="FILE"
    ),
]
NoPredictOpt = Annotated[bool, typer.Option("--no-predict", help="Measure only; do not run the estimator.")]


@handles_errors
def verify_command(
    model: ModelArg,
    batch_size: BatchOpt = None,
    set_: SetOpt = None,
    precision: PrecisionOpt = "fp32",
    optimizer: OptimizerOpt = "adamw",
    grad_accum: GradAccumOpt = 1,
    steps: StepsOpt = 3,
    device: DeviceOpt = None,
    plan: PlanOpt = None,
    tolerance: ToleranceOpt = None,
    snapshot: SnapshotOpt = None,
    no_predict: NoPredictOpt = False,
    quiet: QuietOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Run the training step for real and measure its peak memory, per phase, beside the prediction."""
    if tolerance is not None and not (math.isfinite(tolerance) and tolerance >= 0):
        raise BadInput(f"--tolerance must be a percentage of at least 0, got {tolerance}")
    if tolerance is not None and no_predict:
        raise BadInput("--tolerance compares with the prediction; it cannot be used with --no-predict")
    config = StepConfig(precision=precision, optimizer=optimizer, grad_accum=grad_accum, steps=steps)
    device = resolve_device(device)
    check_supported(config, device)
    workload = resolve_workload(model, batch_size, parse_options(set_ or []))
    loaded = None
    if plan is not None:
        loaded = load_plan(plan)
        check_plan(loaded, workload)
        for mismatch in plan_mismatches(loaded, workload, config):
            note(f"note: {mismatch}")
    if tolerance is not None and importlib.util.find_spec("memplan.estimate") is None and loaded is None:
        raise BadInput("--tolerance needs a prediction, but this build has no estimator (memplan.estimate)")

    # either order gives the same figures: the trace and the real step each empty the model caches they
    # fill (memplan.step.model_caches_emptied_after)
    prediction, prediction_error = None, None
    if not no_predict:
        try:
            with progress(f"tracing {model} for the prediction ...", quiet):
                prediction = predict(workload, config, device, loaded)
        except PredictionUnavailable as error:
            if tolerance is not None:
                raise BadInput(f"--tolerance needs a prediction: {error}") from None
            prediction_error = str(error)
    with progress(f"running {config.steps} real steps of {model} on {device} ...", quiet):
        measurement = _measure_to(snapshot, lambda path: measure(workload, config, device, loaded, snapshot=path))
    if prediction_error is not None:  # said once there is a measurement: where the real step fails too, its error is the one line
        note(f"no prediction: {prediction_error}")

    comparison = compare(measurement, prediction)

    if as_json:
        print_json(_payload(workload, config, measurement, prediction, comparison, prediction_error))
    else:
        typer.echo(_table(workload, config, measurement, prediction, comparison))

    if measurement.oom:
        raise DoesNotFit(f"does not fit: {_oom_where(measurement)}")
    if tolerance is not None and not comparison.within(tolerance):
        raise ToleranceExceeded(
            f"measured peak {format_bytes(measurement.measured_peak_bytes)} and predicted "
            f"{format_bytes(comparison.predicted_peak_bytes or 0)} differ by {comparison.error_pct:+.1f}%, "
            f"more than the tolerance of {tolerance:g}%"
        )


def _measure_to(snapshot: Path | None, run: Callable[[Path | None], Measurement]) -> Measurement:
    """run(path) with the --snapshot written to a temporary file beside it, renamed once complete: a failed
    or interrupted run leaves no partial snapshot."""
    if snapshot is None:
        return run(None)
    check_output_path(snapshot)
    fd, name = tempfile.mkstemp(dir=snapshot.parent, prefix=f".{snapshot.name}.", suffix=".tmp")
    os.close(fd)
    partial = Path(name)
    try:
        measurement = run(partial)
        if measurement.snapshot_path is not None:
            os.replace(partial, snapshot)
            measurement = dataclasses.replace(measurement, snapshot_path=str(snapshot))
        return measurement
    finally:
        partial.unlink(missing_ok=True)


def _oom_where(measurement: Measurement) -> str:
    if measurement.oom_phase == "setup":
        return f"out of memory while building the model and moving it to {measurement.device}"
    return f"out of memory in {measurement.oom_phase} of step {measurement.oom_step}"


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def _payload(
    workload: Workload,
    config: StepConfig,
    measurement: Measurement,
    prediction: Prediction | None,
    comparison: Comparison,
    prediction_error: str | None,
) -> dict[str, Any]:
    return {
        "command": "verify",
        "model": workload.spec,
        "batch_size": workload.effective_batch_size,
        "options": dict(workload.options),
        "precision": config.precision,
        "optimizer": config.optimizer,
        "grad_accum": config.grad_accum,
        **measurement.to_json(),
        "predicted_peak_bytes": comparison.predicted_peak_bytes,
        "predicted_phase_peaks": dict(prediction.phase_peaks) if prediction is not None else None,
        "prediction_source": prediction.source if prediction is not None else None,
        "prediction_error": prediction_error,
        "error_pct": _round(comparison.error_pct),
        "phase_error_pct": {row.phase: _round(row.error_pct) for row in comparison.rows if row.phase != "peak"},
    }


def _fmt(value: int | None) -> str:
    return "-" if value is None else format_bytes(value)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1f}%"


def _table(
    workload: Workload,
    config: StepConfig,
    measurement: Measurement,
    prediction: Prediction | None,
    comparison: Comparison,
) -> str:
    where = measurement.device if measurement.device == "cpu" else f"{measurement.device} ({measurement.device_name})"
    batch = workload.effective_batch_size
    head = (
        f"{workload.spec}, batch {batch if batch is not None else 'default'}, {config.precision}, {config.optimizer}"
        f"{f', grad accum {config.grad_accum}' if config.grad_accum > 1 else ''}, {config.steps} step{'s' if config.steps != 1 else ''} on {where}"
        f"{f', plan {measurement.plan_method}' if measurement.plan_method else ''}"
    )
    if measurement.oom:
        head += f" - {_oom_where(measurement)} (figures up to then)"
    rows = [
        [row.phase, _fmt(row.measured_bytes), _fmt(row.predicted_bytes), _pct(row.error_pct)] for row in comparison.rows
    ]
    lines = [
        head,
        "",
        tabulate(
            rows, headers=["phase", "measured", "predicted", "error %"], colalign=("left", "right", "right", "right")
        ),
    ]
    lines.append("")
    extra = [
        ("live at start (weights, inputs)", _fmt(measurement.baseline_bytes)),
        ("first step peak", _fmt(measurement.first_step_peak_bytes)),
    ]
    if measurement.later_steps_peak_bytes is not None:
        extra.append(("later steps peak", _fmt(measurement.later_steps_peak_bytes)))
    if measurement.skipped_updates:
        skipped = f"{measurement.skipped_updates} step(s) whose update the GradScaler skipped (inf/NaN gradients)"
        extra.append(("run again", skipped))
    if measurement.measured_reserved_bytes is not None:
        extra.append(("reserved (caching allocator)", _fmt(measurement.measured_reserved_bytes)))
    if measurement.cuda_context_bytes is not None:
        extra.append(("CUDA context", _fmt(measurement.cuda_context_bytes)))
    if measurement.total_memory_bytes is not None:
        extra.append(("device memory", _fmt(measurement.total_memory_bytes)))
    if prediction is not None and prediction.source == "plan":
        extra.append(("prediction", "the plan's predicted peak"))
    if measurement.snapshot_path:
        extra.append(("snapshot", measurement.snapshot_path))
    lines += [f"{name}: {value}" for name, value in extra]
    return "\n".join(lines)
