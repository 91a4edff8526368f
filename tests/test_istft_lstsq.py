"""Two ops whose estimate failed where eager runs: torch.istft (its window check, a flag C++ reads
with `at::is_scalar_tensor_true`, read true under tracing, and the check's message printed the fake
flag's data) and torch.linalg.lstsq (outputs of data-dependent shapes, which the fake kernel
refuses). The ground truth is `memplan.verify.measure`, and eager's own outputs."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from memplan.estimate import estimate
from memplan.step import StepConfig
from memplan.trace import _lstsq_outputs
from memplan.verify import measure
from memplan.workload import Workload


def _compare(build, batch_size: int, **kwargs):
    workload = Workload(build.__name__, build, batch_size, kwargs)
    config = StepConfig(steps=2, optimizer="sgd")
    return estimate(workload, config, device="cpu"), measure(workload, config, device="cpu")


def spectral_round_trip(batch_size: int = 4, length: bool = True):
    """stft then istft of a layer's output, with the window a buffer (periodic=False: a periodic window
    is a narrowed view of one sample more)."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(256, 256)
            self.register_buffer("window", torch.hann_window(64, periodic=False))

        def forward(self, x):
            h = self.fc(x)
            spec = torch.stft(h.flatten(), 64, hop_length=16, window=self.window, return_complex=True)
            signal = torch.istft(spec, 64, hop_length=16, window=self.window, length=h.numel() if length else None)
            return signal.square().mean()

    return Net(), (torch.randn(batch_size, 256),)


@pytest.mark.parametrize("length", [True, False])
def test_istft_window_check_passes_and_matches(length):
    predicted, measured = _compare(spectral_round_trip, 4, length=length)
    assert not predicted.approximate
    assert predicted.peak_bytes == measured.measured_peak_bytes
    assert predicted.phase_peaks == measured.phase_peaks  # the forward's overlap-add: unfold_backward's index


def least_squares(batch_size: int = 64, rows: int = 12, cols: int = 8, grad: bool = True, driver: str | None = None):
    """A layer's output as a batch of systems A X = B (A rows x cols, B rows x 3), solved by lstsq."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, rows * cols + rows * 3)

        def forward(self, x):
            h = self.fc(x)
            a = h[:, : rows * cols].reshape(-1, rows, cols)
            b = h[:, rows * cols :].reshape(-1, rows, 3)
            if not grad:
                a, b = a.detach(), b.detach()
            solved = torch.linalg.lstsq(a, b, driver=driver)
            loss = solved.solution.sum() + solved.residuals.sum()
            return loss if grad else loss + h.square().mean()

    return Net(), (torch.randn(batch_size, 16),)


@pytest.mark.parametrize("rows,grad", [(8, True), (12, True), (8, False), (12, False)])
def test_lstsq_square_and_tall_match(rows, grad):
    predicted, measured = _compare(least_squares, 64, rows=rows, grad=grad)
    assert not predicted.approximate  # gelsy, the CPU default: no residuals, whatever the rank
    # with gradients, lstsq's column-major copy of A and LAPACK's workspace set the forward's peak (17,820 B
    # short of it for 8 rows before the scratch rule measured them)
    assert predicted.phase_peaks == measured.phase_peaks
    assert predicted.peak_bytes == measured.measured_peak_bytes


def test_lstsq_residuals_of_full_rank_assumed():
    """gelsd computes residuals of a tall A only when every matrix has full rank: assumed, approximate."""
    predicted, measured = _compare(least_squares, 64, rows=12, grad=False, driver="gelsd")
    assert predicted.approximate_ops == ("aten.linalg_lstsq.default",)
    assert predicted.peak_bytes == measured.measured_peak_bytes


@pytest.mark.parametrize("driver", ["gelsy", "gelsd", "gelss", "gels"])
@pytest.mark.parametrize("a_shape,b_shape", [((5, 5), (5, 2)), ((3, 7, 4), (3, 7, 2)), ((3, 4, 7), (3, 4, 2)),
                                             ((3, 7, 4), (3, 7)), ((1, 7, 4), (3, 7, 2))])
def test_lstsq_outputs_as_eager_allocates_them(driver, a_shape, b_shape):
    a, b = torch.randn(a_shape, dtype=torch.float64), torch.randn(b_shape, dtype=torch.float64)
    eager = torch.linalg.lstsq(a, b, driver=driver)
    with FakeTensorMode() as mode:
        traced, _ = _lstsq_outputs(mode.from_tensor(a), mode.from_tensor(b), driver=driver, known=lambda _: None)
    for real, fake in zip(eager, traced):
        assert (fake.shape, fake.stride(), fake.dtype) == (real.shape, real.stride(), real.dtype)
        assert fake.untyped_storage().nbytes() == real.untyped_storage().nbytes()
