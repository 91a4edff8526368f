"""Backward formulas that take another path under tracing than in eager (memplan/eager_backward.py):
cumprod and prod divide by the input in eager and take a zero-safe product under a dispatch mode, and
binary cross-entropy with logits writes its gradient in place in eager, out of place under one, and
a reduction to one element (max(), min(), median()) fills its gradient into new zeros in eager, as
`take` puts its gradient into them in place. Also
the scratch of kernels whose work the trace cannot see: cdist's matrix-product path
(`_euclidean_dist`), binary cross-entropy with logits over operands of mixed dtypes, and ops registered
outside aten (torch's chunked `linear_cross_entropy`). The ground truth is `memplan.verify.measure`
(the allocator's own events)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from memplan.eager_backward import EAGER_BACKWARDS
from memplan.estimate import estimate
from memplan.step import StepConfig
from memplan.verify import measure
from memplan.workload import Workload


def _target(h: torch.Tensor) -> torch.Tensor:
    return torch.linspace(0, 1, h.numel(), device=h.device).view_as(h).to(h.dtype)


HEADS = {
    "cumprod": lambda h: h.sigmoid().cumprod(dim=1),
    "cumprod_function": lambda h: torch.cumprod(h.sigmoid(), -1),
    "prod_dim": lambda h: h.sigmoid().prod(dim=1, keepdim=True) * h,
    "prod_dim_dropped": lambda h: torch.prod(h.sigmoid(), 1)[:, None] * h,
    "prod_all": lambda h: h.sigmoid().prod() * h,
    "bce_pos_weight": lambda h: F.binary_cross_entropy_with_logits(
        h, _target(h), pos_weight=torch.full((h.shape[1],), 2.0), reduction="none"),
    "bce_weight_pos_weight_mean": lambda h: h * F.binary_cross_entropy_with_logits(
        h, _target(h), weight=torch.ones(h.shape[1]), pos_weight=torch.full((h.shape[1],), 2.0)),
    "bce_module": lambda h: h * nn.BCEWithLogitsLoss(pos_weight=torch.full((h.shape[1],), 2.0))(h, _target(h)),
    "max_all": lambda h: h.max().expand(2),
    "min_all_method": lambda h: torch.min(h * 2).expand(2),
    "median_all": lambda h: h.median().expand(2),
    "take": lambda h: torch.take(h, torch.arange(0, h.numel(), 3)),
    "cdist": lambda h: torch.cdist(h, h.flip(0)),
    "cdist_batched": lambda h: torch.cdist(h.view(4, -1, 64), h.view(4, -1, 64).flip(1),
                                           compute_mode="use_mm_for_euclid_dist"),
}


class Head(nn.Module):
    def __init__(self, name: str):
        super().__init__()
        self.fc = nn.Linear(64, 64)
        self.name = name

    def forward(self, x):
        return HEADS[self.name](self.fc(x)).square().mean()


def head(batch_size: int = 32, name: str = "cumprod"):
    torch.manual_seed(0)
    return Head(name), (torch.randn(batch_size, 64),)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "amp-bf16"])
@pytest.mark.parametrize("name", list(HEADS))
def test_backward_formulas_and_kernels_match_eager(name, precision):
    workload = Workload(f"head:{name}", head, 32, {"name": name})
    config = StepConfig(precision=precision, optimizer="sgd", steps=2)
    predicted, measured = estimate(workload, config, device="cpu"), measure(workload, config, device="cpu")
    assert not predicted.approximate
    assert predicted.phase_peaks == measured.phase_peaks
    assert predicted.peak_bytes == measured.measured_peak_bytes


@pytest.mark.parametrize("function", ["cumprod", "prod_dim", "prod_all", "bce", "max", "median", "take"])
def test_eager_path_gradients_equal_torch_s(function):
    """The Functions' backward is eager's path op for op, so on real tensors (without zeros) its
    gradients are torch's own, a double backward included."""
    torch.manual_seed(0)
    x = torch.rand(6, 5, dtype=torch.float64) + 0.5
    target, weight, pos_weight = torch.rand(6, 5, dtype=torch.float64), torch.rand(5, dtype=torch.float64), \
        torch.rand(5, dtype=torch.float64) + 1
    calls = {
        "cumprod": (torch.cumprod, (1,), {}),
        "prod_dim": (torch.prod, (0,), {}),
        "prod_all": (torch.prod, (), {}),
        "bce": (F.binary_cross_entropy_with_logits, (target, weight), {"pos_weight": pos_weight}),
        "max": (torch.max, (), {}),
        "median": (torch.median, (), {}),
        "take": (torch.take, (torch.tensor([0, 7, 7, 29]),), {}),
    }
    original, args, kwargs = calls[function]
    rewrite = EAGER_BACKWARDS[original]
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    ours, torch_s = rewrite(b, *args, **kwargs), original(a, *args, **kwargs)
    assert type(ours.grad_fn) is not type(torch_s.grad_fn)  # the Function's node, not torch's: under test
    torch_s.sum().backward()
    ours.sum().backward()
    assert a.grad is not None and torch.allclose(a.grad, b.grad)
    assert torch.autograd.gradcheck(lambda t: rewrite(t, *args, **kwargs), (x.clone().requires_grad_(),))
    assert torch.autograd.gradgradcheck(lambda t: rewrite(t, *args, **kwargs), (x.clone().requires_grad_(),))


