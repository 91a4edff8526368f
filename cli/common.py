"""What every command shares: option types, the one place errors become messages, JSON output."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Annotated, Any

import typer

from memplan.errors import BadInput, MemplanError
from memplan.units import format_bytes, parse_size

if TYPE_CHECKING:
    from memplan.gpus import GpuSpec

ModelArg = Annotated[
    str,
    typer.Argument(help="A zoo name (see `memplan models`), path/to/file.py:NAME or package.module:NAME."),
]
BatchOpt = Annotated[int | None, typer.Option("--batch-size", "-b", help="Micro-batch size passed to the model factory.")]
SetOpt = Annotated[
    list[str] | None,
    typer.Option("--set", help="KEY=VALUE passed to the model factory, e.g. --set seq_len=2048 (repeatable)."),
]
GradAccumOpt = Annotated[int, typer.Option("--grad-accum", help="Micro-batches per optimizer step.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of a table (docs/json.md).")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress indicator on stderr.")]
GpuOpt = Annotated[
    str | None,
    typer.Option("--gpu", help="A GPU (rtx4090, a100-80gb, h100, ...): show whether the step fits its memory."),
]
PlotOpt = Annotated[
    str | None,
    typer.Option("--plot", help="Draw live memory over the step to FILE (.png, .svg or .html).", metavar="FILE"),
]

# Column names and their formats, shared by every command's table.
PEAK, PEAK_PHASE, BUDGET, OVERHEAD, MAX_BATCH = "peak", "peak phase", "budget", "recompute overhead", "max batch"


def fits_column(gpu: GpuSpec) -> str:
    return f"fits on {gpu.name}"


def yes_no(value: bool) -> str:
    return "yes" if value else "no"


def overhead_pct(recompute_flops: int, step_flops: int) -> float:
    return 100 * recompute_flops / step_flops if step_flops else 0.0


def format_pct(value: float) -> str:
    return f"{value:.1f}%"


def resolve_gpu(name: str | None, precisions: list[str], device: str) -> GpuSpec | None:
    """The --gpu card, after warning on stderr about precisions it has no hardware for."""
    if name is None:
        return None
    from memplan.devices import device_model
    from memplan.gpus import gpu_spec, supports_precision

    device_model(device, name)  # the library's checks: a known device, and --gpu only with CUDA
    gpu = gpu_spec(name)
    for precision in dict.fromkeys(precisions):
        warning = supports_precision(gpu, precision)
        if warning:
            note(f"warning: {warning}")
    return gpu


def gpu_line(gpu: GpuSpec) -> str:
    from memplan.report import CUDA_CONTEXT_BYTES, usable_bytes

    return (
        f"{gpu.name}: {format_bytes(gpu.capacity_bytes)}, {format_bytes(usable_bytes(gpu))} usable after an assumed "
        f"{format_bytes(CUDA_CONTEXT_BYTES)} CUDA context"
    )


def gpu_json(gpu: GpuSpec | None) -> dict[str, Any] | None:
    if gpu is None:
        return None
    from memplan.report import CUDA_CONTEXT_BYTES, usable_bytes

    return {
        "name": gpu.name,
        "capacity_bytes": gpu.capacity_bytes,
        "cuda_context_bytes": CUDA_CONTEXT_BYTES,
        "usable_bytes": usable_bytes(gpu),
        "compute_capability": list(gpu.compute_capability),
    }


def budget_or_gpu(budget: str | None, gpu: GpuSpec | None) -> int:
    """--budget, else the GPU's usable memory; one of them is needed."""
    if budget is not None:
        return parse_size(budget)
    if gpu is None:
        raise BadInput("give --budget SIZE or --gpu NAME (the budget is then its memory less the CUDA context)")
    from memplan.report import usable_bytes

    return usable_bytes(gpu)


def note(message: str) -> None:
    typer.echo(f"memplan: {message}", err=True)


@contextlib.contextmanager
def progress(message: str, quiet: bool = False) -> Iterator[None]:
    """A spinner on stderr while the library works (it never prints); none with --quiet, or when stderr
    is not a terminal (pipes, CI logs, tests)."""
    if quiet or not sys.stderr.isatty():
        yield
        return
    from rich.console import Console

    with Console(stderr=True).status(message, spinner="dots"):
        yield


def size_option(text: str | None) -> int | None:
    return None if text is None else parse_size(text)


def print_json(payload: Any) -> None:
    typer.echo(json.dumps(payload, indent=2, sort_keys=False))


def fail(message: str, code: int) -> None:
    """One line on stderr, then exit with `code`."""
    note(message)
    raise typer.Exit(code)


def handles_errors(command: Callable[..., Any]) -> Callable[..., Any]:
    """Map memplan's errors (and anything unexpected) to one line on stderr and an exit code.
    MEMPLAN_DEBUG=1 shows the traceback."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except typer.Exit:
            raise
        except MemplanError as error:
            _debug_traceback()
            fail(str(error), error.exit_code)
        except KeyboardInterrupt:
            fail("interrupted", 130)
        except Exception as error:  # noqa: BLE001 - a bug or an unsupported model: still one line, exit 1
            _debug_traceback()
            fail(f"{type(error).__name__}: {_first_line(error)} (set MEMPLAN_DEBUG=1 for the traceback)", 1)

    return wrapper


def _first_line(error: Exception) -> str:
    """Other libraries' messages can run to paragraphs (torch.utils.checkpoint's do); the line that names
    the problem comes first."""
    lines = str(error).strip().splitlines()
    return lines[0] if lines else ""


def _debug_traceback() -> None:
    if os.environ.get("MEMPLAN_DEBUG") == "1":
        traceback.print_exc(file=sys.stderr)
