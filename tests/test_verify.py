"""memplan verify: the measurement is the allocator's own ground truth (never our estimator).

On the CPU the profiler reports every allocation and free of the CPU allocator, with its exact size;
the tests pin that down against byte counts derived by hand from what eager PyTorch allocates. CUDA
tests run only where a GPU is present.
"""

from __future__ import annotations

import importlib.util
import json
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from cli.main import app
from memplan.errors import BadInput
from memplan.estimate import estimate
from memplan.plan import Plan, Segment, save_plan
from memplan.step import StepConfig
from memplan.verify import (
    Measurement,
    Prediction,
    check_supported,
    compare,
    error_pct,
    measure,
    predict,
    resolve_device,
)
from memplan.workload import Workload

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
no_cuda = pytest.mark.skipif(CUDA, reason="checks the behaviour without a GPU")
HAS_ESTIMATOR = importlib.util.find_spec("memplan.estimate") is not None
runner = CliRunner()


# --------------------------------------------------------------------------------------------------
# helpers


def workload(name: str, build, batch_size: int | None = None) -> Workload:
    return Workload(name, build, batch_size, {})


def linear_workload(batch_size: int = 64) -> Workload:
    def build(batch_size: int = batch_size):
        return nn.Linear(1024, 1024), (torch.randn(batch_size, 1024),)

    return workload("linear", build, batch_size)


def blocks_workload(spec: str = "blocks") -> Workload:
    """Four blocks whose activations (1024 x 64 fp32, 256 KiB each) outweigh their weights (16 KiB)."""

    def build(batch_size: int = 1024):
        blocks = [nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU()) for _ in range(4)]
        return nn.Sequential(*blocks), (torch.randn(batch_size, 64),)

    return workload(spec, build, 1024)


def make_plan(model: str, *paths: str, method: str = "manual") -> Plan:
    return Plan(
        model=model,
        batch_size=1024,
        precision="fp32",
        optimizer="sgd",
        grad_accum=1,
        device="cpu",
        method=method,
        segments=tuple(Segment((p,)) for p in paths),
        feasible=True,
        budget_bytes=None,
        predicted_peak_bytes=0,
        unplanned_peak_bytes=0,
        recompute_flops=0,
        step_flops=0,
    )


TOY_FILE = textwrap.dedent(
    """
    import torch
    from torch import nn

    def build(batch_size: int = 8):
        return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8)), (torch.randn(batch_size, 32),)

    class Hungry(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(8, 8)

        def forward(self, x):
            torch.empty(1 << 50, dtype=torch.uint8, device=x.device)  # 1 PiB: the allocator refuses
            return self.linear(x)

    def hungry(batch_size: int = 4):
        return Hungry(), (torch.randn(batch_size, 8),)

    class SparseGraph(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(8, 8)

        def forward(self, x, adjacency):
            # a compressed (CSR) adjacency: the tracer models sparse COO tensors only
            return torch.sparse.mm(adjacency, self.linear(x)).sum()

    def sparse(batch_size: int = 4):
        return SparseGraph(), (torch.randn(batch_size, 8), torch.eye(batch_size).to_sparse_csr())
    """
)


@pytest.fixture()
def toy(tmp_path: Path) -> Path:
    path = tmp_path / "toy.py"
    path.write_text(TOY_FILE)
    return path


# --------------------------------------------------------------------------------------------------
# CPU ground truth against hand-derived byte counts


F32 = 4
WEIGHT = 1024 * 1024 * F32  # 4_194_304: nn.Linear(1024, 1024).weight
BIAS = 1024 * F32  # 4_096
INPUT = 64 * 1024 * F32  # 262_144: a batch of 64
OUTPUT = 64 * 1024 * F32  # 262_144: addmm's output
LIVE_AT_START = WEIGHT + BIAS + INPUT  # 4_460_544: nothing else exists when measuring starts
SCALAR = 4  # a 0-dim fp32 tensor
WRAPPED = 8 + 4  # a Python number in a tensor op: a 0-dim float64 tensor, then its cast to fp32