class ChunkedHead(nn.Module):
    """A language model's head through F.linear_cross_entropy's chunked path: a custom op
    (torch_nn::_linear_cross_entropy_batch_chunked) that makes the logits and their softmax a chunk at a
    time inside its kernel, which the fake implementation does not."""

    def __init__(self, reduction: str, vocab: int = 1000, d: int = 64):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.fc = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.reduction = reduction

    def forward(self, ids, labels):
        h = torch.tanh(self.fc(self.emb(ids))).flatten(0, 1)
        options = nn.LinearCrossEntropyOptions(batch_chunk_size=64)
        return F.linear_cross_entropy(h, self.head.weight, labels.flatten(), reduction=self.reduction,
                                      options=options).mean()


def chunked_head(batch_size: int = 4, reduction: str = "mean"):
    torch.manual_seed(0)
    return ChunkedHead(reduction), (torch.randint(0, 1000, (batch_size, 64)), torch.randint(0, 1000, (batch_size, 64)))


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "amp-bf16"])
def test_custom_ops_scratch_is_measured(precision, reduction):
    workload = Workload("chunked_head", chunked_head, 4, {"reduction": reduction})
    config = StepConfig(precision=precision, optimizer="adamw", steps=2)
    predicted, measured = estimate(workload, config, device="cpu"), measure(workload, config, device="cpu")
    assert predicted.phase_peaks == measured.phase_peaks
    assert predicted.peak_bytes == measured.measured_peak_bytes


@torch.library.custom_op("memplan_tests::gated", mutates_args=())
def gated(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A user's extension op: its kernel makes `x @ w` inside, held to the end, which its fake
    implementation does not."""
    scores = x @ w
    return torch.sigmoid(scores) * x


@gated.register_fake
def _(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _gated_backward(ctx, grad):
    x, w = ctx.saved_tensors
    s = torch.sigmoid(x @ w)
    inner = (grad * x) * s * (1 - s)
    return grad * s + inner @ w.t(), x.t() @ inner


gated.register_autograd(_gated_backward, setup_context=lambda ctx, inputs, output: ctx.save_for_backward(*inputs))


class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 64)
        self.w = nn.Parameter(torch.randn(64, 64) * 0.1)

    def forward(self, x):
        return gated(self.fc(x), self.w).square().mean()


def test_a_users_custom_op_scratch_is_measured():
    """The user's op above: 65,520 B short in forward (fp32, a 256x64 batch) before its scratch was probed."""
    workload = Workload("gated", lambda batch_size=256: (Gated(), (torch.randn(batch_size, 64),)), 256, {})
    config = StepConfig(precision="fp32", optimizer="adamw", steps=2)
    predicted, measured = estimate(workload, config, device="cpu"), measure(workload, config, device="cpu")
    assert predicted.phase_peaks == measured.phase_peaks
