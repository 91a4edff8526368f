"""A checkpoint plan: which segments of the model recompute their activations in backward.

This is the one type that solvers return, `plan.json` holds, the emitter turns into code and the
verifier applies. A segment is one module, or a run of consecutive sibling modules (children of an
nn.Sequential, or blocks an nn.ModuleList calls in a loop) checkpointed as one unit: only the
segment's input is kept, everything inside is recomputed during backward.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from memplan.errors import BadInput

PLAN_FORMAT = 1


@dataclass(frozen=True)
class Segment:
    # module paths as in model.named_modules(); several paths = a run of consecutive siblings
    modules: tuple[str, ...]
    # "full": recompute everything inside; "selective": keep the outputs of `saved_ops`, each an aten op
    # ("aten.mm.default": all its calls) or one call of it ("aten.mm.default#2": its third in one forward)
    policy: str = "full"
    saved_ops: tuple[str, ...] = ()
    # cost-model figures for this segment (informative; the plan's peak comes from re-estimating)
    activation_bytes: int = 0
    recompute_flops: int = 0


@dataclass(frozen=True)
class Plan:
    model: str
    batch_size: int | None
    precision: str
    optimizer: str
    grad_accum: int
    device: str
    method: str  # the solver that chose it: "optimal-dp", "milp", "none", "every-block", "sqrt-n", ...
    segments: tuple[Segment, ...]
    feasible: bool
    budget_bytes: int | None
    predicted_peak_bytes: int  # the estimator run on the checkpointed model
    unplanned_peak_bytes: int
    recompute_flops: int
    step_flops: int
    recompute_seconds: float | None = None
    options: dict[str, Any] = field(default_factory=dict)  # the workload's --set options

    @property
    def module_paths(self) -> tuple[str, ...]:
        return tuple(path for segment in self.segments for path in segment.modules)

    def to_json(self) -> dict[str, Any]:
        return {"format": PLAN_FORMAT, **asdict(self)}

    @staticmethod
    def from_json(data: dict[str, Any]) -> Plan:
        if data.get("format") != PLAN_FORMAT:
            raise BadInput(f"not a memplan plan (format {data.get('format')!r}, expected {PLAN_FORMAT})")
        fields = {k: v for k, v in data.items() if k != "format"}
        try:
            fields["segments"] = tuple(
                Segment(
                    modules=tuple(s["modules"]),
                    policy=s.get("policy", "full"),
                    saved_ops=tuple(s.get("saved_ops", ())),
                    activation_bytes=int(s.get("activation_bytes", 0)),
                    recompute_flops=int(s.get("recompute_flops", 0)),
                )
                for s in fields["segments"]
            )
            return Plan(**fields)
        except (KeyError, TypeError) as error:
            raise BadInput(f"malformed plan: {error}") from error


def load_plan(path: str | Path) -> Plan:
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise BadInput(f"plan file not found: {path}") from None
    except (OSError, ValueError) as error:
        raise BadInput(f"cannot read plan {path}: {error}") from error
    return Plan.from_json(data)


def write_atomically(path: str | Path, text: str | bytes, force: bool = True) -> None:
    """Write to a temporary file beside `path`, then rename: never a half-written file."""
    path = Path(path)
    if path.exists() and not force:
        raise BadInput(f"{path} exists; pass --force to overwrite it")
    directory = path.parent if str(path.parent) else Path(".")
    if not directory.is_dir():
        raise BadInput(f"directory not found: {directory}")
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb" if isinstance(text, bytes) else "w") as handle:
            handle.write(text)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes the file private; give it the usual mode
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def save_plan(plan: Plan, path: str | Path) -> None:
    write_atomically(path, json.dumps(plan.to_json(), indent=2) + "\n")
