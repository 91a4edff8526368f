"""`memplan emit`: turn a plan.json into a standalone Python module that applies its checkpoints."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cli.common import JsonOpt, handles_errors, print_json
from memplan.errors import BadInput


@handles_errors
def emit_command(
    plan_path: Annotated[Path, typer.Argument(metavar="PLAN", help="A plan.json written by `memplan plan`.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="The Python module to write, e.g. ckpt_plan.py.")],
    force: Annotated[bool, typer.Option("--force", help="Overwrite OUTPUT if it exists.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Write a module defining apply_checkpointing(model), which needs only PyTorch to run."""
    # Imported here: memplan.emit imports torch, which `memplan --help` should not wait for.
    from memplan.emit import emit_module
    from memplan.plan import load_plan, write_atomically

    plan = load_plan(plan_path)
    if output.resolve() == plan_path.resolve():
        raise BadInput(f"-o {output} is the plan itself: the module would replace it")
    write_atomically(output, emit_module(plan), force=force)
    if as_json:
        print_json({"command": "emit", "plan": str(plan_path), "output": str(output), "segments": len(plan.segments)})
    else:
        typer.echo(f"wrote {output}: {len(plan.segments)} checkpointed segments")
