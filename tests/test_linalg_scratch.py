"""Linear-algebra scratch rules (memplan/scratch.py, "Linear algebra") against the CPU allocator.

Per op: the allocator's scratch for the real op (`memplan.scratch.measure`) equals the rule's figure on
fake operands, over batches, sizes, rectangular matrices, float64 and 2-D inputs. Per model: the
estimate's peak and phase peaks equal `memplan.verify.measure`'s. Every expected value is measured.
"""

import pytest
import torch
from test_scratch import check, rule_on_fakes
from torch import nn

from memplan.estimate import estimate
from memplan.scratch import measure as measure_scratch
from memplan.step import StepConfig
from memplan.verify import measure
from memplan.workload import Workload

aten = torch.ops.aten
F64 = torch.float64


def _general(*shape, dtype=torch.float32):
    torch.manual_seed(0)
    return torch.randn(*shape, dtype=dtype)


def _spd(*shape, dtype=torch.float32):
    a = _general(*shape, dtype=dtype)
    return a @ a.mT / shape[-1] + torch.eye(shape[-1], dtype=dtype)


def _scaled(*shape, norm, dtype=torch.float32):
    """A matrix (batch) whose largest 1-norm is `norm` (matrix_exp picks its degree by it)."""
    a = _general(*shape, dtype=dtype)
    return a / a.abs().sum(-2).amax() * norm


SHAPES = [((3, 12, 12), torch.float32), ((2, 3, 9, 9), F64), ((10, 10), torch.float32), ((1, 16, 16), F64)]
IDS = ["batch-fp32", "2-batch-dims-fp64", "2d-fp32", "batch1-fp64"]


@pytest.mark.parametrize("shape, dtype", SHAPES, ids=IDS)
def test_decompositions(shape, dtype):
    spd = _spd(*shape, dtype=dtype)
    assert check(aten.linalg_inv_ex.default, lambda: (spd.clone(),)) > 0
    assert check(aten._linalg_solve_ex.default, lambda: (spd.clone(), spd.clone())) > 0
    assert check(aten._linalg_eigh.default, lambda: (spd.clone(), "L", True)) > 0
    assert check(aten._linalg_eigh.default, lambda: (spd.clone(), "L", False)) > 0
    assert check(aten.linalg_eig.default, lambda: (spd.clone(),)) > 0
    assert check(aten.linalg_eigvals.default, lambda: (spd.clone(),)) > 0
    assert check(aten._linalg_check_errors.default, lambda: (torch.zeros(shape[:-2], dtype=torch.int32), "t"),
                 {"is_matrix": False}) > 0
    lu, pivots = torch.linalg.lu_factor(spd)
    assert check(aten.lu_unpack.default, lambda: (lu.clone(), pivots.clone())) > 0


@pytest.mark.parametrize("rows, cols", [(12, 12), (12, 7), (7, 12)], ids=["square", "tall", "wide"])
@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("batch", [(3,), ()], ids=["batch", "2d"])
def test_svd_and_pinv(rows, cols, dtype, batch):
    a = _general(*batch, rows, cols, dtype=dtype)
    assert check(aten._linalg_svd.default, lambda: (a.clone(), False, True)) > 0
    assert check(aten._linalg_svd.default, lambda: (a.clone(), True, False)) > 0
    assert check(aten.linalg_pinv.atol_rtol_tensor, lambda: (a.clone(),)) > 0
    spd = _spd(*batch, rows, rows, dtype=dtype)
    assert check(aten.linalg_pinv.atol_rtol_tensor, lambda: (spd.clone(),), {"hermitian": True}) > 0


@pytest.mark.parametrize("shape, dtype", SHAPES, ids=IDS)
@pytest.mark.parametrize("norm", [0.01, 8.0])
def test_matrix_exp(shape, dtype, norm):
    """A batch takes degree 18 whatever its norm (exact); one matrix of a large norm takes it too (the
    rule's upper bound for one matrix, exact there); a small norm's lower degrees allocate less."""
    a = _scaled(*shape, norm=norm, dtype=dtype)
    if a.numel() == shape[-1] * shape[-2] and norm < 1:  # one matrix, a small norm: a bound
        measured = measure_scratch(lambda args: aten.linalg_matrix_exp.default(*args), lambda: (a.clone(),)).extra
        assert 0 < measured < rule_on_fakes(aten.linalg_matrix_exp.default, (a.clone(),), {})
    else:
        check(aten.linalg_matrix_exp.default, lambda: (a.clone(),))


N = 12
OPS = {
    "matrix_exp": lambda h, spd: torch.linalg.matrix_exp(h * 0.01).mean(),
    "svdvals": lambda h, spd: torch.linalg.svdvals(h).mean(),
    "eigvals": lambda h, spd: torch.linalg.eigvals(spd).real.mean(),
    "inv": lambda h, spd: torch.linalg.inv(spd).mean(),
    "eigvalsh": lambda h, spd: torch.linalg.eigvalsh(spd).mean(),
    "pinv": lambda h, spd: torch.linalg.pinv(h).mean(),
    "lu_factor": lambda h, spd: torch.linalg.lu_factor(spd)[0].mean(),
}


def _linalg_model(op, n=N):
    def build(batch_size=3):
        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(8, n * n)

            def forward(self, x):
                h = self.fc(x).view(-1, n, n)
                spd = h @ h.mT / n + torch.eye(n)
                return OPS[op](h, spd)

        return Net(), (torch.randn(batch_size, 8),)

    return Workload(f"linalg-{op}", build, 3, {})


@pytest.mark.parametrize("op, n", [*((op, N) for op in OPS), ("pinv", 48), ("lu_factor", 48)])
def test_estimate_matches_allocator(op, n):
    """At 48x48 the backward of pinv and lu_factor peaks at an add of their own formula, which the
    estimate took for the engine's in-place sum of two gradients (one batch of matrices short)."""
    config = StepConfig(precision="fp32", optimizer="sgd", steps=2)
    predicted = estimate(_linalg_model(op, n), config, device="cpu")
    measured = measure(_linalg_model(op, n), config, device="cpu")
    assert predicted.phase_peaks == measured.phase_peaks
    assert predicted.peak_bytes == measured.measured_peak_bytes
    assert not predicted.approximate  # a batch's matrix_exp takes degree 18 whatever the values
