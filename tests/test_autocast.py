"""memplan.autocast: CUDA's autocast op lists on (fake) CPU tensors.

The mechanism is checked against the real thing: with the CPU's own lists, the emulator must run the
same aten ops with the same dtypes as torch.autocast("cpu") does, and give the same loss and gradients.
The CUDA lists are checked against the installed build (its AutocastCUDA registrations and header) and
against hand-written expectations of what CUDA autocast does.
"""

import copy
import re
import weakref
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import checkpoint

import memplan.autocast as ac
from memplan.autocast import AUTOCAST_LISTS, emulated_autocast

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


@pytest.fixture(autouse=True)
def _no_leftover_registration():
    yield
    assert not ac._REGISTRY.holders, "a test left an emulator open"
    assert not ac._REGISTRY.registered and not ac._cast_cache


class Recorder(TorchDispatchMode):
    """(op, output dtypes) of every aten op; `_to_copy` also notes the id of its input."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        dtypes = tuple(t.dtype for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
        self.ops.append((str(func), dtypes, id(args[0]) if args and isinstance(args[0], torch.Tensor) else None))
        return out

    def seq(self):
        return [(name, dtypes) for name, dtypes, _ in self.ops]

    def outputs(self, name):
        return [dtypes for op, dtypes, _ in self.ops if op == name]


# --------------------------------------------------------------------------------------------------
# The lists are the installed torch's


def _native(key):
    return {r.split("::", 1)[1] for r in torch._C._dispatch_get_registrations_for_dispatch_key(key)}


@pytest.mark.parametrize("lists, key", [("cuda", "AutocastCUDA"), ("cpu", "AutocastCPU")])
def test_lists_name_the_ops_the_installed_build_registers(lists, key):
    assert set(AUTOCAST_LISTS[lists].policies()) == _native(key)


def test_cuda_lists_match_the_installed_header_macros():
    header = Path(torch.__file__).parent / "include" / "ATen" / "autocast_mode.h"
    if not header.exists():
        pytest.skip("torch ships no ATen headers here")
    text = header.read_text()

    def macro(name):
        body = re.search(rf"#define {name}\(_\)(.*?)\n\n", text, re.DOTALL).group(1)
        return {a + ("." + b if b else "") for a, b in re.findall(r"_\((\w+)(?:,\s*(\w+))?\)", body)}

    cuda = AUTOCAST_LISTS["cuda"]
    assert cuda.lower_precision == macro("AT_FORALL_LOWER_PRECISION_FP") | {
        "cudnn_convolution",
        "cudnn_convolution_transpose",
    }
    assert cuda.fp32 == macro("AT_FORALL_FP32")
    assert cuda.fp32_set_opt_dtype == macro("AT_FORALL_FP32_SET_OPT_DTYPE")
    assert cuda.promote == macro("AT_FORALL_PROMOTE")
    body = re.search(r"#define AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE\(_\)(.*?)\n\n", text, re.DOTALL).group(1)
    assert {name for name, _ in cuda.fp32_append_dtype} == set(re.findall(r'"(norm\.\w+)"', body))


# --------------------------------------------------------------------------------------------------
# With the CPU's lists, the emulator is torch.autocast("cpu")


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.ln, self.fc2 = nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 10)

    def forward(self, x):
        return self.fc2(F.gelu(self.ln(self.fc1(x))))


class Block(nn.Module):
    """Pre-LN transformer block: SDPA, a hand-written softmax attention, tied embedding/LM head."""

    def __init__(self, d=32, heads=4, vocab=50):
        super().__init__()
        self.heads = heads
        self.emb = nn.Embedding(vocab, d)
        self.ln1, self.ln2, self.ln_f = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        x = self.emb(idx)
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in self.qkv(self.ln1(x)).split(C, 2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        att = F.softmax(q @ k.transpose(-2, -1) / 8.0, dim=-1)
        y = y + att @ v
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        x = x + self.down(F.gelu(self.up(self.ln2(x)), approximate="tanh"))
        return self.head(self.ln_f(x)).flatten(0, 1)


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.bn, self.c2 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.Conv2d(8, 8, 3)
        self.fc = nn.Linear(8, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn(self.c1(x))), 2)
        return self.fc(F.adaptive_avg_pool2d(F.relu(self.c2(x)), 1).flatten(1))


CASES = {
    "mlp": (MLP, lambda: torch.randn(8, 16), lambda: torch.randint(0, 10, (8,))),
    "transformer": (Block, lambda: torch.randint(0, 50, (2, 8)), lambda: torch.randint(0, 50, (16,))),
    "convnet": (ConvNet, lambda: torch.randn(4, 3, 12, 12), lambda: torch.randint(0, 10, (4,))),
}


def _step(model, x, target, autocast):
    with Recorder() as rec:
        with autocast:
            loss = F.cross_entropy(model(x), target)
        loss.backward()
    return rec.seq(), loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("case", list(CASES))
def test_cpu_lists_reproduce_real_cpu_autocast(case):
    build, make_x, make_target = CASES[case]
    torch.manual_seed(0)
    model, x, target = build(), make_x(), make_target()
    twin = copy.deepcopy(model)

    real_ops, real_loss, real_grads = _step(model, x, target, torch.autocast("cpu", dtype=BF16))
    with emulated_autocast("cpu") as emulator:
        ops, loss, grads = _step(twin, x, target, emulator("cpu", BF16))

    assert ops == real_ops  # same aten ops, same order (casts included), same output dtypes
    assert ("aten._to_copy.default", (BF16,)) in ops
    assert torch.equal(loss, real_loss)
    assert grads.keys() == real_grads.keys()
    for name in grads:
        assert torch.equal(grads[name], real_grads[name]), name


def test_plain_cpu_autocast_is_native_while_an_emulator_lives():
    build, make_x, make_target = CASES["transformer"]
    torch.manual_seed(0)
    model, x, target = build(), make_x(), make_target()
    twin = copy.deepcopy(model)
    native = _step(model, x, target, torch.autocast("cpu", dtype=BF16))
    with emulated_autocast("cuda") as emulator:
        with emulator("cpu", BF16):
            pass  # registered, and the last lists this thread used were CUDA's
        assert ac._REGISTRY.registered
        alive = _step(twin, x, target, torch.autocast("cpu", dtype=BF16))
    assert alive[0] == native[0] and torch.equal(alive[1], native[1])


def test_cpu_lists_cache_a_weight_used_twice_like_real_autocast():
    w = nn.Parameter(torch.randn(8, 8))
    x = torch.randn(4, 8)

    def casts_of_w(autocast):
        with Recorder() as rec, autocast:
            F.linear(F.linear(x, w), w)
        return sum(1 for op, _, src in rec.ops if op == "aten._to_copy.default" and src == id(w))

    real = casts_of_w(torch.autocast("cpu", dtype=BF16))
    with emulated_autocast("cpu") as emulator:
        assert casts_of_w(emulator("cpu", BF16)) == real == 1


# --------------------------------------------------------------------------------------------------
# With CUDA's lists


def test_cuda_lists_on_cpu_tensors():
    torch.manual_seed(0)
    lin, ln = nn.Linear(8, 8), nn.LayerNorm(8)
    x, target = torch.randn(4, 8), torch.randint(0, 8, (4,))
    with emulated_autocast("cuda") as emulator, Recorder() as rec:
        with emulator("cpu", BF16):
            h = lin(x)
            normed = ln(h)
            probs = F.softmax(h, dim=-1)
            logp = F.log_softmax(h, dim=-1)
            loss = F.cross_entropy(h, target)
            total = h.sum()
        loss.backward()
    assert h.dtype == BF16
    assert normed.dtype == FP32 and probs.dtype == FP32 and logp.dtype == FP32
    assert total.dtype == FP32  # sum: fp32_set_opt_dtype
    # softmax of a bf16 input: the composite casts it (dtype=fp32 was set), then runs _softmax in fp32
    assert rec.outputs("aten._softmax.default") == [(FP32,)]
    # cross_entropy is not on CUDA's list: it decomposes into log_softmax(x, dtype=x.dtype), which keeps
    # bf16, and nll_loss, which is fp32 and casts the log-probabilities
    assert rec.outputs("aten._log_softmax.default") == [(FP32,), (BF16,)]
    assert rec.outputs("aten.nll_loss_forward.default") == [(FP32, FP32)]
    assert loss.dtype == FP32 and lin.weight.grad.dtype == FP32


def test_cuda_lists_cast_a_parameter_once_per_region_and_free_the_copy_at_exit():
    w = nn.Parameter(torch.randn(8, 8))
    x = torch.randn(4, 8)
    with emulated_autocast("cuda") as emulator:
        for _ in range(2):  # each region casts it once
            with Recorder() as rec, torch.no_grad(), emulator("cpu", FP16):
                y = F.linear(F.linear(x, w), w)
                assert len(ac._cast_cache) == 1
                cast = weakref.ref(ac._cast_cache[id(w)][1])
                assert cast().dtype == FP16
            assert sum(1 for op, _, src in rec.ops if op == "aten._to_copy.default" and src == id(w)) == 1
            assert y.dtype == FP16
            assert not ac._cast_cache and cast() is None  # the cached copy went with the region


def test_cuda_lists_under_fake_tensors_fp16_with_backward():
    with emulated_autocast("cuda") as emulator, FakeTensorMode():
        model = Block()
        idx, target = torch.randint(0, 50, (2, 8)), torch.randint(0, 50, (16,))
        with Recorder() as rec:
            with emulator("cpu", FP16):
                loss = F.cross_entropy(model(idx), target)
            loss.backward()
        assert loss.dtype == FP32
        assert all(p.grad is not None and p.grad.dtype == FP32 for p in model.parameters())
    # the fp16 scores go through _softmax(x, dim, half_to_float=True), CUDA's branch: fp32 out, no
    # fp32 copy of the scores first; its backward returns fp16
    ops = rec.ops
    i = next(i for i, op in enumerate(ops) if op[0] == "aten._softmax.default")
    assert ops[i][1] == (FP32,) and ops[i - 1][0] != "aten._to_copy.default"
    assert rec.outputs("aten._softmax_backward_data.default") == [(FP16,)]
    assert rec.outputs("aten.native_layer_norm.default") == [(FP32, FP32, FP32)] * 3
    # the tied embedding/LM-head weight is cast to fp16 once, for the head (the embedding is not listed)
    assert sum(1 for op, dt, _ in ops if op == "aten._to_copy.default" and dt == (FP16,)) >= 1


def test_cuda_lists_promote_banned_and_append_dtype():
    a, b = torch.randn(4), torch.randn(4).to(BF16)
    with emulated_autocast("cuda") as emulator, emulator("cpu", BF16):
        assert torch.dot(a, b).dtype == FP32  # promote: the widest input
        assert torch.dot(b, b).dtype == BF16
        assert torch.ops.aten.norm.Scalar(b).dtype == FP32  # fp32_append_dtype
        assert b.norm().dtype == FP32
        with pytest.raises(RuntimeError, match="unsafe to autocast"):
            F.binary_cross_entropy(torch.rand(4), torch.rand(4))
    with emulated_autocast("cpu") as emulator, emulator("cpu", BF16), pytest.raises(RuntimeError):
        torch.dot(a, b)  # not listed on the CPU: mismatched dtypes


def test_cpu_only_policies_are_off_under_cuda_lists():
    x = torch.randn(1, 2, 5).to(BF16)
    a, b = torch.randn(3), torch.randn(3).to(BF16)
    with torch.autocast("cpu", dtype=BF16):
        assert F.pad(x, (1, 1), mode="reflect").dtype == FP32  # reflection_pad1d: fp32 on the CPU's list
    with emulated_autocast("cuda") as emulator, emulator("cpu", BF16):
        assert F.pad(x, (1, 1), mode="reflect").dtype == BF16  # not on CUDA's
        with Recorder() as rec:
            assert torch.stack([a, b]).dtype == FP32  # plain type promotion, not the CPU's promote cast
        assert "aten._to_copy.default" not in [op for op, _, _ in rec.ops]


def test_disabling_inside_a_region_is_respected():
    w, x = nn.Parameter(torch.randn(8, 8)), torch.randn(4, 8)
    with emulated_autocast("cuda") as emulator, emulator("cpu", BF16):
        assert F.linear(x, w).dtype == BF16
        with torch.autocast("cpu", enabled=False):
            assert F.linear(x, w).dtype == FP32
        assert F.linear(x, w).dtype == BF16
        assert ac._cast_cache  # the inner region's exit did not clear the outer region's cache


def test_checkpoint_recomputation_uses_the_emulated_lists():
    torch.manual_seed(0)
    ln, lin = nn.LayerNorm(8), nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)

    def block(t):
        return F.softmax(lin(ln(t)), dim=-1)

    grads = []
    with emulated_autocast("cuda") as emulator:
        for use_checkpoint in (False, True):
            with Recorder() as rec:
                with emulator("cpu", BF16):
                    y = checkpoint(block, x, use_reentrant=False) if use_checkpoint else block(x)
                # recomputing under the CPU's lists would give bf16 layer_norm/softmax outputs, and
                # checkpoint would refuse them
                y.square().sum().backward()
            grads.append((x.grad.clone(), lin.weight.grad.clone(), ln.weight.grad.clone()))
            x.grad = lin.weight.grad = ln.weight.grad = lin.bias.grad = ln.bias.grad = None
            assert rec.outputs("aten.native_layer_norm.default") == [(FP32, FP32, FP32)] * (1 + use_checkpoint)
            assert not ac._cast_cache  # the recomputation's region cleared its casts
    for plain, ckpt in zip(*grads):
        assert torch.equal(plain, ckpt)


def test_closing_restores_native_cpu_autocast():
    clear = torch.clear_autocast_cache
    x, ln = torch.randn(4, 8), nn.LayerNorm(8)
    with emulated_autocast("cuda") as emulator, emulator("cpu", BF16):
        assert ln(x.to(BF16)).dtype == FP32
    assert torch.clear_autocast_cache is clear
    with torch.autocast("cpu", dtype=BF16):
        assert ln(x.to(BF16)).dtype == BF16  # layer_norm is not on the CPU's list
        assert F.cross_entropy(torch.randn(4, 8), torch.randint(0, 8, (4,))).dtype == FP32


def test_rejects_unknown_lists_and_devices():
    with pytest.raises(ValueError, match="unknown autocast lists"):
        emulated_autocast("tpu")
    with pytest.raises(ValueError, match="CPU tensors"):
        emulated_autocast("cuda")("cuda", FP16)


# --------------------------------------------------------------------------------------------------
# In the tracer


@pytest.mark.parametrize("precision", ["amp-bf16", "amp-fp16"])
def test_trace_with_cuda_lists(precision):
    from memplan.step import StepConfig
    from memplan.trace import TraceRules, trace_step
    from memplan.workload import resolve_workload
    from models import TINY_OVERRIDES

    workload = resolve_workload("gpt2", 2, TINY_OVERRIDES["gpt2"])
    config = StepConfig(precision=precision, steps=1)
    emulated = trace_step(workload, config, TraceRules(autocast=emulated_autocast("cuda")))
    native = trace_step(workload, config, TraceRules())
    assert not ac._REGISTRY.holders  # the trace's emulator went with it

    def loss_ops(trace):  # (op, bytes it allocates) from the LM head's matmul to nll_loss
        ops = [op for op in trace.ops if op.phase == "forward"]
        last_mm = max(i for i, op in enumerate(ops) if op.name == "aten.mm.default")
        return [
            (op.name.removeprefix("aten.").removesuffix(".default"), [trace.storages[s].nbytes for s in op.allocates])
            for op in ops[last_mm:]
            if op.name not in ("aten.view.default", "aten._unsafe_view.default")
        ]

    n = 2 * 32 * 512  # tokens x vocabulary
    low = 2  # bytes of fp16/bf16
    # CUDA: cross_entropy is not listed; it decomposes into log_softmax(logits, dtype=logits.dtype)
    # (low precision, saved) and nll_loss (fp32 list: a saved fp32 copy of the log-probabilities)
    assert loss_ops(emulated) == [
        ("mm", [n * low]),
        ("_log_softmax", [n * low]),
        ("_to_copy", [n * 4]),
        ("nll_loss_forward", [4, 4]),
    ]
    # the CPU lists cross_entropy_loss as fp32: the logits are cast first, log_softmax runs in fp32
    assert loss_ops(native) == [
        ("mm", [n * low]),
        ("_to_copy", [n * 4]),
        ("_log_softmax", [n * 4]),
        ("nll_loss_forward", [4, 4]),
    ]
