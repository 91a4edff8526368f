"""Kernel scratch rules (memplan/scratch.py) against the CPU allocator's own events, measured here.

Each test runs the real op under the allocator's profiler (`memplan.scratch.measure`: the peak of the
running allocation total inside the op, beyond its outputs) and compares the rule's figure for the
same op, given fake tensors as the tracer gives them. Thread-dependent formulas run at 1 and 2
threads. Nothing here is a number copied from the code: every expected value is measured.
"""

import pytest
import torch
from conftest import skip_unless_cpu_runs_bf16_lstm
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_map

from memplan.scratch import measure, rnn_workspace_bytes, scratch_of

aten = torch.ops.aten
RULE = scratch_of("cpu")
BF16 = torch.bfloat16


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    saved = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(saved)


def rule_on_fakes(op, args, kwargs=None):
    """The rule's figure as the tracer computes it: fake operands, the fake kernel's outputs."""
    kwargs = kwargs or {}
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake_args, fake_kwargs = tree_map(
            lambda v: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v, (args, kwargs))
        out = op(*fake_args, **fake_kwargs)
        return RULE(op, fake_args, fake_kwargs, out)


def check(op, make_args, kwargs=None):
    """The allocator's scratch for op(*make_args()) equals the rule's; returns it."""
    kwargs = kwargs or {}
    measured = measure(lambda args: op(*args, **kwargs), make_args).extra
    assert rule_on_fakes(op, make_args(), kwargs) == measured, f"{op}: measured {measured}"
    return measured


def randn(*shape, dtype=torch.float32, channels_last=False):
    x = torch.randn(*shape).to(dtype)
    return x.contiguous(memory_format=torch.channels_last) if channels_last else x


# --------------------------------------------------------------------------------------------------
# Generic rules: wrapped numbers, TensorIterator promotion


@pytest.mark.parametrize("op, make_args", [
    (aten.add.Tensor, lambda: (randn(4, 8, dtype=BF16), randn(4, 8))),  # bf16 operand copied to float32
    (aten.mul_.Tensor, lambda: (randn(4, 8), 0.9)),  # Python float: wrapped double, converted
    (aten.mul_.Tensor, lambda: (randn(4, 8, dtype=BF16), 0.9)),
    (aten.add_.Tensor, lambda: (torch.zeros((), dtype=torch.int64), 1)),  # wrapped int64, no conversion
    (aten.eq.Scalar, lambda: (torch.arange(32), 2.5)),  # integer tensor promoted to float
    (aten.div.Scalar, lambda: (randn(2, 10), 20)),
    (aten.where.self, lambda: (torch.rand(4, 8) > 0.5, randn(4, 8, dtype=BF16), randn(4, 8))),
    (aten.masked_fill.Scalar, lambda: (randn(4, 8), torch.rand(4, 8) > 0.5, 0.0)),  # no promotion
], ids=["add-bf16-fp32", "mul_-float", "mul_-bf16", "add_-int", "eq-int-float", "div-Scalar", "where", "masked_fill"])
def test_pointwise_promotion(op, make_args):
    check(op, make_args)


@pytest.mark.parametrize("op, make_args, kwargs", [
    (aten.mean.dim, lambda: (randn(2, 128, 3, 3, dtype=BF16), [-1, -2]), {}),
    (aten.mean.default, lambda: (randn(2, 10),), {}),
    (aten.sum.dim_IntList, lambda: (randn(8, 16, dtype=BF16), [0]), {"dtype": torch.float32}),
    (aten.sum.default, lambda: (torch.rand(64) > 0.5,), {}),
], ids=["mean-bf16", "mean-fp32", "sum-bf16-to-float", "sum-bool"])
def test_reductions(op, make_args, kwargs):
    assert check(op, make_args, kwargs) > 0


# --------------------------------------------------------------------------------------------------
# Formulas from PyTorch's CPU kernels


BN_CASES = [
    ((2, 16, 8, 8), False, torch.float32, torch.float32),
    ((2, 16, 8, 8), True, torch.float32, torch.float32),
    ((3, 16, 1, 1), False, torch.float32, torch.float32),  # NC11 takes the channels-last kernel
    ((2, 16, 8, 8), True, BF16, BF16),
    ((2, 128, 1, 1), False, BF16, torch.float32),  # mixed type, as under autocast
]


@pytest.mark.parametrize("shape, channels_last, dtype, param_dtype", BN_CASES)
def test_batch_norm(threads, shape, channels_last, dtype, param_dtype):
    channels = shape[1]

    def forward_args():
        return (randn(*shape, dtype=dtype, channels_last=channels_last), torch.ones(channels, dtype=param_dtype),
                torch.zeros(channels, dtype=param_dtype), torch.zeros(channels, dtype=param_dtype),
                torch.ones(channels, dtype=param_dtype), True, 0.1, 1e-5)

    check(aten.native_batch_norm.default, forward_args)

    def backward_args():
        x, w, _, rm, rv = forward_args()[:5]
        _, mean, invstd = aten.native_batch_norm.default(x, w, torch.zeros_like(w), rm, rv, True, 0.1, 1e-5)
        return (torch.randn_like(x), x, w, rm, rv, mean, invstd, True, 1e-5, [True, True, True])

    check(aten.native_batch_norm_backward.default, backward_args)


