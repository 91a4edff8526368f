"""What every command shares: option types, the one place errors become messages, JSON output."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Annotated, Any

import typer
from typer.core import TyperGroup

try:  # typer vendors click from 0.2x on; older releases use click itself
    from typer._click import exceptions as _click_exceptions
except ImportError:  # pragma: no cover
    from click import exceptions as _click_exceptions

from memplan.errors import BadInput, MemplanError
from memplan.units import format_bytes, parse_size

if TYPE_CHECKING:
    from memplan.gpus import GpuSpec

ModelArg = Annotated[
    str,
    typer.Argument(metavar="MODEL", help="A zoo name (see `memplan models`), path/to/file.py:NAME or package.module:NAME."),
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


def budget_or_gpu(budget: str | None, gpu: GpuSpec | None, device: str = "cuda") -> int:
    """--budget, else the GPU's usable memory; one of them is needed. A CUDA budget more than the --gpu
    card (or any known card) can hold is allowed, with a warning: the answer would not hold on a real GPU."""
    if budget is not None:
        nbytes = parse_size(budget)
        if device == "cuda":
            from memplan.gpus import GPUS
            from memplan.report import usable_bytes

            card = gpu or max(GPUS.values(), key=lambda g: g.capacity_bytes)
            if nbytes > usable_bytes(card):
                usable = f"{format_bytes(usable_bytes(card))} usable"
                which = f"{card.name}'s {usable}" if gpu else f"any known GPU has (the largest, {card.name}: {usable})"
                note(f"warning: --budget {format_bytes(nbytes)} is more than {which}")
        return nbytes
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


# Whether the running command has printed its JSON object (an error after it adds none: one object).
_json_printed = False


def print_json(payload: Any) -> None:
    global _json_printed
    typer.echo(json.dumps(payload, indent=2, sort_keys=False))
    _json_printed = True


def fail(message: str, code: int, json_command: str | None = None) -> None:
    """One line on stderr, then exit with `code`. With --json (`json_command` names the command) stdout
    gets an error object too, unless the command already printed its own: a script always reads one object."""
    line = one_line(message)
    if json_command is not None and not _json_printed:
        print_json({"command": json_command, "error": line, "exit_code": code})
    note(line)
    raise typer.Exit(code)


def handles_errors(command: Callable[..., Any]) -> Callable[..., Any]:
    """The one place a command's errors become messages: memplan's errors (and anything unexpected,
    the user's model code included) become one line on stderr and an exit code. MEMPLAN_DEBUG=1 shows
    the traceback."""
    name = command.__name__.removesuffix("_command").replace("_", "-")

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        global _json_printed
        _json_printed = False
        json_command = name if kwargs.get("as_json") else None
        try:
            with _quiet_library_logs():
                return command(*args, **kwargs)
        except typer.Exit:
            raise
        except MemplanError as error:
            _debug_traceback()
            message, code = str(error), error.exit_code
        except KeyboardInterrupt:
            message, code = "interrupted", 130
        except SystemExit as error:  # the user's model code called sys.exit() or exit()
            _debug_traceback()
            message, code = f"the model's code called sys.exit({error.code!r})", 1
        except Exception as error:  # noqa: BLE001 - a bug or an unsupported model: still one line, exit 1
            _debug_traceback()
            message, code = f"{type(error).__name__}: {one_line(str(error))} (set MEMPLAN_DEBUG=1 for the traceback)", 1
        fail(message, code, json_command)

    return wrapper


def one_line(message: str) -> str:
    """Other libraries' messages (and the user's) can run to paragraphs (torch.utils.checkpoint's do); the
    line that names the problem comes first."""
    lines = [line.strip() for line in str(message).strip().splitlines() if line.strip()]
    return lines[0] if lines else ""


def _debug_traceback() -> None:
    if debugging():
        traceback.print_exc(file=sys.stderr)


def debugging() -> bool:
    return os.environ.get("MEMPLAN_DEBUG") == "1"


@contextlib.contextmanager
def _quiet_library_logs() -> Iterator[None]:
    """torch logs some failures with their traceback (FakeTensor's "failed while attempting to run meta")
    before raising the error we report in one line; MEMPLAN_DEBUG=1 keeps them."""
    if debugging():
        yield
        return
    import torch  # first: importing torch configures its loggers

    logger = logging.getLogger(torch.__name__)
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


class MemplanGroup(TyperGroup):
    """The app's click group: usage errors (an unknown option, a value that is not a number, a missing
    argument) are one line on stderr and exit 1 like every other bad input, not click's box and exit 2
    (2 means "does not fit")."""

    def main(self, args: Any = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        argv = list(sys.argv[1:] if args is None else args)
        try:
            result = super().main(argv or ["--help"], prog_name, complete_var, standalone_mode=False, **extra)
        except _click_exceptions.ClickException as error:
            ctx = getattr(error, "ctx", None)
            where = ctx.command_path if ctx is not None else "memplan"
            command = ctx.info_name if ctx is not None and ctx.parent is not None else None
            message = f"{one_line(error.format_message()).rstrip('.')} (see `{where} --help`)"
            if "--json" in argv:
                print_json({"command": command, "error": message, "exit_code": 1})
            note(message)
            result = 1
        except typer.Abort:
            note("aborted")
            result = 1
        code = result if isinstance(result, int) and not isinstance(result, bool) else 0
        if standalone_mode:
            sys.exit(code)
        return result