def forward_extra() -> int:
    """Forward: addmm allocates the output; out.float() is a no-op on fp32; mean allocates its 0-dim
    result, then divides it in place by numel, a wrapped Python number (8 + 4 bytes, freed at once).
    With T > 1 intra-op threads, the sum inside mean first allocates one fp32 partial sum per thread
    (4*T bytes, freed before the division): the larger of the two temporaries sets the peak."""
    threads = torch.get_num_threads()
    partial_sums = 4 * threads if threads > 1 else 0
    return OUTPUT + SCALAR + max(WRAPPED, partial_sums)


# Backward (the output and the loss stay live until backward returns: run_steps deletes them after):
#   ones_like(loss), the loss's gradient                                         SCALAR
#   MeanBackward0: grad.expand(shape) / numel allocates a full-size gradient      OUTPUT
#     (its wrapped divisor, 8 + 4 bytes, is freed before the gradient below)
#   AddmmBackward0: grad_W = grad_out^T @ x                                        WEIGHT
#                   grad_b = grad_out.sum(0)                                       BIAS
#     (no grad for x: the input does not require one)
#   the peak is at grad_b: the loss, its grad, the output, grad_out, grad_W and grad_b all live.
BACKWARD_EXTRA = OUTPUT + SCALAR + SCALAR + OUTPUT + WEIGHT + BIAS  # 4_722_696
GRADS = WEIGHT + BIAS


def test_linear_sgd_peak_is_the_hand_count() -> None:
    m = measure(linear_workload(), StepConfig(optimizer="sgd", steps=2), "cpu")
    assert m.baseline_bytes == LIVE_AT_START == 4_460_544
    # SGD without momentum: p.add_(grad, alpha=-lr) in place, no state, no temporaries; its phase
    # peak is what is live as it begins (the grads), and zero_grad(set_to_none) frees them.
    assert m.phase_peaks == {
        "forward": LIVE_AT_START + forward_extra(),
        "backward": LIVE_AT_START + BACKWARD_EXTRA,
        "optimizer": LIVE_AT_START + GRADS,
    }
    assert m.measured_peak_bytes == LIVE_AT_START + BACKWARD_EXTRA == 9_183_240
    assert m.step_peaks == (9_183_240, 9_183_240)
    assert m.first_step_peak_bytes == m.later_steps_peak_bytes == 9_183_240
    assert m.measured_reserved_bytes is None and m.cuda_context_bytes is None
    assert m.fits and not m.oom


def test_linear_adamw_peak_is_the_hand_count() -> None:
    m = measure(linear_workload(), StepConfig(optimizer="adamw", steps=2), "cpu")
    # AdamW on CPU tensors runs the for-loop implementation (foreach defaults to off off-GPU).
    # Its first step creates, for each parameter, `step` (a 0-dim fp32 tensor) and exp_avg and
    # exp_avg_sq (zeros_like): the state.
    state = 2 * SCALAR + 2 * (WEIGHT + BIAS)  # 8_396_808
    # Per parameter, weight decay (param.mul_), exp_avg.lerp_ and exp_avg_sq.mul_().addcmul_() work in
    # place (each wrapped Python number, 8 + 4 bytes, freed at once); then
    #   denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    # allocates sqrt's result, then the division's (after its wrapped divisor, 8 + 4 bytes) before
    # sqrt's is freed; param.addcdiv_ is in place. The peak is at the weight's division.
    optimizer_peak = LIVE_AT_START + GRADS + state + WEIGHT + WRAPPED + WEIGHT
    assert m.measured_peak_bytes == optimizer_peak == 25_444_372
    # the first step's forward and backward come before the state exists; later steps carry it
    assert m.phase_peaks == {
        "forward": LIVE_AT_START + state + forward_extra(),
        "backward": LIVE_AT_START + state + BACKWARD_EXTRA,  # 17_580_048
        "optimizer": optimizer_peak,
    }
    assert m.step_peaks == (optimizer_peak, optimizer_peak)


def test_repeated_cpu_runs_give_identical_measurements() -> None:
    def build(batch_size: int = 16):
        model = nn.Sequential(nn.Linear(64, 256), nn.LayerNorm(256), nn.GELU(), nn.Dropout(0.1), nn.Linear(256, 10))
        return model, (torch.randn(batch_size, 64),)

    w = workload("mixed", build, 16)
    config = StepConfig(optimizer="adamw", steps=2)
    runs = [measure(w, config, "cpu") for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]
    assert runs[0].measured_peak_bytes == max(runs[0].phase_peaks.values())


