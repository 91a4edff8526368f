"""Steps that read values back and let them steer Python (neural ODE solvers: torchdiffeq's fixed grid
sized by `.item()` of its time points, its adaptive solvers' step control). The ground truth is always
`memplan.verify.measure`.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from memplan import trace
from memplan.errors import BadInput
from memplan.estimate import estimate
from memplan.step import StepConfig
from memplan.verify import measure
from memplan.workload import Workload

PHASES = ("forward", "backward", "optimizer")


def _assert_phases_equal(predicted, measured):
    for phase in PHASES:
        assert predicted.phase_peaks[phase] == measured.phase_peaks[phase], (phase, predicted.phase_peaks,
                                                                           measured.phase_peaks)


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
    _assert_phases_equal(predicted, measured)
    assert not predicted.approximate


class _StepControl(nn.Module):
    """An adaptive solver's step control (zuko's CNF, torchdiffeq's dopri5): the error of each step read
    back (`.item()`) sizes the next. Each unknown float reads 1.0 under fake tensors, so the estimate runs
    its own number of steps (three here; eager's small error doubles the step: one). It must say that
    the count is a guess."""

    def __init__(self):
        super().__init__()
        self.f = nn.Linear(32, 32)

    def forward(self, x):
        t, dt = 0.0, 0.5
        while t < 1.0:
            new = x + dt * torch.tanh(self.f(x))
            err = ((new - x).abs().max() * 1e-4).item()
            dt = dt * min(2.0, max(0.5, 0.9 / err ** 0.2))
            t, x = t + dt, new
        return x.square().mean()


def step_control(batch_size: int = 8):
    return _StepControl(), (torch.randn(batch_size, 32),)


def test_a_loop_steered_by_unknown_values_is_flagged_approximate():
    predicted, measured = _compare(step_control)
    assert predicted.peak_bytes != measured.measured_peak_bytes  # eager ran fewer trips than the guess
    assert predicted.approximate
    assert any("loop reading unknown values" in op for op in predicted.approximate_ops), predicted.approximate_ops


class _CheckedLayers(nn.Module):
    """A check once per layer (`assert torch.isfinite(x).all()`) reads one unknown value per module call:
    a check, not a loop; the estimate stays exact and unflagged."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(_Checked() for _ in range(6))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


class _Checked(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(32, 32)

    def forward(self, x):
        assert torch.isfinite(x).all()
        return torch.relu(self.lin(x))


def checked_layers(batch_size: int = 8):
    return _CheckedLayers(), (torch.randn(batch_size, 32),)


def test_a_check_per_layer_is_no_loop():
    predicted, measured = _compare(checked_layers)
    assert predicted.peak_bytes == measured.measured_peak_bytes
    assert not predicted.approximate


class _Forever(nn.Module):
    """A loop until an error read back (`.item()`) is small, as zuko's CNF rejects and shrinks a step until
    its error is below 1: every unknown float reads 1.0, so under fake tensors the loop never ended (the
    estimate hung)."""

    def __init__(self):
        super().__init__()
        self.f = nn.Linear(8, 8)

    def forward(self, x):
        z, err = x, 1.0
        while err >= 1.0:
            new = torch.tanh(self.f(z)) * 0.5
            err = ((new - z).abs().max() * 1e-3).item()
            z = new
        return z.square().mean()


def forever(batch_size: int = 4):
    return _Forever(), (torch.randn(batch_size, 8),)


def test_a_loop_that_never_ends_under_fake_tensors_is_refused():
    workload = Workload("forever", forever, None, {})
    with pytest.raises(BadInput, match="depend on the data"):
        estimate(workload, StepConfig(precision="fp32", optimizer="sgd", steps=1), device="cpu")
    assert math.isfinite(measure(workload, StepConfig(precision="fp32", optimizer="sgd", steps=1),
                                 device="cpu").measured_peak_bytes)


class _SplineInside(nn.Module):
    """nflows' rational-quadratic splines with linear tails: `inside = (x >= -b) & (x <= b)`, the outside
    passed through, and `if torch.any(inside):` the inside transformed by the spline (the only use of the
    parameters). A test of float values read back reads as a validity check (false) unless it is a range
    test: read false here, the spline was skipped and the estimate refused the model ("the loss does not
    depend on any trainable parameter"; nflows' MAF with spline transforms, every setting)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 4))

    def forward(self, x):
        inside = (x >= -100.0) & (x <= 100.0)
        out = torch.zeros_like(x)
        out[~inside] = x[~inside]
        if torch.any(inside):
            out[inside] = self.net(x)[inside]
        return out.square().mean()


def spline_inside(batch_size: int = 16):
    return _SplineInside(), (torch.randn(batch_size, 4),)


def test_any_over_a_range_test_reads_true():
    predicted, measured = _compare(spline_inside)
    assert predicted.phase_peaks["backward"] == measured.phase_peaks["backward"]
    assert predicted.peak_bytes >= measured.measured_peak_bytes  # the outside: every element, a bound
    assert predicted.approximate  # masks over unknown values


class _ValidRowsOnly(nn.Module):
    """ultralytics' RLE keypoint loss: `if not (visibility != 0).any()` and, over the rows of an error
    whose values are all finite, `valid = ~(isnan(error) | isinf(error)).any(-1); if not valid.any()`
    return a zero loss, else a flow (an MLP) over the valid rows. Both `any()`s read false, as over a
    validity test: the flow never ran in the traced step (YOLO26n-pose: the forward 4,015,752 B, 7.3%,
    under while flagged approximate, a bound)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.flow = nn.Sequential(nn.Linear(2, 256), nn.SiLU(), nn.Linear(256, 2))

    def forward(self, x, target):
        error = self.lin(x).view(-1, 2) - target
        if not (error[:, 0] != 0).any():
            return error[..., :0].sum()
        valid = ~(torch.isnan(error) | torch.isinf(error)).any(dim=-1)
        if not valid.any():
            return error[..., :0].sum()
        return self.flow(error[valid]).square().mean()


def valid_rows_only(batch_size: int = 16):
    return _ValidRowsOnly(), (torch.randn(batch_size, 8), torch.randn(batch_size * 4, 2))


def test_any_over_a_negated_validity_test_reads_true():
    predicted, measured = _compare(valid_rows_only)
    _assert_phases_equal(predicted, measured)  # every row valid: the selection assumed is the real one


@pytest.mark.parametrize("test", [
    lambda e: ~(torch.isnan(e) | torch.isinf(e)).any(dim=-1),
    lambda e: torch.isfinite(e),
    lambda e: ~torch.isfinite(e),
    lambda e: ~torch.isnan(e) & (e > -100),
    lambda e: e != 0,
    lambda e: e.ne(e),  # a NaN test
    lambda e: e == 0.5,
])
def test_any_over_tests_of_finite_values_reads_as_eager(test):
    values = torch.randn(64, 2)
    recorder = trace._Recorder(trace.TraceRules())
    with FakeTensorMode() as mode, recorder:
        read = bool(test(mode.from_tensor(values)).any())
    assert read == bool(test(values).any())


def test_any_over_an_out_of_range_test_still_reads_false():
    """trunc_normal_'s rejection loop (`mask = (w < a) | (w > b); if not mask.any(): break`) and a
    negated range stay validity checks: read false, the loop ends at once."""
    recorder = trace._Recorder(trace.TraceRules())
    with FakeTensorMode(), recorder:
        w = torch.empty(64).normal_()
        assert not bool(((w < -2) | (w > 2)).any())
        assert not bool((~((w >= -2) & (w <= 2))).any())
        assert bool(((w >= -2) & (w <= 2)).any())


class _NumpyIndexed(nn.Module):
    """nflows' LULinear: a triangular matrix filled at every forward by NumPy index arrays
    (`lower[np.tril_indices(...)] = entries`). Eager wraps each array's buffer (no allocation); the
    tracer's fake copy of it counted as one (nflows' Glow-style flow: 320 B over in forward)."""

    def __init__(self, n=24):
        super().__init__()
        import numpy as np

        self.rows, self.cols = np.tril_indices(n, k=-1)
        self.entries = nn.Parameter(torch.randn(len(self.rows)) * 0.1)
        self.scale = np.linspace(0.5, 1.5, n)
        self.n = n

    def forward(self, x):
        lower = self.entries.new_zeros(self.n, self.n)
        lower[self.rows, self.cols] = self.entries
        w = lower + torch.eye(self.n, dtype=x.dtype) * torch.as_tensor(self.scale, dtype=x.dtype)
        return (x @ w).square().mean()


def numpy_indexed(batch_size: int = 4):
    return _NumpyIndexed(), (torch.randn(batch_size, 24),)


@pytest.mark.parametrize("precision,optimizer", [("fp32", "adamw"), ("bf16", "sgd")])
def test_tensors_over_numpy_memory_allocate_nothing(precision, optimizer):
    predicted, measured = _compare(numpy_indexed, precision, optimizer)
    _assert_phases_equal(predicted, measured)


class _SafeCholesky(nn.Module):
    """An exact GP's marginal likelihood through linear_operator's psd_safe_cholesky: `L, info =
    torch.linalg.cholesky_ex(K)`; `if not torch.any(info): return L`, else jitter and retry, and raise
    NotPSDError at last. The info read back as 1 under fake tensors: every GPyTorch exact GP failed."""

    def __init__(self):
        super().__init__()
        self.log_ls = nn.Parameter(torch.zeros(()))
        self.log_noise = nn.Parameter(torch.tensor(-2.0))

    def forward(self, x, y):
        d = (x[:, None] - x[None]).square().sum(-1) / self.log_ls.exp()
        k = torch.exp(-0.5 * d) + self.log_noise.exp() * torch.eye(x.shape[0], dtype=x.dtype)
        for jitter in (0.0, 1e-6, 1e-4):
            chol, info = torch.linalg.cholesky_ex(k + jitter * torch.eye(x.shape[0], dtype=x.dtype))
            if not torch.any(info):
                break
        else:
            raise RuntimeError("not positive definite")
        alpha = torch.cholesky_solve(y[:, None], chol)
        return 0.5 * (y[:, None] * alpha).sum() + chol.diagonal().log().sum()


def safe_cholesky(batch_size: int = 8):
    return _SafeCholesky(), (torch.rand(batch_size, 2), torch.randn(batch_size))


def test_a_linalg_info_reads_success():
    """The step's peak (backward's) and the optimizer's are exact; forward's is within a few bytes (the
    Cholesky's own small work buffers: 30 B short at 8 points, open)."""
    predicted, measured = _compare(safe_cholesky)
    assert predicted.peak_bytes == measured.measured_peak_bytes
    for phase in ("backward", "optimizer"):
        assert predicted.phase_peaks[phase] == measured.phase_peaks[phase], (phase, predicted.phase_peaks,
                                                                           measured.phase_peaks)
    assert abs(predicted.phase_peaks["forward"] - measured.phase_peaks["forward"]) <= 64
    assert not predicted.approximate


class _LoopingBackward(torch.autograd.Function):
    """A backward that steps until an error read back is small (torchdiffeq's adjoint: its reverse solve
    reads `max(rms_norm(...))` at every step), 150 trips each time."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        for _ in range(150):
            if grad.abs().max() > 1e9:  # an unknown value read back in a loop
                break
            grad = grad * 1.0
        return grad * 2


class _AdjointLike(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return _LoopingBackward.apply(self.lin(x)).square().mean()


def adjoint_like(batch_size: int = 4):
    return _AdjointLike(), (torch.randn(batch_size, 8),)


def test_a_backward_loop_counts_per_backward_pass():
    """With 2 micro-batches and 2 steps, four backward passes of 150 reads each, all outside any module
    call: summed into one loop they passed the limit and the estimate was refused."""
    workload = Workload("adjoint_like", adjoint_like, None, {})
    config = StepConfig(precision="fp32", optimizer="sgd", grad_accum=2, steps=2)
    predicted = estimate(workload, config, device="cpu")
    assert predicted.approximate
    assert predicted.peak_bytes == measure(workload, config, device="cpu").measured_peak_bytes


def split_by_index_tensor(batch_size: int = 4):
    """torch.tensor_split by a tensor of indices (a buffer) and by a 0-dim count of sections: eager reads
    both through their data pointers; the estimate failed ("its data is not allocated yet")."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 48)
            self.register_buffer("cuts", torch.tensor([8, 20, 40]))
            self.register_buffer("sections", torch.tensor(3))

        def forward(self, x):
            h = self.fc(x)
            parts = torch.tensor_split(h, self.cuts, dim=1) + h.tensor_split(self.sections, 1)
            return sum(p.square().mean() * (i + 1) for i, p in enumerate(parts))

    return Net(), (torch.randn(batch_size, 16),)


def test_tensor_split_by_a_tensor_reads_it_back():
    predicted, measured = _compare(split_by_index_tensor)
    assert predicted.phase_peaks == measured.phase_peaks
    assert predicted.peak_bytes == measured.measured_peak_bytes


class _RandomDepth(nn.Module):
    """Residual quantization's dropout (vector-quantize-pytorch's ResidualVQ): each step runs the first
    `n` of its stages, `n` drawn at random and read back (`torch.randint(low, high, ()).item()`); `fixed`
    runs a given number of stages instead."""

    def __init__(self, fixed: int | None = None):
        super().__init__()
        self.fixed = fixed
        self.stages = nn.ModuleList(nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)) for _ in range(8))

    def forward(self, x):
        n = self.fixed if self.fixed is not None else int(torch.randint(1, 8, ()).item())
        for stage in self.stages[:n]:
            x = x + stage(x)
        return x.square().mean()


