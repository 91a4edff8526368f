#!/usr/bin/env python
"""Check memplan's predictions against real GPU memory: verify-with-prediction over the zoo at realistic
sizes x precisions x optimizers, with and without a checkpoint plan, in one table.

    python scripts/gpu_check.py                      # one NVIDIA GPU, about 8 minutes at most
    python scripts/gpu_check.py --device cpu --quick # smoke test: tiny models on the CPU

Writes the table to benchmarks/results/gpu_check_<gpu name>.md (or --out). Each row runs in its own
try/except: a failure (or an out-of-memory, which is a result) is a row, not the end of the table.
Rows run in priority order and stop when the time budget (--budget-s, 420 s) is spent; the rest are
listed as skipped. Sizes are for a GPU with 40 GiB or more; smaller GPUs get half the batch.
"""

from __future__ import annotations

import argparse
import gc
import re
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch
from tabulate import tabulate

from memplan.errors import MemplanError
from memplan.plan import Plan
from memplan.step import StepConfig
from memplan.units import format_bytes
from memplan.verify import Prediction, PredictionUnavailable, error_pct, measure, predict, resolve_device
from memplan.workload import Workload, resolve_workload

PRECISIONS = ("fp32", "amp-fp16", "amp-bf16", "bf16", "fp16-master")
OPTIMIZERS = ("sgd-momentum", "adamw", "adafactor", "adamw-8bit")
STEPS = 2  # the first step (creates optimizer state) and one later step
PLAN_BUDGET_FRACTION = 0.6  # a checkpoint plan aims at this fraction of the unplanned predicted peak
ROW_SECONDS, PLAN_ROW_SECONDS = 10, 60  # rough upper bounds per row on a GPU host, for the time budget
HEADERS = ["model", "precision", "optimizer", "plan", "predicted", "measured allocated", "measured reserved", "error %"]


@dataclass(frozen=True)
class Case:
    model: str
    batch_size: int
    precision: str
    optimizer: str
    plan: bool = False
    selective: bool = False  # the plan from memplan.selective (op-level) rather than memplan.planner
    options: dict[str, Any] = field(default_factory=dict)
    tag: str | None = None  # how the label shows the options (default: all of them)

    @property
    def label(self) -> str:
        extra = self.tag or ",".join(f"{k}={v}" for k, v in self.options.items())
        return f"{self.model} b{self.batch_size}{f' ({extra})' if extra else ''}"