def test_repeated_runs_identical_on_a_zoo_model() -> None:
    pytest.importorskip("models")
    from memplan.workload import resolve_workload
    from models import TINY_OVERRIDES

    w = resolve_workload("gpt2", 2, TINY_OVERRIDES["gpt2"])
    config = StepConfig(optimizer="adamw", steps=2)
    assert measure(w, config, "cpu") == measure(w, config, "cpu")


# --------------------------------------------------------------------------------------------------
# Zoo: the measured peak holds at least weights + gradients + optimizer state


FAMILIES = ["gpt2", "bert-base", "llama3-8b", "resnet18", "vit-b16", "mlp", "unet", "lstm"]


@pytest.mark.parametrize("name", FAMILIES)
def test_zoo_peak_covers_weights_grads_and_state(name: str) -> None:
    pytest.importorskip("models")
    from memplan.workload import resolve_workload
    from models import TINY_OVERRIDES

    w = resolve_workload(name, 2, TINY_OVERRIDES[name])
    with torch.device("meta"):
        model, _ = w.build()
    params = sum(p.numel() for p in model.parameters())  # parameters() yields tied parameters once
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    m = measure(w, StepConfig(optimizer="adamw", steps=1), "cpu")
    weights, grads, adam_state = 4 * params, 4 * params, 8 * params  # fp32; exp_avg + exp_avg_sq
    assert m.measured_peak_bytes >= weights + grads + adam_state
    # live at start: weights, buffers and inputs, each storage once (a tied head is not counted twice)
    _, inputs = w.build()
    tensors = inputs.values() if isinstance(inputs, dict) else inputs
    input_bytes = sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
    assert m.baseline_bytes == weights + buffers + input_bytes
    assert m.measured_peak_bytes == max(m.phase_peaks.values()) == m.first_step_peak_bytes


# --------------------------------------------------------------------------------------------------
# Plans, out of memory, bad input


def test_plan_is_applied_and_lowers_the_backward_peak() -> None:
    pytest.importorskip("memplan.emit")
    w = blocks_workload()
    config = StepConfig(optimizer="sgd", steps=1)
    plain = measure(w, config, "cpu")
    planned = measure(w, config, "cpu", make_plan("blocks", "0", "1", "2", "3", method="every-block"))
    assert plain.plan_method is None and planned.plan_method == "every-block"
    assert planned.phase_peaks["backward"] < plain.phase_peaks["backward"]
    assert planned.baseline_bytes == plain.baseline_bytes


def test_plan_for_another_model_is_bad_input() -> None:
    with pytest.raises(BadInput, match="plan is for model gpt2, not blocks"):
        measure(blocks_workload(), StepConfig(optimizer="sgd", steps=1), "cpu", make_plan("gpt2", "h.0"))


class _HungryOnCall(nn.Module):
    """Runs out of memory on its `fail_at`-th forward (1-based), or in backward when `in_backward`."""

    def __init__(self, fail_at: int, in_backward: bool = False) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.calls = 0
        self.fail_at, self.in_backward = fail_at, in_backward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.fail_at:
            if self.in_backward:
                return _HugeGrad.apply(self.linear(x))
            torch.empty(1 << 50, dtype=torch.uint8)  # a real allocator refusal, not a simulated one
        return self.linear(x)


class _HugeGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        torch.empty(1 << 50, dtype=torch.uint8)
        return grad


@pytest.mark.parametrize(("fail_at", "in_backward", "phase"), [(2, False, "forward"), (1, True, "backward")])
def test_cpu_out_of_memory_is_a_result(fail_at: int, in_backward: bool, phase: str) -> None:
    w = workload("hungry", lambda batch_size=4: (_HungryOnCall(fail_at, in_backward), (torch.randn(batch_size, 8),)))
    m = measure(w, StepConfig(optimizer="sgd", steps=3), "cpu")
    assert m.oom and not m.fits
    assert (m.oom_phase, m.oom_step) == (phase, fail_at)
    assert "can't allocate memory" in m.oom_message
    assert m.measured_peak_bytes >= m.baseline_bytes > 0