def random_depth(batch_size: int = 16):
    return _RandomDepth(), (torch.randn(batch_size, 64),)


def test_a_random_integer_read_back_reads_its_median_and_flags_the_estimate():
    """A single random integer read back is a value with no likelier side: it read 1 as any unknown
    integer does (the fewest stages), and the estimate claimed exactness. It reads as its median now
    (`randint(1, 8)`: 4), a typical draw, and the estimate says it is approximate; a checkpoint may still
    hold the draw (its recomputation draws the same number)."""
    predicted, _ = _compare(random_depth)
    median = Workload("median", lambda batch_size=16: (_RandomDepth(fixed=4), (torch.randn(batch_size, 64),)), None, {})
    config = StepConfig(precision="fp32", optimizer="adamw", steps=2)
    measured = measure(median, config, device="cpu")
    assert predicted.peak_bytes == measured.measured_peak_bytes
    assert {k: predicted.phase_peaks[k] for k in PHASES} == {k: measured.phase_peaks[k] for k in PHASES}
    assert predicted.approximate and predicted.approximate_ops == ("aten.randint.low",)
    assert trace.drawn("aten.randint.low") and not trace.drawn("aten.nonzero.default")


class _ColumnsByAttribute(nn.Module):
    """pytorch-tabnet's EmbeddingGenerator: which columns are categorical is a plain tensor attribute, not a
    buffer (`self.continuous_idx = torch.ones(n, dtype=torch.bool)`, then `[cat_idxs] = 0`), and forward
    iterates over it to embed those columns. Only inputs' and buffers' known values reached the traced
    step, so every column read as continuous and the estimate failed on the next layer's width (TabNet
    with categorical features: "running_mean should contain 16 elements not 21", every setting)."""

    def __init__(self):
        super().__init__()
        self.continuous = torch.ones(8, dtype=torch.bool)
        self.continuous[[0, 3]] = 0
        self.sizes = [torch.tensor(16), torch.tensor(24)]  # in a list, too
        self.embeddings = nn.ModuleList([nn.Embedding(5, int(n)) for n in self.sizes])
        self.head = nn.Linear(6 + 16 + 24, 4)

    def forward(self, x):
        columns, k = [], 0
        for i, continuous in enumerate(self.continuous):
            if continuous:
                columns.append(x[:, i:i + 1])
            else:
                columns.append(self.embeddings[k](x[:, i].long())[:, :int(self.sizes[k])])
                k += 1
        return self.head(torch.cat(columns, 1)).float().square().mean()


