"""What every command shares: option types, the one place errors become messages, JSON output."""

from __future__ import annotations

import functools
import json
import os
import sys
import traceback
from collections.abc import Callable
from typing import Annotated, Any

import typer

from memplan.errors import MemplanError
from memplan.units import parse_size

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
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of a table.")]


def size_option(text: str | None) -> int | None:
    return None if text is None else parse_size(text)


def print_json(payload: Any) -> None:
    typer.echo(json.dumps(payload, indent=2, sort_keys=False))


def fail(message: str, code: int) -> None:
    """One line on stderr, then exit with `code`."""
    typer.echo(f"memplan: {message}", err=True)
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
        except Exception as error:  # a bug or an unsupported model: still one line, exit 1
            _debug_traceback()
            fail(f"{type(error).__name__}: {error} (set MEMPLAN_DEBUG=1 for the traceback)", 1)

    return wrapper


def _debug_traceback() -> None:
    if os.environ.get("MEMPLAN_DEBUG") == "1":
        traceback.print_exc(file=sys.stderr)