def test_batch_norm_channels_last_buffer_follows_threads():
    """The channels-last statistics buffer is {num_threads, C}: the rule must follow the thread count."""
    args = lambda: (randn(4, 32, 4, 4, dtype=BF16, channels_last=True), torch.ones(32), torch.zeros(32),
                    torch.zeros(32), torch.ones(32), True, 0.1, 1e-5)
    saved = torch.get_num_threads()
    try:
        figures = []
        for n in (1, 2):
            torch.set_num_threads(n)
            figures.append(check(aten.native_batch_norm.default, args))
    finally:
        torch.set_num_threads(saved)
    assert figures[1] > figures[0]


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_layer_norm_backward(threads, dtype):
    def args():
        x = randn(2, 17, 64, dtype=dtype)
        w, b = torch.ones(64, dtype=dtype), torch.zeros(64, dtype=dtype)
        _, mean, rstd = aten.native_layer_norm.default(x, [64], w, b, 1e-5)
        return torch.randn_like(x), x, [64], mean, rstd, w, b, [True, True, True]

    check(aten.native_layer_norm_backward.default, args)


def test_embedding_backward_of_a_transposed_gradient():
    check(aten.embedding_dense_backward.default,
          lambda: (randn(32, 2, 16).transpose(0, 1), torch.randint(100, (2, 32)), 100, -1, False))


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_safe_softmax(dtype):
    check(aten._safe_softmax.default, lambda: (randn(2, 4, 8, 8, dtype=dtype), -1))


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_flash_attention(threads, dtype):
    """CPU flash attention's per-thread buffers (FlashAttentionKernel.cpp), forward and backward,
    with grouped-query key/value heads."""
    q, k = (2, 4, 40, 16), (2, 2, 40, 16)
    forward = lambda: (randn(*q, dtype=dtype), randn(*k, dtype=dtype), randn(*k, dtype=dtype), 0.0, True)
    check(aten._scaled_dot_product_flash_attention_for_cpu.default, forward)

    def backward():
        query, key, value = forward()[:3]
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu.default(query, key, value, 0.0, True)
        grad_out = randn(2, 40, 4, 16, dtype=dtype).transpose(1, 2)  # as it comes back through a transpose
        return grad_out, query, key, value, out, lse, 0.0, True

    check(aten._scaled_dot_product_flash_attention_for_cpu_backward.default, backward)


def test_upsample_and_dropout():
    check(aten.upsample_nearest2d.default, lambda: (randn(2, 8, 8, 8), [16, 16]))
    check(aten.upsample_bilinear2d.default, lambda: (randn(1, 2, 8, 8), [100, 100], False))
    check(aten.native_dropout.default, lambda: (randn(64, 32), 0.1, True))


# --------------------------------------------------------------------------------------------------
# oneDNN: measured from oneDNN itself, on fake operands as the tracer passes them


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_convolution(dtype):
    weight = lambda: randn(16, 8, 3, 3, dtype=dtype)
    forward = lambda: (randn(2, 8, 12, 12, dtype=dtype), weight(), None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    assert check(aten.convolution.default, forward) > 0
    backward = lambda: (randn(2, 16, 12, 12, dtype=dtype), randn(2, 8, 12, 12, dtype=dtype), weight(), [16],
                        [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [True, True, True])
    check(aten.convolution_backward.default, backward)


def test_bf16_matmul_layouts():
    """oneDNN's matmul scratchpad depends on the operands' layouts, which the probe reproduces."""
    check(aten.mm.default, lambda: (randn(64, 48, dtype=BF16), randn(48, 96, dtype=BF16)))
    check(aten.mm.default, lambda: (randn(48, 64, dtype=BF16).t(), randn(96, 48, dtype=BF16).t()))
    check(aten.addmm.default, lambda: (randn(96, dtype=BF16), randn(64, 48, dtype=BF16), randn(48, 96, dtype=BF16)))
    assert check(aten.mm.default, lambda: (randn(64, 48), randn(48, 96))) == 0  # float32: BLAS, no scratch


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_lstm_layer(dtype):
    """One nn.LSTM layer on oneDNN (mkldnn/RNN.cpp): forward scratch, the workspace it keeps for the
    backward (which the meta kernel leaves empty), and the backward's scratch through the fake path."""
    if dtype == BF16:
        skip_unless_cpu_runs_bf16_lstm()
    seq, batch, inp, hidden = 12, 2, 16, 24

    def forward_args():
        return (randn(seq, batch, inp, dtype=dtype), randn(4 * hidden, inp, dtype=dtype),
                randn(4 * hidden, hidden, dtype=dtype), randn(4 * hidden, dtype=dtype),
                randn(4 * hidden, dtype=dtype), randn(1, batch, hidden, dtype=dtype),
                randn(1, batch, hidden, dtype=dtype), False, [], 2, hidden, 1, True, False, False, True)

    layer = aten.mkldnn_rnn_layer.default
    with torch.enable_grad():
        check(layer, forward_args)
        args = forward_args()
        workspace = layer(*args)[3]
    assert workspace.untyped_storage().nbytes() == rnn_workspace_bytes(args, {}) > 0

    def backward_args():
        with torch.enable_grad():
            a = forward_args()
            out, h, c, ws = layer(*a)
        return (*a[:7], out, h, c, torch.randn_like(out), torch.randn_like(h), torch.randn_like(c), False, 2, hidden,
                1, True, True, False, [], False, ws)

    backward = aten.mkldnn_rnn_layer_backward.default
    measured = measure(lambda a: backward(*a), backward_args).extra
    with FakeTensorMode(allow_non_fake_inputs=True) as mode, torch.enable_grad():
        fake = tree_map(lambda v: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v, forward_args())
        out, h, c, ws = layer(*fake)  # the fake workspace is empty: the rule must get a real one itself
        fake_args = (*fake[:7], out, h, c, torch.randn_like(out), torch.randn_like(h), torch.randn_like(c), False,
                     2, hidden, 1, True, True, False, [], False, ws)
        assert RULE(backward, fake_args, {}, backward(*fake_args)) == measured > 0
