"""Steps that read values back and let them steer Python (neural ODE solvers: torchdiffeq's fixed grid
sized by `.item()` of its time points). The ground truth is always
`memplan.verify.measure`.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memplan.estimate import estimate
from memplan.step import StepConfig
from memplan.verify import measure
from memplan.workload import Workload

PHASES = ("forward", "backward", "optimizer")


def _compare(build, precision="fp32", optimizer="adamw"):
    workload = Workload(build.__name__, build, None, {})
    config = StepConfig(precision=precision, optimizer=optimizer, steps=2)
    return estimate(workload, config, device="cpu"), measure(workload, config, device="cpu")


class _FixedGrid(nn.Module):
    """torchdiffeq's fixed-step solvers: the grid's length is `ceil((t1 - t0) / step_size + 1).item()` over
    the time points, a float buffer made from constants (`torch.linspace`). Its value was not passed to
    the traced step (integer buffers only), so it read 1.0: one grid point, no step (de_rk4: 16,588 B
    predicted, 108,924 B measured); in bf16 the precision's cast dropped it too."""

    def __init__(self):
        super().__init__()
        self.f = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 16))
        self.register_buffer("t", torch.linspace(0, 1, 3))

    def forward(self, x):
        t = self.t.to(x.dtype)
        steps = int(torch.ceil((t[-1] - t[0]) / 0.125).item())
        for _ in range(steps):
            x = x + 0.125 * self.f(x)
        return x.float().square().mean()


def fixed_grid(batch_size: int = 8):
    return _FixedGrid(), (torch.randn(batch_size, 16),)


@pytest.mark.parametrize("precision,optimizer", [("fp32", "adamw"), ("bf16", "sgd"), ("amp-bf16", "adamw")])
def test_a_float_buffers_known_value_sizes_the_loop_as_in_eager(precision, optimizer):
    predicted, measured = _compare(fixed_grid, precision, optimizer)
    for phase in PHASES:
        assert predicted.phase_peaks[phase] == measured.phase_peaks[phase], (phase, predicted.phase_peaks,
                                                                           measured.phase_peaks)
    assert not predicted.approximate
