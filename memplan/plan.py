"""A checkpoint plan: which segments of the model recompute their activations in backward.

This is the one type that solvers return, `plan.json` holds, the emitter turns into code and the
verifier applies. A segment is one module, or a run of sibling modules that their parent calls one
after the other, each on the previous one's output (children of an nn.Sequential, blocks an
nn.ModuleList calls in a loop), listed in call order and checkpointed as one unit: only the segment's
input is kept, everything inside is recomputed during backward.
"""

from __future__ import annotations

import dataclasses
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
    # module paths as in model.named_modules(); several paths = a run of siblings, in call order
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
    def from_json(data: Any) -> Plan:
        """A Plan from plan.json's object, every key and type checked: a wrong file is one clear error,
        never a plan that fails later (or, worse, emits code for the wrong modules)."""
        if not isinstance(data, dict) or "format" not in data:
            raise BadInput("not a memplan plan (no \"format\" key): write one with `memplan plan --out`")
        found = data["format"]
        if found != PLAN_FORMAT:
            if isinstance(found, int) and not isinstance(found, bool) and found > PLAN_FORMAT:
                raise BadInput(f"not a memplan plan this version reads: format {found} is newer than "
                               f"{PLAN_FORMAT}; upgrade memplan")
            raise BadInput(f"not a memplan plan this version reads: format {found!r}, expected {PLAN_FORMAT}; "
                           "run `memplan plan --out` again")
        fields = {k: v for k, v in data.items() if k != "format"}
        _check_keys("plan", fields, Plan)
        for name, value in fields.items():
            if name in _PLAN_TYPES:
                _check_type(f"plan's {name!r}", value, _PLAN_TYPES[name])
        if not isinstance(fields["segments"], list):
            raise BadInput(f"malformed plan: 'segments' must be a list, got {_json_type(fields['segments'])}")
        segments = []
        for index, raw in enumerate(fields["segments"]):
            where = f"segment {index}"
            if not isinstance(raw, dict):
                raise BadInput(f"malformed plan: {where} must be an object, got {_json_type(raw)}")
            _check_keys(where, raw, Segment)
            for name, value in raw.items():
                if name in _SEGMENT_TYPES:
                    _check_type(f"{where}'s {name!r}", value, _SEGMENT_TYPES[name])
            if not raw["modules"]:
                raise BadInput(f"malformed plan: {where} names no module")
            segments.append(Segment(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()}))
        fields["segments"] = tuple(segments)
        return Plan(**fields)


# The JSON type of each field's annotation: plan.json's keys are the dataclasses' fields, each checked
# against its annotation's JSON type (a field of a type not listed here fails at import, in the tests).
_JSON_TYPES = {
    "str": "str", "int": "int", "int | None": "int|null", "bool": "bool", "float | None": "number|null",
    "dict[str, Any]": "object", "tuple[str, ...]": "list of str",
}
_PLAN_TYPES = {f.name: _JSON_TYPES[f.type] for f in dataclasses.fields(Plan) if f.name != "segments"}
_SEGMENT_TYPES = {f.name: _JSON_TYPES[f.type] for f in dataclasses.fields(Segment)}


def _check_keys(where: str, data: dict, kind: type) -> None:
    """`data` has exactly the keys of dataclass `kind`: none unknown, every one without a default."""
    known = {f.name: f for f in dataclasses.fields(kind)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise BadInput(f"malformed plan: {where} has unknown key {unknown[0]!r}")
    missing = [name for name, f in known.items() if name not in data
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise BadInput(f"malformed plan: {where} lacks the key {missing[0]!r}")


def _check_type(where: str, value: Any, kind: str) -> None:
    is_int = isinstance(value, int) and not isinstance(value, bool)
    ok = {
        "str": isinstance(value, str),
        "int": is_int,
        "int|null": value is None or is_int,
        "number|null": value is None or is_int or isinstance(value, float),
        "bool": isinstance(value, bool),
        "object": isinstance(value, dict),
        "list of str": isinstance(value, list) and all(isinstance(v, str) for v in value),
    }[kind]
    if not ok:
        raise BadInput(f"malformed plan: {where} must be {kind.replace('|', ' or ')}, got {_json_type(value)}")


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    return {int: "int", float: "number", str: "str", list: "list", dict: "object"}.get(type(value), type(value).__name__)


def load_plan(path: str | Path) -> Plan:
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise BadInput(f"plan file not found: {path}") from None
    except UnicodeDecodeError:
        raise BadInput(f"cannot read plan {path}: not JSON (not even text)") from None
    except ValueError as error:
        raise BadInput(f"cannot read plan {path}: not JSON ({error})") from None
    except OSError as error:
        raise BadInput(f"cannot read plan {path}: {error.strerror or error}") from None
    return Plan.from_json(data)


def check_output_path(path: str | Path, force: bool = True) -> Path:
    """Fail before any work on a file we could not write: a missing directory, a directory in its place,
    an existing file without `force`."""
    path = Path(path)
    if not path.name or path.is_dir():
        raise BadInput(f"{path} is a directory; give a file name")
    if path.exists() and not force:
        raise BadInput(f"{path} exists; pass --force to overwrite it")
    directory = path.parent if str(path.parent) else Path(".")
    if not directory.is_dir():
        raise BadInput(f"directory not found: {directory}")
    return path


def write_atomically(path: str | Path, text: str | bytes, force: bool = True) -> None:
    """Write to a temporary file beside `path`, then rename: never a half-written file."""
    path = check_output_path(path, force)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "wb" if isinstance(text, bytes) else "w") as handle:
            handle.write(text)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes the file private; give it the usual mode
        os.replace(tmp, path)
    except BaseException as error:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        if isinstance(error, OSError):  # permissions, a full disk: the user's to fix, one line
            raise BadInput(f"cannot write {path}: {error.strerror or error}") from error
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def save_plan(plan: Plan, path: str | Path) -> None:
    write_atomically(path, json.dumps(plan.to_json(), indent=2) + "\n")
