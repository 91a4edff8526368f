"""Sparse tensors: nn.Embedding(sparse=True) and nn.EmbeddingBag(sparse=True) gradients through gradient
accumulation and the optimizers that take them (SGD, momentum, Adagrad), and a sparse COO input (a graph's
adjacency in a GCN). Their fake kernels miscount them, so the tracer runs these ops on the sparse tensors'
index and value tensors itself (memplan.trace._SPARSE_OPS). The ground truth is `memplan.verify.measure`."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memplan.estimate import estimate
from memplan.step import StepConfig
from memplan.verify import measure
from memplan.workload import Workload

PHASES = ("forward", "backward", "optimizer")
ROWS, WIDTH = 500, 16


def _ids(batch_size: int, length: int) -> torch.Tensor:
    """Token ids with repeats (73 distinct of 80), the same in the trace and the measured run."""
    return (torch.arange(batch_size * length) * 7).remainder(73).view(batch_size, length)


def sparse_lookup(batch_size: int = 8, kind: str = "embedding"):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            if kind == "embedding":
                self.table = nn.Embedding(ROWS, WIDTH, sparse=True)
            else:
                self.table = nn.EmbeddingBag(ROWS, WIDTH, sparse=True, mode=kind)
            self.head = nn.Linear(WIDTH, 1)

        def forward(self, ids):
            rows = self.table(ids)
            return self.head(rows if rows.dim() == 2 else rows.mean(1)).mean()

    return Net(), (_ids(batch_size, 10),)


def sparse_lookup_of_unknown_ids(batch_size: int = 8):
    """Ids computed from random floats: their values, so the distinct count, are unknown to the tracer."""
    model, _ = sparse_lookup(batch_size)
    return model, ((torch.rand(batch_size, 10) * ROWS).long(),)


def gcn(batch_size: int = 120):
    """Kipf and Welling's graph convolution over a sparse COO adjacency, coalesced while building."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.l1, self.l2 = nn.Linear(32, 64), nn.Linear(64, 8)

        def forward(self, x, adjacency):
            h = torch.relu(torch.sparse.mm(adjacency, self.l1(x)))
            return torch.sparse.mm(adjacency, self.l2(h)).pow(2).mean()

    n = batch_size
    edges = torch.stack([torch.arange(5 * n).remainder(n), (torch.arange(5 * n) * 3).remainder(n - 7)])
    adjacency = torch.sparse_coo_tensor(edges, torch.ones(5 * n), (n, n)).coalesce()
    return Net(), (torch.randn(n, 32), adjacency)


def _compare(build, options: dict, config: StepConfig):
    workload = Workload(build.__name__, build, None, options)
    return estimate(workload, config, device="cpu"), measure(workload, config, device="cpu")


@pytest.mark.parametrize("kind", ["embedding", "sum", "mean"])
@pytest.mark.parametrize("optimizer,grad_accum", [("sgd", 1), ("sgd", 2), ("sgd-momentum", 1), ("adagrad", 1)])
def test_sparse_gradients_are_estimated_as_measured(kind, optimizer, grad_accum):
    """The gradient's indices and values (one row per index), summed by concatenation over micro-batches
    and momentum steps, coalesced by Adagrad (the distinct count from the known ids), each phase to the byte."""
    config = StepConfig(precision="fp32", optimizer=optimizer, grad_accum=grad_accum, steps=2)
    predicted, measured = _compare(sparse_lookup, {"kind": kind}, config)
    assert {p: predicted.phase_peaks[p] for p in PHASES} == {p: measured.phase_peaks[p] for p in PHASES}
    assert predicted.peak_bytes == measured.measured_peak_bytes
    assert not predicted.approximate


def test_a_coalesce_of_unknown_indices_is_a_flagged_bound():
    config = StepConfig(precision="fp32", optimizer="adagrad", steps=2)
    predicted, measured = _compare(sparse_lookup_of_unknown_ids, {}, config)
    assert "aten._coalesce.default" in predicted.approximate_ops
    assert predicted.phase_peaks["optimizer"] >= measured.phase_peaks["optimizer"]
    assert predicted.phase_peaks["backward"] == measured.phase_peaks["backward"]


def test_a_sparse_input_is_estimated_as_measured():
    """Its parts count as inputs; the products' backward transposes it (a copy of its indices and values)."""
    predicted, measured = _compare(gcn, {}, StepConfig(precision="fp32", optimizer="adamw", steps=2))
    assert {p: predicted.phase_peaks[p] for p in PHASES} == {p: measured.phase_peaks[p] for p in PHASES}
    assert predicted.peak_bytes == measured.measured_peak_bytes


def to_sparse_in_forward(batch_size: int = 4):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return torch.sparse.sum(torch.relu(self.fc(x)).to_sparse())

    return Net(), (torch.randn(batch_size, 8),)


def test_a_sparse_op_not_modelled_fails_the_estimate_by_name():
    """Not an estimate from the fake kernel's miscount: the op is named."""
    with pytest.raises(NotImplementedError, match=r"aten\._to_sparse.* with sparse tensors is not modelled"):
        estimate(Workload("to_sparse", to_sparse_in_forward, None, {}), StepConfig(steps=2), device="cpu")


def test_the_cli_names_a_sparse_op_not_modelled_in_one_line(tmp_path):
    from typer.testing import CliRunner

    from cli.main import app

    path = tmp_path / "to_sparse.py"
    path.write_text(
        "import torch\nfrom torch import nn\n\n\n"
        "class Net(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.fc = nn.Linear(8, 8)\n\n"
        "    def forward(self, x):\n        return torch.sparse.sum(torch.relu(self.fc(x)).to_sparse())\n\n\n"
        "def build(batch_size=4):\n    return Net(), (torch.randn(batch_size, 8),)\n")
    result = CliRunner().invoke(app, ["estimate", f"{path}:build", "--device", "cpu"])
    assert result.exit_code == 1, result.output
    assert result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1
    assert "aten._to_sparse.default with sparse tensors is not modelled" in result.stderr
