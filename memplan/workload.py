"""The workload: what a user points memplan at, resolved by one function.

MODEL is a zoo name (`gpt2`), `path/to/file.py:NAME` or `package.module:NAME`, where
`NAME(batch_size: int, **options)` returns `(model, inputs)`: an nn.Module in fp32 on the current
default device and its example inputs (a tuple of positional arguments or a dict of keyword arguments).
Resolving only finds the factory; `Workload.build()` calls it, so that the tracer can call it under
fake tensors and the verifier for real.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memplan.errors import BadInput


@dataclass(frozen=True)
class Workload:
    spec: str  # what the user typed
    factory: Callable[..., Any] = field(repr=False)
    batch_size: int | None  # None: the factory's own default
    options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def effective_batch_size(self) -> int | None:
        if self.batch_size is not None:
            return self.batch_size
        default = inspect.signature(self.factory).parameters.get("batch_size")
        return default.default if default is not None and default.default is not inspect.Parameter.empty else None

    def build(self) -> tuple[nn.Module, tuple | dict]:
        """Call the factory (on the current default device / fake mode) and check what it returned."""
        kwargs = dict(self.options)
        if self.batch_size is not None:
            kwargs["batch_size"] = self.batch_size
        try:
            result = self.factory(**kwargs)
        except BadInput:
            raise
        except Exception as error:  # the user's code: report its message, not a traceback
            raise BadInput(f"{self.spec} raised {type(error).__name__}: {error}") from error
        if not (isinstance(result, tuple) and len(result) == 2):
            raise BadInput(f"{self.spec} must return (model, inputs), got {_describe(result)}")
        model, inputs = result
        if not isinstance(model, nn.Module):
            raise BadInput(f"{self.spec} must return an nn.Module first, got {_describe(model)}")
        if not isinstance(inputs, (tuple, dict)):
            raise BadInput(f"{self.spec} must return inputs as a tuple or a dict, got {_describe(inputs)}")
        if not any(p.requires_grad for p in model.parameters()):
            raise BadInput(f"{self.spec} returned a model with no trainable parameters (none requires grad): "
                           "a training step has nothing to update")
        return model, inputs


def resolve_workload(spec: str, batch_size: int | None = None, options: Mapping[str, Any] | None = None) -> Workload:
    """Find the factory behind MODEL: a zoo name, `file.py:NAME` or `package.module:NAME`."""
    if batch_size is not None and batch_size < 1:
        raise BadInput(f"batch size must be at least 1, got {batch_size}")
    options = dict(options or {})
    if ":" in spec:
        return Workload(spec, _load_factory(spec), batch_size, options)
    from models import ZOO

    if spec not in ZOO:
        close = difflib.get_close_matches(spec, ZOO, n=3, cutoff=0.5)
        hint = f"; did you mean {', '.join(close)}?" if close else f"; the zoo has: {', '.join(ZOO)}"
        raise BadInput(f"unknown model {spec!r}{hint} (or give path/to/file.py:NAME)")
    entry = ZOO[spec]
    return Workload(spec, entry.build, batch_size or entry.default_batch_size, options)


def _load_factory(spec: str) -> Callable[..., Any]:
    location, _, name = spec.rpartition(":")
    if not location or not name:
        raise BadInput(f"cannot read model {spec!r}: expected path/to/file.py:NAME or package.module:NAME")
    if location.endswith(".py") or "/" in location:
        path = Path(location)
        if not path.is_file():
            raise BadInput(f"model file not found: {location}")
        module_name = f"memplan_user_{abs(hash(str(path.resolve())))}"
        module_spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_name] = module
        try:
            module_spec.loader.exec_module(module)
        except Exception as error:
            del sys.modules[module_name]
            raise BadInput(f"{location} failed to import: {type(error).__name__}: {error}") from error
    else:
        if os.getcwd() not in sys.path:  # as `python -m` would; after the installed packages
            sys.path.append(os.getcwd())
        try:
            module = importlib.import_module(location)
        except ModuleNotFoundError as error:
            raise BadInput(f"module not found: {location} ({error})") from error
        except Exception as error:
            raise BadInput(f"{location} failed to import: {type(error).__name__}: {error}") from error
    factory = getattr(module, name, None)
    if factory is None:
        raise BadInput(f"{location} has no {name!r}")
    if not callable(factory):
        raise BadInput(f"{location}:{name} is not callable")
    return factory


def same_model(spec: str, other: str) -> bool:
    """Whether two MODEL specs name the same factory: the same text, or the same file and NAME however
    the path is spelled (`./m.py:f`, `m.py:f`, an absolute path)."""
    if spec == other:
        return True
    (location, _, name), (other_location, _, other_name) = spec.rpartition(":"), other.rpartition(":")
    files = all(loc.endswith(".py") or "/" in loc for loc in (location, other_location))
    return files and name == other_name and Path(location).resolve() == Path(other_location).resolve()


def parse_options(pairs: Iterable[str]) -> dict[str, Any]:
    """`--set KEY=VALUE` pairs, as int, float or bool where they parse so."""
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip().isidentifier():
            raise BadInput(f"--set expects KEY=VALUE, got {pair!r}")
        options[key.strip()] = _parse_value(value.strip())
    return options


def _parse_value(text: str) -> Any:
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _describe(value: Any) -> str:
    if isinstance(value, tuple):
        return f"a tuple of {len(value)}"
    if isinstance(value, torch.Tensor):
        return "Tensor"  # not FakeTensor: the user wrote a tensor
    return type(value).__name__
