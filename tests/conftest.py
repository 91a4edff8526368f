"""What this CPU's oneDNN can run: some tests need kernels that only some CPUs have."""

from __future__ import annotations

import functools

import pytest
import torch


@functools.cache
def cpu_runs_bf16_lstm() -> bool:
    """Whether oneDNN has a bf16 LSTM primitive on this CPU. torch routes a bf16 LSTM to oneDNN, which
    fails on CPUs without native bf16 instructions; the estimator probes the same kernel."""
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            torch.nn.LSTM(4, 4)(torch.randn(2, 1, 4))
    except RuntimeError as error:
        if "could not create a primitive descriptor" in str(error):
            return False
        raise
    return True


def skip_unless_cpu_runs_bf16_lstm() -> None:
    if not cpu_runs_bf16_lstm():
        pytest.skip("this CPU's oneDNN has no bf16 LSTM primitive")
