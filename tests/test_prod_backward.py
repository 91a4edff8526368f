"""The backward of prod and cumprod as eager runs it (memplan/eager_backward.py; a sweep over kornia's
MS-SSIM loss, which takes a product over scales, found it 196,608 B over eager in backward)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memplan.estimate import estimate
from memplan.step import StepConfig
from memplan.verify import measure
from memplan.workload import Workload


class _Products(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.fc = nn.Linear(64, 64)

    def forward(self, x):
        h = torch.sigmoid(self.fc(x))  # (batch, 5, 64): no element is zero
        if self.kind == "prod_dim":
            return h.prod(dim=1).sum()
        if self.kind == "prod_keepdim":
            return torch.prod(h, 1, keepdim=True).sum()
        if self.kind == "prod":
            return h.prod()
        return h.cumprod(dim=1).sum()


@pytest.mark.parametrize("kind", ["cumprod", "prod_dim", "prod_keepdim", "prod"])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "amp-bf16"])
def test_the_backward_of_a_product_runs_eagers_kernels(kind, precision):
    """Eager's prod and cumprod backward test the input for zeros (`(input == 0).any()`, a count per
    slice, `nonzero()`) and, finding none, divide `grad * result` by the input (cumprod: summed
    backwards first). Under a Python dispatch mode (the tracer's) they take the zero-safe formulas
    instead, without the test: exclusive products by cumprod, cat, flip, scatter and gather, several
    input-sized buffers more (the cumprod here: 75,008 B over in fp32)."""
    workload = Workload(kind, lambda batch_size=64: (_Products(kind), (torch.randn(batch_size, 5, 64),)), None, {})
    config = StepConfig(precision=precision, optimizer="sgd", steps=2)
    predicted = estimate(workload, config, device="cpu")
    measured = measure(workload, config, device="cpu")
    assert predicted.peak_bytes == measured.measured_peak_bytes
    assert dict(predicted.phase_peaks) == dict(measured.phase_peaks)
    assert not predicted.approximate