def test_other_errors_are_not_out_of_memory() -> None:
    class Broken(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("shape mismatch somewhere")

    w = workload("broken", lambda batch_size=2: (nn.Sequential(nn.Linear(4, 4), Broken()), (torch.randn(2, 4),)))
    with pytest.raises(RuntimeError, match="shape mismatch"):
        measure(w, StepConfig(optimizer="sgd", steps=1), "cpu")


def test_device_and_optimizer_checks() -> None:
    assert resolve_device("cpu") == "cpu"
    assert resolve_device(None) == ("cuda" if CUDA else "cpu")
    with pytest.raises(BadInput, match="unknown device"):
        resolve_device("gpu0")
    with pytest.raises(BadInput, match="unsupported device"):
        resolve_device("mps")
    with pytest.raises(BadInput, match="adamw-8bit needs a CUDA GPU"):
        check_supported(StepConfig(optimizer="adamw-8bit"), "cpu")
    with pytest.raises(BadInput, match="--snapshot"):
        measure(linear_workload(4), StepConfig(optimizer="sgd", steps=1), "cpu", snapshot="x.pickle")


@no_cuda
def test_cuda_without_a_gpu_is_bad_input() -> None:
    with pytest.raises(BadInput, match="needs a CUDA GPU"):
        resolve_device("cuda")


def test_compare_and_error_pct() -> None:
    assert error_pct(110, 100) == pytest.approx(10.0)
    assert error_pct(90, 100) == pytest.approx(-10.0)
    assert error_pct(None, 100) is None and error_pct(5, 0) is None
    m = Measurement(
        device="cpu",
        device_name="cpu",
        steps=1,
        measured_peak_bytes=200,
        measured_reserved_bytes=None,
        phase_peaks={"forward": 100, "backward": 200, "optimizer": 150},
        step_peaks=(200,),
        first_step_peak_bytes=200,
        later_steps_peak_bytes=None,
        baseline_bytes=50,
        cuda_context_bytes=None,
        total_memory_bytes=None,
    )
    c = compare(m, Prediction(210, {"forward": 100, "backward": 210}))
    assert [r.phase for r in c.rows] == ["forward", "backward", "optimizer", "peak"]
    assert c.rows[0].error_pct == 0.0 and c.rows[2].error_pct is None
    assert c.error_pct == pytest.approx(5.0) and c.within(5.0) and not c.within(4.9)
    assert compare(m, None).error_pct is None and not compare(m, None).within(100)


# --------------------------------------------------------------------------------------------------
# CLI


JSON_KEYS = {
    "device",
    "steps",
    "measured_peak_bytes",
    "measured_reserved_bytes",
    "phase_peaks",
    "first_step_peak_bytes",
    "later_steps_peak_bytes",
    "baseline_bytes",
    "cuda_context_bytes",
    "fits",
    "oom",
    "predicted_peak_bytes",
    "error_pct",
}


def test_cli_json(toy: Path) -> None:
    result = runner.invoke(
        app,
        [
            "verify",
            f"{toy}:build",
            "-b",
            "4",
            "--device",
            "cpu",
            "-o",
            "sgd-momentum",
            "--steps",
            "2",
            "--no-predict",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert JSON_KEYS <= data.keys()
    assert data["device"] == "cpu" and data["steps"] == 2 and data["batch_size"] == 4
    assert isinstance(data["measured_peak_bytes"], int) and data["measured_peak_bytes"] > 0
    assert set(data["phase_peaks"]) == {"forward", "backward", "optimizer"}
    assert data["measured_reserved_bytes"] is None and data["predicted_peak_bytes"] is None


@pytest.mark.skipif(not HAS_ESTIMATOR, reason="memplan.estimate is not in this build")
def test_cli_json_with_prediction(toy: Path) -> None:
    result = runner.invoke(app, ["verify", f"{toy}:build", "--device", "cpu", "-o", "adamw", "--steps", "2", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert isinstance(data["predicted_peak_bytes"], int)
    assert isinstance(data["error_pct"], float)
    assert data["error_pct"] == pytest.approx(
        error_pct(data["predicted_peak_bytes"], data["measured_peak_bytes"]), abs=0.01
    )


def test_cli_json_says_why_there_is_no_prediction(toy: Path) -> None:
    result = runner.invoke(app, ["verify", f"{toy}:sparse", "--device", "cpu", "-o", "sgd", "--steps", "1", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["predicted_peak_bytes"] is None and data["measured_peak_bytes"] > 0
    assert data["prediction_error"].startswith("the estimator failed") and "sparse_csr" in data["prediction_error"]
    assert json.loads(runner.invoke(app, ["verify", f"{toy}:build", "--device", "cpu", "--steps", "1", "--json"])
                      .stdout)["prediction_error"] is None


def test_cli_table(toy: Path) -> None:
    result = runner.invoke(app, ["verify", f"{toy}:build", "--device", "cpu", "--steps", "1", "--no-predict"])
    assert result.exit_code == 0, result.output
    assert "phase" in result.stdout and "measured" in result.stdout and "predicted" in result.stdout
    for phase in ("forward", "backward", "optimizer", "peak"):
        assert phase in result.stdout
    assert "KiB" in result.stdout  # binary units in tables


@no_cuda
def test_cli_cuda_without_gpu_exits_1(toy: Path) -> None:
    result = runner.invoke(app, ["verify", f"{toy}:build", "--device", "cuda"])
    assert result.exit_code == 1
    assert "needs a CUDA GPU" in result.stderr and result.stdout == ""


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-o", "adamw-8bit", "--device", "cpu"], "adamw-8bit"),
        (["--device", "tpu"], "device"),
        (["-p", "fp8", "--device", "cpu"], "unknown precision"),
        (["--device", "cpu", "--no-predict", "--tolerance", "5"], "--no-predict"),
        (["--device", "cpu", "--tolerance", "-1"], "--tolerance"),
    ],
)
def test_cli_bad_input_exits_1(toy: Path, args: list[str], message: str) -> None:
    result = runner.invoke(app, ["verify", f"{toy}:build", *args])
    assert result.exit_code == 1, result.output
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_cli_plan_for_another_model_exits_1(toy: Path, tmp_path: Path) -> None:
    plan_path = tmp_path / "plan.json"
    save_plan(make_plan("gpt2", "h.0"), plan_path)
    result = runner.invoke(app, ["verify", f"{toy}:build", "--device", "cpu", "--plan", str(plan_path)])
    assert result.exit_code == 1
    assert f"plan is for model gpt2, not {toy}:build" in result.stderr


def test_cli_out_of_memory_exits_2(toy: Path) -> None:
    result = runner.invoke(app, ["verify", f"{toy}:hungry", "--device", "cpu", "-o", "sgd", "--no-predict", "--json"])
    assert result.exit_code == 2, result.output
    assert "does not fit: out of memory in forward of step 1" in result.stderr
    data = json.loads(result.stdout)
    assert data["oom"] is True and data["fits"] is False and data["oom_phase"] == "forward"


def test_cli_tolerance_exits_3(toy: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import cli.verify_cmd

    monkeypatch.setattr(cli.verify_cmd, "predict", lambda *args, **kwargs: Prediction(1, {}))
    monkeypatch.setattr(cli.verify_cmd.importlib.util, "find_spec", lambda name: object())
    args = ["verify", f"{toy}:build", "--device", "cpu", "-o", "sgd", "--steps", "1", "--json"]
    result = runner.invoke(app, [*args, "--tolerance", "10"])
    assert result.exit_code == 3, result.output
    assert "tolerance" in result.stderr
    assert json.loads(result.stdout)["error_pct"] == pytest.approx(-100.0, abs=0.01)
    assert runner.invoke(app, [*args, "--tolerance", "100"]).exit_code == 0


# --------------------------------------------------------------------------------------------------
# CUDA (only with a GPU)


@needs_cuda
def test_cuda_measure_linear() -> None:
    m = measure(linear_workload(), StepConfig(optimizer="sgd", steps=2), "cuda")
    assert m.device.startswith("cuda") and m.device_name
    assert m.baseline_bytes >= LIVE_AT_START
    assert m.measured_peak_bytes >= LIVE_AT_START + GRADS + 2 * OUTPUT
    assert m.measured_peak_bytes == max(m.phase_peaks.values())
    assert m.measured_reserved_bytes >= m.measured_peak_bytes
    assert m.cuda_context_bytes is not None and m.cuda_context_bytes >= 0
    assert m.total_memory_bytes > m.measured_reserved_bytes


@needs_cuda
def test_cuda_repeated_runs_agree() -> None:
    config = StepConfig(optimizer="adamw", steps=2)
    a, b = (measure(linear_workload(), config, "cuda") for _ in range(2))
    assert a.measured_peak_bytes == b.measured_peak_bytes and a.phase_peaks == b.phase_peaks


@needs_cuda
def test_cuda_out_of_memory_is_a_result() -> None:
    before = torch.cuda.memory_allocated()
    w = workload("hungry", lambda batch_size=4: (_HungryCuda(), (torch.randn(batch_size, 8),)))
    m = measure(w, StepConfig(optimizer="sgd", steps=2), "cuda")
    assert m.oom and (m.oom_phase, m.oom_step) == ("forward", 1)
    assert "OutOfMemoryError" in m.oom_message
    assert torch.cuda.memory_allocated() - before < 2**20  # nothing of the failed step is left behind


class _HungryCuda(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        total = torch.cuda.get_device_properties(x.device).total_memory
        torch.empty(2 * total, dtype=torch.uint8, device=x.device)
        return self.linear(x)


@needs_cuda
def test_cuda_cli_out_of_memory_exits_2(toy: Path) -> None:
    result = runner.invoke(app, ["verify", f"{toy}:hungry", "--device", "cuda", "-o", "sgd", "--no-predict"])
    assert result.exit_code == 2, result.output
    assert "does not fit: out of memory in forward of step 1" in result.stderr


@needs_cuda
def test_cuda_snapshot(tmp_path: Path) -> None:
    path = tmp_path / "snapshot.pickle"
    m = measure(linear_workload(8), StepConfig(optimizer="sgd", steps=1), "cuda", snapshot=path)
    assert path.is_file() and path.stat().st_size > 0 and m.snapshot_path == str(path)


def test_prediction_on_a_gpu_models_that_gpu(monkeypatch) -> None:
    """verify's prediction on CUDA is for the card torch reports: an A100's cuBLAS workspaces, not the
    default H100's (32 MiB a thread), else every step on it would read tens of MiB over."""
    from memplan.estimate import estimate
    from memplan.workload import resolve_workload
    from models import TINY_OVERRIDES

    workload = resolve_workload("gpt2", 4, TINY_OVERRIDES["gpt2"])
    config = StepConfig(precision="amp-bf16", optimizer="sgd", steps=2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    on_a100 = estimate(workload, config, "cuda", gpu="a100-80gb").peak_bytes
    assert on_a100 != estimate(workload, config, "cuda").peak_bytes  # the card matters here
    assert predict(workload, config, "cuda").peak_bytes == on_a100
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some Future GPU")
    assert predict(workload, config, "cuda").peak_bytes == estimate(workload, config, "cuda").peak_bytes


def test_a_step_whose_update_the_grad_scaler_skipped_runs_again():
    """amp-fp16: the loss's gradient, 2 x GradScaler's first scale 2**16, overflows fp16 (max 65504), as
    it does at the next scales; the scaler skips those updates, so Adam has no state yet. Training runs on; the
    step contract runs such a step again, so the steps measured are the ones the estimator traces
    (where overflow never happens), Adam's state included."""
    from memplan.estimate import estimate

    class Doubled(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(64, 64)

        def forward(self, x):
            return self.fc(x).float().sum() * 2

    workload = Workload("doubled", lambda batch_size=4: (Doubled(), (torch.randn(batch_size, 64),)), None, {})
    config = StepConfig("amp-fp16", "adam", steps=2)
    measured = measure(workload, config, device="cpu")
    assert measured.skipped_updates >= 2
    predicted = estimate(workload, config, device="cpu")
    assert abs(predicted.peak_bytes - measured.measured_peak_bytes) <= 16, (predicted.peak_bytes, measured.measured_peak_bytes)
    assert len(measured.step_peaks) == 2


def _running_statistic(update: str, prebuilt: bool):
    """A 1 MiB buffer the forward updates: replaced (`self.stat = ...`, which frees the buffer's storage
    from before the step), resized in place from one element at the first forward (a quantization
    observer's `min_val.resize_(channels)`: a new block, the old one freed), or in place. `prebuilt`: the
    factory hands out a model built before it is called, whose blocks predate the profiler."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(64, 64)
            self.register_buffer("stat", torch.zeros(1) if update == "resize" else torch.zeros(1024, 256))

        def forward(self, x):
            if update == "replace":
                self.stat = self.stat + 1
            elif update == "resize" and self.stat.numel() == 1:
                self.stat.resize_(1024, 256).fill_(1)
            else:
                self.stat.add_(1)
            return self.fc(x).sum()

    built = Net() if prebuilt else None
    return lambda batch_size=2: (built or Net(), (torch.randn(batch_size, 64),))


@pytest.mark.parametrize(("update", "prebuilt"), [("replace", False), ("replace", True), ("resize", False)])
def test_a_buffer_replaced_or_resized_in_forward_frees_its_storage_from_before_the_step(update, prebuilt):
    """The profiler reports no free of a block allocated before it started: the measurement counted the
    replaced buffer's old storage until the end (1 MiB over, from the first forward on), and a resized
    one's old block (4 B over; the profiler now records from before the model is built). A model built
    before its factory is called and resized in place stays 4 B over: its storage lives on, so no
    marker can say when the old block went."""
    config = StepConfig(precision="fp32", optimizer="sgd", steps=2)
    updated = measure(Workload(update, _running_statistic(update, prebuilt), 2, {}), config, device="cpu")
    in_place = measure(Workload("in place", _running_statistic("in place", prebuilt), 2, {}), config, device="cpu")
    # after the forward both hold one 1 MiB buffer: the same bytes
    assert updated.phase_peaks["optimizer"] == in_place.phase_peaks["optimizer"]
    assert updated.phase_peaks["backward"] == in_place.phase_peaks["backward"]
    # and while updating, the old and the new buffer are both live
    if update == "replace":
        assert updated.phase_peaks["forward"] >= updated.baseline_bytes + 1024 * 256 * 4


class _ReplacedStatistic(nn.Module):
    """Running statistics the forward replaces, as vector-quantize-pytorch's affine codebook does:
    `register_buffer(name, new)` over an `empty` buffer and a bool `needs_init` flag at the first
    call, or plain attribute assignment."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.fc = nn.Linear(64, 256)
        self.register_buffer("needs_init", torch.tensor(True))
        self.register_buffer("stat", torch.empty(64, 256))

    def forward(self, x):
        h = self.fc(x)
        new = h.mean((0, 1)).detach().expand(64, 256).clone()
        if self.how == "register":
            if self.needs_init:
                self.register_buffer("needs_init", torch.tensor(False))
            self.register_buffer("stat", new)
        else:
            self.stat = self.stat * 0.9 + new * 0.1
        return (h - self.stat.mean(0)).pow(2).mean()


@pytest.mark.parametrize("how", ["register", "assign"])
def test_the_estimate_frees_a_buffer_the_forward_replaces(how):
    """The tracer held a list of the model's buffers through the traced step, so a buffer the forward
    replaced was never freed: every phase 64 KiB (and the flag's byte) over the measured step."""
    workload = Workload(how, lambda batch_size=2: (_ReplacedStatistic(how), (torch.randn(batch_size, 8, 64),)), 2, {})
    for config in (StepConfig("fp32", "adamw", steps=2), StepConfig("bf16", "sgd", steps=2)):
        predicted = estimate(workload, config, device="cpu")
        measured = measure(workload, config, device="cpu")
        assert predicted.peak_bytes == measured.measured_peak_bytes, (config, predicted.peak_bytes, measured.measured_peak_bytes)
        assert dict(predicted.phase_peaks) == dict(measured.phase_peaks)


def _broken(batch_size: int = 2):
    raise ValueError("the factory broke")


def test_a_factory_that_fails_leaves_no_profiler_running():
    """The CPU profiler starts before the model is built: a build that fails stops it again, so the
    error is the factory's and the next measurement runs."""
    config = StepConfig(precision="fp32", optimizer="sgd", steps=1)
    with pytest.raises(BadInput, match="the factory broke"):
        measure(Workload("broken", _broken, 2, {}), config, device="cpu")
    assert not torch._C._autograd._profiler_enabled()
    assert measure(Workload("in place", _running_statistic("in place", False), 2, {}), config, device="cpu").phase_peaks["forward"] > 0