def columns_by_attribute(batch_size: int = 64):
    x = torch.randn(batch_size, 8)
    x[:, 0], x[:, 3] = 1, 2
    return _ColumnsByAttribute(), (x,)


@pytest.mark.parametrize("precision,optimizer", [("fp32", "adamw"), ("amp-bf16", "adamw")])
def test_a_plain_tensor_attributes_known_value_steers_forward_as_in_eager(precision, optimizer):
    predicted, measured = _compare(columns_by_attribute, precision, optimizer)
    _assert_phases_equal(predicted, measured)
    assert not predicted.approximate


class _SetUpByARun(nn.Module):
    """A factory that runs the model once to set it up (pyro's AutoNormal traces the model while the
    factory builds it): torch.distributions validates `Normal(mean, 1.0)` by `torch._is_all_true` over a
    constraint's test, and the loss is read back as a float for the log (pyro's Trace_ELBO: `.item()` of
    each site's log-probability), both over a random Linear's output, which no build can know. Both
    failed the build (DataDependentOutputException: aten._local_scalar_dense.default)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 8)
        self.scale = None

    def forward(self, x, y):
        mean = self.lin(x)
        if self.scale is None:  # set up on the first call, as AutoNormal's prototype trace
            self.scale = nn.Parameter(torch.ones(8))
        loss = -torch.distributions.Normal(mean, self.scale.abs() + 0.1).log_prob(y).sum()
        self.logged = float(loss.detach().item())
        return loss


def set_up_by_a_run(batch_size: int = 4):
    model = _SetUpByARun()
    x, y = torch.randn(batch_size, 16), torch.randn(batch_size, 8)
    model(x, y)
    return model, (x, y)


def test_a_factory_that_runs_the_model_reads_its_checks_and_floats_as_the_step_does():
    predicted, measured = _compare(set_up_by_a_run)
    _assert_phases_equal(predicted, measured)


def test_an_unknown_integer_read_while_building_still_fails():
    def sized_by_an_unknown_count(batch_size: int = 2):
        first = nn.Linear(16, 16)  # initialised in place: no lineage replays its values
        width = int((first.weight > 0).sum().item())  # a size no build can know
        return nn.Sequential(first, nn.Linear(16, width)), (torch.randn(batch_size, 16),)

    with pytest.raises(BadInput, match="DataDependentOutputException"):
        _compare(sized_by_an_unknown_count)
