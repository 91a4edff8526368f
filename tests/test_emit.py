"""apply_plan and emit_module: checkpointed models give exactly the original gradients, mismatched
plans are refused, and the emitted module runs with nothing but PyTorch."""

from __future__ import annotations

import copy
import importlib.util
import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from typer.testing import CliRunner

from cli.main import app
from memplan.emit import apply_plan, emit_module, is_checkpointed
from memplan.errors import BadInput
from memplan.plan import Plan, Segment, save_plan
from memplan.step import loss_of


def make_plan(*segments: Segment | tuple[str, ...], **fields) -> Plan:
    defaults = {
        "model": "toy",
        "batch_size": 4,
        "precision": "fp32",
        "optimizer": "sgd",
        "grad_accum": 1,
        "device": "cpu",
        "method": "manual",
        "feasible": True,
        "budget_bytes": None,
        "predicted_peak_bytes": 0,
        "unplanned_peak_bytes": 0,
        "recompute_flops": 0,
        "step_flops": 1,
    }
    segments = tuple(s if isinstance(s, Segment) else Segment(tuple(s)) for s in segments)
    return Plan(**{**defaults, **fields, "segments": segments})


# --------------------------------------------------------------------------------------------------
# A toy model with every kind of segment: blocks an nn.ModuleList is looped over with extra
# positional and keyword arguments, an nn.Sequential head, a module with a tuple output, and dropout
# everywhere so that a wrong RNG state on recompute would change the gradients.


