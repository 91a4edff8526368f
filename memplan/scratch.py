"""Kernel scratch: bytes a kernel allocates and frees inside itself, invisible to a dispatch-level
trace. A registry (device, aten op packet) -> formula(args, kwargs, out) -> bytes, calibrated on the
allocator's own events (see benchmarks/scratch_calibration.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

aten = torch.ops.aten

ScratchFormula = Callable[[tuple, dict, Any], int]
SCRATCH_RULES: dict[tuple[str, Any], ScratchFormula] = {}


def scratch_rule(device: str, *ops: Any) -> Callable[[ScratchFormula], ScratchFormula]:
    def register(formula: ScratchFormula) -> ScratchFormula:
        for op in ops:
            SCRATCH_RULES[(device, op)] = formula
        return formula

    return register


def scratch_of(device: str) -> Callable[[Any, tuple, dict, Any], int]:
    """The scratch formula lookup for one device, as the tracer calls it for each op."""

    def scratch(func: Any, args: tuple, kwargs: dict, out: Any) -> int:
        formula = SCRATCH_RULES.get((device, func._overloadpacket))
        return formula(args, kwargs, out) if formula else 0

    return scratch