def gpu_cases(small_gpu: bool) -> list[Case]:
    """Realistic sizes, in priority order: the full precision x optimizer cross product on GPT-2, then
    each family's main settings, then plans, then the rest (what the time budget leaves)."""
    half = 2 if small_gpu else 1
    gpt2 = {"model": "gpt2", "batch_size": 8 // half}
    # a Llama-2-7B-wide model cut to 4 layers: real block sizes, fits with fp32 AdamW state
    llama = {"model": "llama2-7b", "batch_size": 1, "options": {"n_layer": 4, "seq_len": 2048 // half}}
    others = [
        llama,
        {"model": "bert-base", "batch_size": 16 // half},
        {"model": "resnet50", "batch_size": 64 // half},
        {"model": "vit-b16", "batch_size": 32 // half},
        {"model": "gpt2-medium", "batch_size": 4 // half},
        {"model": "unet", "batch_size": 8 // half},
        {"model": "lstm", "batch_size": 32 // half},
    ]
    planned = [
        gpt2,
        llama,
        {"model": "bert-base", "batch_size": 16 // half},
        {"model": "vit-b16", "batch_size": 32 // half},
    ]
    # grouped-query attention (8 key/value heads for 32): flash takes them grouped, nothing repeated
    gqa = {"model": "llama3-8b", "batch_size": 1, "options": {"n_layer": 2, "seq_len": 2048 // half}}
    cases = [Case(**gpt2, precision=p, optimizer=o) for p in PRECISIONS for o in OPTIMIZERS]
    cases += [Case(**gqa, precision=p, optimizer="sgd") for p in ("amp-bf16", "bf16")]
    cases += [Case(**gpt2, precision=p, optimizer="adamw", plan=True) for p in ("fp32", "amp-bf16")]
    cases += [Case(**m, precision="amp-bf16", optimizer="adamw", plan=True, selective=True) for m in (gpt2, llama)]
    cases += [Case(**m, precision=p, optimizer="adamw") for m in others for p in ("fp32", "amp-bf16")]
    cases += [Case(**m, precision="fp32", optimizer="adamw", plan=True) for m in planned[1:]]
    cases += [
        Case(**m, precision=p, optimizer=o)
        for m in others
        for p, o in (("amp-fp16", "sgd-momentum"), ("bf16", "adafactor"), ("fp16-master", "adamw-8bit"))
    ]
    cases += [Case(**gpt2, precision=p, optimizer="adamw", plan=True) for p in ("amp-fp16", "bf16", "fp16-master")]
    cases += [Case(**m, precision="amp-bf16", optimizer="adamw", plan=True) for m in planned[1:]]
    cases += [Case(**gpt2, precision=p, optimizer=o, plan=True) for p in PRECISIONS for o in OPTIMIZERS if o != "adamw"]
    return cases


def quick_cases() -> list[Case]:
    """Tiny models: a smoke test of the script itself (the CPU runs amp and bf16 too)."""
    from models import TINY_OVERRIDES

    def tiny(model: str, batch_size: int = 2) -> dict[str, Any]:
        return {"model": model, "batch_size": batch_size, "options": dict(TINY_OVERRIDES[model]), "tag": "tiny"}

    return [
        Case(**tiny("gpt2"), precision="fp32", optimizer="adamw"),
        Case(**tiny("gpt2"), precision="amp-bf16", optimizer="sgd-momentum"),
        Case(**tiny("gpt2"), precision="fp32", optimizer="adamw", plan=True),
        Case(**tiny("gpt2"), precision="fp32", optimizer="adamw", plan=True, selective=True),
        Case(**tiny("llama3-8b"), precision="bf16", optimizer="adafactor"),
        Case(**tiny("resnet18"), precision="fp32", optimizer="sgd-momentum"),
        Case(**tiny("mlp"), precision="fp16-master", optimizer="adamw"),
        Case(**tiny("mlp"), precision="fp32", optimizer="adamw-8bit"),
    ]


# --------------------------------------------------------------------------------------------------


def make_plan(
    workload: Workload, config: StepConfig, device: str, unplanned: Prediction | None, selective: bool = False
) -> tuple[Plan, Prediction | None]:
    """A checkpoint plan from memplan's planner (`selective`: the op-level one) at PLAN_BUDGET_FRACTION
    of the unplanned prediction, with the planner's own estimate of the checkpointed step; without a
    planner (or a prediction), checkpoint every block of the model's largest block list (and predict
    that separately)."""
    kind = torch.device(device).type
    if unplanned is not None:
        try:
            from memplan.planner import plan_checkpoints
            from memplan.selective import plan_selective
        except ImportError:
            plan_checkpoints = plan_selective = None
        planner = plan_selective if selective else plan_checkpoints
        if planner is not None:
            result = planner(workload, config, int(unplanned.peak_bytes * PLAN_BUDGET_FRACTION), device=kind)
            planned = result.planned
            return result.plan, Prediction(int(planned.peak_bytes), dict(planned.phase_peaks))
    plan = every_block_plan(workload, config, kind)
    return plan, _prediction(workload, config, device, plan)


def every_block_plan(workload: Workload, config: StepConfig, device: str) -> Plan:
    """Every candidate block checkpointed: the planner's own baseline, re-estimated."""
    from memplan.planner import plan_checkpoints

    plan = plan_checkpoints(workload, config, budget_bytes=1 << 62, device=device, method="every-block").plan
    if not plan.segments:
        raise MemplanError(f"{workload.spec} has no block to checkpoint")
    return plan


def _prediction(workload: Workload, config: StepConfig, device: str, plan: Plan | None) -> Prediction | None:
    try:
        return predict(workload, config, device, plan)
    except PredictionUnavailable:
        return None


_UNPLANNED: dict[tuple, Prediction | None] = {}  # predictions of earlier rows, for the plan rows' budgets


def run_case(case: Case, device: str) -> list[str]:
    workload = resolve_workload(case.model, case.batch_size, case.options)
    config = StepConfig(precision=case.precision, optimizer=case.optimizer, steps=STEPS)
    key = (case.model, case.batch_size, tuple(sorted(case.options.items())), case.precision, case.optimizer)
    plan = None
    plan_label = "-"
    if case.plan:
        if key not in _UNPLANNED:
            _UNPLANNED[key] = _prediction(workload, config, device, None)
        plan, prediction = make_plan(workload, config, device, _UNPLANNED[key], case.selective)
        plan_label = f"{plan.method} ({len(plan.segments)} seg)"
    measurement = measure(workload, config, device, plan)
    if not case.plan:
        prediction = _UNPLANNED[key] = _prediction(workload, config, device, None)
    predicted = prediction.peak_bytes if prediction is not None else None
    if measurement.oom:
        measured = f"OOM in {measurement.oom_phase} of step {measurement.oom_step}"
        error = "-"
    else:
        measured = format_bytes(measurement.measured_peak_bytes)
        pct = error_pct(predicted, measurement.measured_peak_bytes)
        error = "-" if pct is None else f"{pct:+.1f}%"
    reserved = measurement.measured_reserved_bytes
    return [
        case.label,
        case.precision,
        case.optimizer,
        plan_label,
        "-" if predicted is None else format_bytes(predicted),
        measured,
        "-" if reserved is None else format_bytes(reserved),
        error,
    ]


def _cleanup() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_").lower() or "device"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=None, help="cuda (default when available), cuda:N or cpu")
    parser.add_argument("--quick", action="store_true", help="tiny models only (a smoke test)")
    parser.add_argument(
        "--budget-s", type=float, default=420.0, help="start no row that may end after this many seconds"
    )
    parser.add_argument("--out", type=Path, default=None, help="markdown file (default benchmarks/results/...)")
    parser.add_argument("--verbose", action="store_true", help="print each row's traceback on failure")
    args = parser.parse_args(argv)

    try:
        device = resolve_device(args.device)
    except MemplanError as error:
        print(f"gpu_check: {error}", file=sys.stderr)
        return 1
    cuda = torch.device(device).type == "cuda"
    name = torch.cuda.get_device_name(torch.device(device)) if cuda else "cpu"
    total = torch.cuda.get_device_properties(torch.device(device)).total_memory if cuda else None
    cases = quick_cases() if args.quick or not cuda else gpu_cases(small_gpu=total is not None and total < 40 * 2**30)
    out = args.out or ROOT / "benchmarks" / "results" / f"gpu_check_{_slug(name)}{'_quick' if args.quick else ''}.md"

    start = time.monotonic()
    rows: list[list[str]] = []
    for case in cases:
        # a plan row re-estimates the model several times (the planner's closed loop): start one only
        # when it can finish within the budget
        reserve = PLAN_ROW_SECONDS if case.plan else ROW_SECONDS
        if time.monotonic() - start + reserve > args.budget_s:
            rows.append(
                [
                    case.label,
                    case.precision,
                    case.optimizer,
                    "plan" if case.plan else "-",
                    "-",
                    "skipped (time budget)",
                    "-",
                    "-",
                ]
            )
            continue
        began = time.monotonic()
        try:
            row = run_case(case, device)
        except Exception as error:  # noqa: BLE001 - one failure is one row
            if args.verbose:
                traceback.print_exc()
            message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            row = [
                case.label,
                case.precision,
                case.optimizer,
                "plan" if case.plan else "-",
                "-",
                f"error: {message[:90]}",
                "-",
                "-",
            ]
        finally:
            _cleanup()
        rows.append(row)
        print(
            f"[{time.monotonic() - start:6.1f}s] {' | '.join(row)}  ({time.monotonic() - began:.1f}s)",
            file=sys.stderr,
            flush=True,
        )

    table = tabulate(rows, headers=HEADERS, tablefmt="github")
    header = (
        f"# memplan gpu_check: {name}\n\n"
        f"torch {torch.__version__}, CUDA {torch.version.cuda}, device {device}"
        f"{f' ({format_bytes(total)})' if total else ''}, {STEPS} steps per row, "
        f"{time.monotonic() - start:.0f} s in all.\n"
        "error % = (predicted - measured allocated) / measured allocated. "
        f"Plans aim at {PLAN_BUDGET_FRACTION:.0%} of the unplanned prediction.\n\n"
    )
    print(table)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(header + table + "\n")
        print(f"\nwritten to {out}", file=sys.stderr)
    except OSError as error:
        print(f"gpu_check: could not write {out}: {error}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