class FeedForward(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        self.drop = nn.Dropout(0.3)
        self.calls = 0  # counts executions, so a test can see the recomputation happen

    def forward(self, x):
        self.calls += 1
        return self.drop(self.down(torch.nn.functional.gelu(self.up(x))))


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.ff = FeedForward(width)

    def forward(self, x, scale, *, shift=None):
        return x + scale * self.ff(self.norm(x)) + shift


class Pair(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.proj = nn.Linear(width, width)

    def forward(self, x):
        y = self.proj(x)
        return y.tanh(), y.sigmoid()


class Toy(nn.Module):
    def __init__(self, width: int = 16, depth: int = 3):
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.pair = Pair(width)
        self.head = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Dropout(0.2), nn.Linear(width, 4))

    def forward(self, x, scale):
        x = self.embed(x)
        shift = torch.ones_like(x[0])
        for block in self.blocks:
            x = block(x, scale, shift=shift)
        a, b = self.pair(x)
        return self.head(a * b)


def toy_and_inputs(seed: int = 0) -> tuple[nn.Module, tuple]:
    torch.manual_seed(seed)
    return Toy(), (torch.randn(4, 8), torch.tensor(0.5, requires_grad=True))


def step_grads(model: nn.Module, inputs: tuple | dict, seed: int = 1) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Forward and backward once from a fixed RNG state: the loss and every parameter's gradient."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    output = model(**inputs) if isinstance(inputs, dict) else model(*inputs)
    loss = loss_of(output)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def assert_same_step(original: nn.Module, checkpointed: nn.Module, inputs: tuple | dict) -> None:
    for seed in (1, 2):  # twice: a run's bookkeeping must reset between steps
        loss, grads = step_grads(original, inputs, seed)
        ckpt_loss, ckpt_grads = step_grads(checkpointed, inputs, seed)
        assert torch.equal(loss, ckpt_loss)
        assert grads.keys() == ckpt_grads.keys()
        for name in grads:
            # Recomputation repeats the same ops on the same values with the same RNG state, so
            # the gradients are bit-identical, not merely close.
            assert torch.equal(grads[name], ckpt_grads[name]), name


TOY_PLANS = {
    "single": [("blocks.1",)],
    "single-deep": [("blocks.2.ff",)],
    "tuple-output": [("pair",)],
    "modulelist-run": [("blocks.0", "blocks.1", "blocks.2")],
    "modulelist-partial-run": [("blocks.1", "blocks.2")],
    "sequential-run": [("head.0", "head.1", "head.2")],
    "run-in-plain-module": [("blocks.1.norm", "blocks.1.ff")],  # Block chains them: ff(norm(x))
    "nested-in-run": [("blocks.0", "blocks.1"), ("blocks.1.ff",)],
    "run-in-root": [("",), ("blocks.1", "blocks.2")],
    "run-in-sequential-segment": [("head",), ("head.1", "head.2", "head.3")],
    "selective": [Segment(("blocks.1",), policy="selective", saved_ops=("aten.addmm.default",))],
    "selective-run-nested": [
        Segment(("blocks.0", "blocks.1"), policy="selective", saved_ops=("aten.mm.default",)),
        ("blocks.1.ff",),
    ],
    "selective-calls": [
        Segment(("blocks.0",), policy="selective", saved_ops=("aten.addmm.default#1", "aten.native_dropout.default#0")),
        Segment(("blocks.1", "blocks.2"), policy="selective", saved_ops=("aten.addmm.default#2", "aten.gelu.default")),
    ],
}


@pytest.mark.parametrize("segments", TOY_PLANS.values(), ids=TOY_PLANS.keys())
def test_toy_gradients_equal(segments):
    original, inputs = toy_and_inputs()
    checkpointed = apply_plan(copy.deepcopy(original), make_plan(*segments))
    assert_same_step(original, checkpointed, inputs)


def test_segments_are_recomputed():
    original, inputs = toy_and_inputs()
    model = apply_plan(copy.deepcopy(original), make_plan(("blocks.0", "blocks.1"), ("blocks.2.ff",)))
    step_grads(model, inputs)
    # Each FeedForward inside a segment ran twice: once in forward, once recomputed in backward.
    assert [block.ff.calls for block in model.blocks] == [2, 2, 2]
    step_grads(original, inputs)
    assert [block.ff.calls for block in original.blocks] == [1, 1, 1]


class RecordOps(TorchDispatchMode):
    """The aten ops run while it is active, with their output shapes."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.append((str(func), tuple(out.shape) if isinstance(out, torch.Tensor) else ()))
        return out


def recomputed_in_backward(segment: Segment) -> list[tuple[str, tuple[int, ...]]]:
    """The ops a backward runs with `segment` of the toy checkpointed. Backward itself runs no
    addmm or gelu (a Linear's backward is mm): those seen are the segment's recomputation."""
    model, inputs = toy_and_inputs()
    apply_plan(model, make_plan(segment))
    loss = model(*inputs).sum()
    with RecordOps() as recorder:
        loss.backward()
    return [(op, shape) for op, shape in recorder.ops if op in ("aten.addmm.default", "aten.gelu.default")]


def test_selective_segment_keeps_saved_ops():
    recomputed = {
        saved_ops: [op for op, _ in recomputed_in_backward(Segment(("blocks.1.ff",), "selective", saved_ops))]
        for saved_ops in ((), ("aten.addmm.default",), ("aten.gelu.default",))
    }
    assert recomputed == {
        (): ["aten.addmm.default", "aten.gelu.default", "aten.addmm.default"],
        ("aten.addmm.default",): ["aten.gelu.default"],
        ("aten.gelu.default",): ["aten.addmm.default", "aten.addmm.default"],
    }
    full = recomputed_in_backward(Segment(("blocks.1.ff",)))
    assert [op for op, _ in full] == recomputed[()]


def test_selective_segment_keeps_the_named_calls():
    # blocks.0 and blocks.1 as one run: four addmm calls per forward, up (2 x width wide) and down
    # (width) in each block. "#n" counts the calls of one forward of the segment, from 0.
    def recomputed_widths(*saved_ops):
        segment = Segment(("blocks.0", "blocks.1"), "selective", saved_ops)
        return [shape[-1] for op, shape in recomputed_in_backward(segment) if op == "aten.addmm.default"]

    width = Toy().embed.out_features
    assert recomputed_widths() == [2 * width, width, 2 * width, width]
    assert recomputed_widths("aten.addmm.default#0", "aten.addmm.default#2") == [width, width]
    assert recomputed_widths("aten.addmm.default#1", "aten.addmm.default#3") == [2 * width, 2 * width]
    assert recomputed_widths("aten.addmm.default#3", "aten.gelu.default") == [2 * width, width, 2 * width]
    assert recomputed_widths("aten.addmm.default#9") == [2 * width, width, 2 * width, width]  # no such call


def test_names_and_state_dict_unchanged():
    original, _ = toy_and_inputs()
    model = apply_plan(copy.deepcopy(original), make_plan(("blocks.0", "blocks.1"), ("head",), ("pair",)))
    assert [name for name, _ in model.named_modules()] == [name for name, _ in original.named_modules()]
    assert model.state_dict().keys() == original.state_dict().keys()
    assert is_checkpointed(model.blocks[1]) and not is_checkpointed(model.blocks[2])


def test_deepcopy_of_checkpointed_model_is_independent():
    original, inputs = toy_and_inputs()
    model = apply_plan(copy.deepcopy(original), make_plan(("blocks.0", "blocks.1"), ("pair",)))
    clone = copy.deepcopy(model)
    step_grads(clone, inputs)
    assert all(p.grad is None for p in model.parameters())  # the copy's wrappers use its own modules
    assert_same_step(original, clone, inputs)


def test_eval_and_no_grad():
    original, inputs = toy_and_inputs()
    model = apply_plan(copy.deepcopy(original), make_plan(("blocks.0", "blocks.1", "blocks.2")))
    original.eval(), model.eval()
    with torch.no_grad():
        assert torch.equal(original(*inputs), model(*inputs))


def test_fake_tensor_mode_forward_backward():
    from torch._subclasses.fake_tensor import FakeTensorMode

    plan = make_plan(("blocks.0", "blocks.1"), ("blocks.1.ff",), ("pair",), ("head",))
    with FakeTensorMode():
        model, inputs = toy_and_inputs()
        apply_plan(model, plan)
        loss = model(*inputs).float().mean()
        loss.backward()
        assert all(p.grad is not None and p.grad.shape == p.shape for p in model.parameters())


# --------------------------------------------------------------------------------------------------
# Plans that do not match the model


@pytest.mark.parametrize(
    "segments, message",
    [
        ([("blocks.7",)], "no module 'blocks.7'"),
        ([("nothing.here",)], "no module 'nothing.here'"),
        ([("blocks",)], "ModuleList"),
        ([("blocks.2", "pair")], "not siblings"),
        ([("", "embed")], "not siblings"),
        ([("blocks.0", "blocks.0")], "appears twice"),
        ([("blocks.0", "blocks.1"), ("blocks.1",)], "in two segments"),
        ([Segment(("pair",), policy="sometimes")], "unknown policy"),
        ([Segment(("pair",), policy="selective", saved_ops=("aten.mm",))], "not an op name"),
        ([Segment(("pair",), policy="selective", saved_ops=("aten.no_such_op.default",))], "not an op"),
        ([Segment(("pair",), policy="selective", saved_ops=("aten.mm.default#x",))], "must be a number"),
        ([Segment(("pair",), policy="selective", saved_ops=("aten.mm.default#-1",))], "must be a number"),
        ([Segment(("pair",), policy="selective", saved_ops=("#2",))], "not an op name"),
        ([()], "no modules"),
    ],
)
def test_mismatched_plan_is_refused_and_model_untouched(segments, message):
    model, _ = toy_and_inputs()
    with pytest.raises(BadInput, match=message):
        apply_plan(model, make_plan(("head",), *segments))
    assert not any(is_checkpointed(m) for m in model.modules())


def test_applying_twice_is_refused():
    model, _ = toy_and_inputs()
    plan = make_plan(("blocks.0", "blocks.1"))
    apply_plan(model, plan)
    with pytest.raises(BadInput, match="already checkpointed"):
        apply_plan(model, plan)


@pytest.mark.parametrize("run", [("blocks.0", "blocks.2"), ("blocks.1", "blocks.0"), ("embed", "pair")])
def test_run_its_parent_does_not_call_in_that_order_fails_loudly(run):
    """A run is listed in the order its parent calls it, which only the forward shows (registration order
    says nothing: BART registers `activation_fn` before `fc1`): a run the parent does not chain in that
    order stops at its first forward, before any gradient is wrong."""
    model, inputs = toy_and_inputs()
    apply_plan(model, make_plan(run))
    with pytest.raises(RuntimeError, match="#1 of a checkpointed run of 2 modules was not called with the previous"):
        model(*inputs)


def test_run_whose_parent_transforms_between_blocks_fails_loudly():
    class Pooled(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

        def forward(self, x):
            for block in self.blocks:
                x = block(x.relu())  # the next block's input is not the previous one's output
            return x

    model = apply_plan(Pooled(), make_plan(("blocks.0", "blocks.1")))
    with pytest.raises(RuntimeError, match="#1 of a checkpointed run of 2"):
        model(torch.randn(2, 4))


class _UsesIntermediate(nn.Module):
    """Chains a into b, and also uses a's output itself: its shape, and as a skip connection."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.3))

    def forward(self, x):
        h = self.a(x)
        return (self.b(h) + h).sum(-1) * h.shape[-1]


def test_each_member_of_a_run_returns_its_own_output():
    torch.manual_seed(0)
    original = _UsesIntermediate()
    checkpointed = apply_plan(copy.deepcopy(original), make_plan(("a", "b")))
    assert_same_step(original, checkpointed, (torch.randn(4, 8),))


# --------------------------------------------------------------------------------------------------
# The model zoo at tiny size


ZOO_PLANS = {
    "gpt2": [("h.0", "h.1"), ("h.0.mlp",), ("h.1.attn",)],
    "bert-base": [("",), ("layers.0", "layers.1"), ("layers.1.ffn_in",)],
    "llama2-7b": [("layers.0", "layers.1"), ("layers.1.feed_forward",)],
    "llama3-8b": [("layers.1",), ("layers.0.attention",)],
    "resnet18": [("conv1", "bn1", "relu", "maxpool"), ("stages.1", "stages.2"), ("stages.1.0",),
                 ("stages.3.0", "stages.3.1")],
    "vit-b16": [("layers.0",), ("layers.1.mlp.0", "layers.1.mlp.1")],
    "mlp": [("0", "1", "2"), ("3", "4")],
    "unet": [("stem.0", "stem.1", "stem.2"), ("downs.0",), ("ups.0",), ("ups.0.conv",)],
    "lstm": [("lstm",), ("head",)],
}


@pytest.mark.parametrize("name", ZOO_PLANS)
def test_zoo_gradients_equal(name):
    models = pytest.importorskip("models")
    entry = models.ZOO[name]
    torch.manual_seed(0)
    original, inputs = entry.build(2, **models.TINY_OVERRIDES[name])
    checkpointed = apply_plan(copy.deepcopy(original), make_plan(*ZOO_PLANS[name], model=name))
    # BatchNorm (resnet, unet) updates its running statistics again when recomputed; the
    # gradients use the batch's statistics, so they are still exact.
    assert_same_step(original, checkpointed, inputs)


def test_selective_segment_with_buffers_keeps_its_calls_in_step():
    """Recomputing puts BatchNorm's running statistics back with clone and copy_; those ops must not
    shift the segment's call numbering, or its kept `clone` calls come back in the wrong order."""

    class NormThenCopy(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.BatchNorm1d(8)

        def forward(self, x):
            return torch.tanh(self.norm(x).clone() * 2).clone()

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp, self.block, self.out = nn.Linear(8, 8), NormThenCopy(), nn.Linear(8, 1)

        def forward(self, x):
            return self.out(self.block(self.inp(x))).sum()

    torch.manual_seed(0)
    original, x = Net(), torch.randn(4, 8)
    for saved_ops in (("aten.clone.default#0",), ("aten.clone.default#1",), ("aten.clone.default",)):
        plan = make_plan(Segment(("block",), "selective", saved_ops), model="net")
        checkpointed = apply_plan(copy.deepcopy(original), plan)
        assert_same_step(copy.deepcopy(original), checkpointed, (x,))


# --------------------------------------------------------------------------------------------------
# The emitted module


MIXED_PLAN = make_plan(
    ("blocks.0", "blocks.1"),
    ("blocks.1.ff",),
    Segment(("pair",), policy="selective", saved_ops=("aten.addmm.default", "aten.tanh.default")),
    Segment(("blocks.2",), policy="selective", saved_ops=("aten.addmm.default#1", "aten.native_layer_norm.default#0")),
    ("head.1", "head.2", "head.3"),
    model="toy",
    budget_bytes=3 * 2**30,
    predicted_peak_bytes=int(2.5 * 2**30),
    unplanned_peak_bytes=5 * 2**30,
    recompute_flops=1,
    step_flops=8,
)


def load_emitted(source: str, tmp_path: Path):
    """Import emitted source as a module of its own (this interpreter; see below for a fresh one)."""
    path = tmp_path / "ckpt_plan.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("ckpt_plan", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_emitted_header():
    source = emit_module(MIXED_PLAN)
    header = source.split('"""')[0]
    assert "model: toy, batch 4, fp32, optimizer sgd" in header
    assert "budget: 3.00 GiB; predicted peak: 2.50 GiB" in header
    assert "recompute overhead: 12.5%" in header
    assert "does NOT fit" in emit_module(make_plan(feasible=False))


def test_emitted_code_compiles_and_matches_apply_plan(tmp_path):
    source = emit_module(MIXED_PLAN)
    assert "memplan" not in source.split('"""', 2)[2].replace("planned by memplan", "")
    assert max(len(line) for line in source.splitlines()) <= 100
    module = load_emitted(source, tmp_path)
    original, inputs = toy_and_inputs()
    by_library = apply_plan(copy.deepcopy(original), MIXED_PLAN)
    by_emitted = module.apply_checkpointing(copy.deepcopy(original))
    # The emitted module has its own copy of the wrappers, hence its own is_checkpointed.
    assert [module.is_checkpointed(m) for m in by_emitted.modules()] == [
        is_checkpointed(m) for m in by_library.modules()
    ]
    assert_same_step(original, by_library, inputs)
    assert_same_step(original, by_emitted, inputs)


def test_emitted_code_for_long_runs_and_empty_plans_compiles(tmp_path):
    long_run = make_plan(tuple(f"a_rather_long_module_name.blocks.{i}" for i in range(40)))
    for plan in (long_run, make_plan()):
        compile(emit_module(plan), "ckpt_plan.py", "exec")


@pytest.mark.parametrize(
    "plan", [MIXED_PLAN, make_plan(tuple(f"layers.{i}" for i in range(40)))], ids=["mixed", "long"]
)
def test_emitted_code_is_lint_clean_and_formatted(plan, tmp_path):
    ruff = shutil.which("ruff") or shutil.which("ruff", path=str(Path(sys.executable).parent))
    if ruff is None:
        pytest.skip("ruff is not installed (pip install ruff) -- emitted code not linted")
    path = tmp_path / "ckpt_plan.py"
    path.write_text(emit_module(plan))
    # --isolated: default rules, whatever configuration the surrounding project has
    common = ["--isolated", "--line-length", "100"]
    check = subprocess.run(
        [ruff, "check", *common, "--extend-select", "E501,W", str(path)], check=False, capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr
    fmt = subprocess.run([ruff, "format", *common, "--diff", str(path)], check=False, capture_output=True, text=True)
    assert fmt.returncode == 0, fmt.stdout + fmt.stderr


def test_emitted_module_runs_without_memplan(tmp_path):
    torch_site = str(Path(torch.__file__).parents[1])
    plan = make_plan(
        ("blocks.0", "blocks.1"), ("blocks.1.1",), Segment(("blocks.2",), "selective", ("aten.addmm.default#0",))
    )
    (tmp_path / "ckpt_plan.py").write_text(emit_module(plan))
    script = textwrap.dedent(
        f"""
        import sys
        sys.path[:0] = [{str(tmp_path)!r}, {torch_site!r}]
        try:
            import memplan
        except ImportError:
            pass
        else:
            raise SystemExit("memplan is importable here: " + memplan.__file__)

        import torch
        from torch import nn
        from ckpt_plan import apply_checkpointing

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.blocks = nn.ModuleList(
                    nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Tanh()) for _ in range(3)
                )

            def forward(self, x):
                for block in self.blocks:
                    x = block(x)
                return x.sum()

        torch.manual_seed(0)
        model = apply_checkpointing(Net())
        model(torch.randn(4, 8)).backward()
        assert all(p.grad is not None for p in model.parameters())
        print("ok")
        """
    )
    # -I keeps the working directory and PYTHONPATH off sys.path; -S skips site-packages' .pth files,
    # through which an editable install of memplan would be found. Only torch's directory is added.
    result = subprocess.run(
        [sys.executable, "-I", "-S", "-c", script], check=False, capture_output=True, text=True, cwd=tmp_path
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "ok"


# --------------------------------------------------------------------------------------------------
# memplan emit


def test_cli_emit_writes_and_refuses_to_overwrite(tmp_path):
    runner = CliRunner()
    plan_path, out = tmp_path / "plan.json", tmp_path / "ckpt_plan.py"
    save_plan(MIXED_PLAN, plan_path)
    result = runner.invoke(app, ["emit", str(plan_path), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert out.read_text() == emit_module(MIXED_PLAN)

    out.write_text("# mine\n")
    result = runner.invoke(app, ["emit", str(plan_path), "-o", str(out)])
    assert result.exit_code == 1
    assert "exists" in result.output and "--force" in result.output
    assert out.read_text() == "# mine\n"

    result = runner.invoke(app, ["emit", str(plan_path), "-o", str(out), "--force"])
    assert result.exit_code == 0, result.output
    assert out.read_text() == emit_module(MIXED_PLAN)


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "plan file not found"),
        ("{not json", "cannot read plan"),
        (json.dumps({"format": 99}), "not a memplan plan"),
        (json.dumps({**MIXED_PLAN.to_json(), "segments": [{"modules": ["x"], "policy": "odd"}]}), "unknown policy"),
    ],
)
def test_cli_emit_bad_plan_is_one_line(tmp_path, content, message):
    plan_path = tmp_path / "plan.json"
    if content is not None:
        plan_path.write_text(content)
    result = CliRunner().invoke(app, ["emit", str(plan_path), "-o", str(tmp_path / "out.py")])
    assert result.exit_code == 1
    assert message in result.output
    assert len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "out.py").exists()
