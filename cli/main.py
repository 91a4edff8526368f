"""memplan: will this PyTorch training step fit on my GPU, and if not, what is the cheapest way to make it fit?"""

from __future__ import annotations

from typing import Annotated

import typer
from tabulate import tabulate

import memplan
from cli.common import JsonOpt, MemplanGroup, handles_errors, print_json
from cli.emit_cmd import emit_command
from cli.estimate_cmd import estimate_command
from cli.plan_cmd import max_batch_command, plan_command
from cli.verify_cmd import verify_command

EXIT_CODES = (
    "Exit codes: 0 ok, 1 bad input or unsupported model, 2 does not fit, 3 verify error above --tolerance. "
    "Errors are one line on stderr; MEMPLAN_DEBUG=1 shows the traceback. JSON output: docs/json.md."
)

app = typer.Typer(
    help="Memory planner for PyTorch training: estimate, plan checkpoints, emit code, verify.",
    cls=MemplanGroup,
    epilog=EXIT_CODES,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"memplan {memplan.__version__}")
        raise typer.Exit()


@app.callback()
def main_options(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """Memory planner for PyTorch training: estimate, plan checkpoints, emit code, verify."""


@app.command("models")
@handles_errors
def models_command(as_json: JsonOpt = False) -> None:
    """List the bundled model zoo: name, family, parameters, default batch and input shape."""
    import torch

    from models import ZOO

    rows = []
    for entry in ZOO.values():
        with torch.device("meta"):
            model, _ = entry.build(entry.default_batch_size)
        params = sum(p.numel() for p in model.parameters())
        rows.append(
            {
                "name": entry.name,
                "family": entry.family,
                "parameters": params,
                "default_batch_size": entry.default_batch_size,
                "input": entry.input_desc,
            }
        )
    if as_json:
        print_json({"command": "models", "models": rows})
    else:
        table = [[r["name"], r["family"], f"{r['parameters']:,}", r["default_batch_size"], r["input"]] for r in rows]
        typer.echo(tabulate(table, headers=["model", "family", "parameters", "default batch", "input"]))


app.command("estimate")(estimate_command)
app.command("plan")(plan_command)
app.command("max-batch")(max_batch_command)
app.command("verify")(verify_command)
app.command("emit")(emit_command)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
