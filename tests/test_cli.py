"""The CLI through typer's CliRunner: tables, JSON schemas, exit codes."""

import importlib.util
import json
import sys

import pytest
from typer.testing import CliRunner

import memplan
from cli.main import app
from memplan.estimate import estimate
from memplan.step import StepConfig
from memplan.workload import resolve_workload
from models import TINY_OVERRIDES, ZOO

runner = CliRunner()
TINY_GPT = [f"--set={k}={v}" for k, v in TINY_OVERRIDES["gpt2"].items()]


def test_version_and_help():
    assert runner.invoke(app, ["--version"]).stdout.strip() == f"memplan {memplan.__version__}"
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for command in ("estimate", "plan", "verify", "emit", "models", "max-batch"):
        assert command in result.stdout


def test_models_lists_the_zoo_with_published_counts():
    result = runner.invoke(app, ["models", "--json"])
    assert result.exit_code == 0
    rows = {row["name"]: row for row in json.loads(result.stdout)["models"]}
    assert set(rows) == set(ZOO)
    assert rows["gpt2"]["parameters"] == 124_439_808
    assert rows["llama2-70b"]["parameters"] == 68_976_648_192
    table = runner.invoke(app, ["models"]).stdout
    assert "124,439,808" in table and "resnet50" in table


def test_estimate_json_schema():
    result = runner.invoke(app, ["estimate", "gpt2", "-b", "2", *TINY_GPT, "-p", "fp32", "-p", "bf16",
                                 "-o", "sgd", "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["model"] == "gpt2" and len(payload["results"]) == 2
    for row in payload["results"]:
        for key in ("precision", "optimizer", "batch_size", "device", "peak_bytes", "reserved_bytes", "peak_phase",
                    "breakdown", "phase_peaks", "approximate"):
            assert key in row
        assert set(row["breakdown"]) == {"weights", "gradients", "optimizer_state", "activations", "temporaries",
                                         "inputs"}
        assert set(row["phase_peaks"]) == {"forward", "backward", "optimizer"}
        assert isinstance(row["peak_bytes"], int) and row["batch_size"] == 2
        assert sum(row["breakdown"].values()) == row["peak_bytes"]
        for phase, categories in row["phase_breakdowns"].items():
            assert sum(categories.values()) == row["phase_peaks"][phase]
    fp32, bf16 = payload["results"]
    assert bf16["breakdown"]["weights"] * 2 == fp32["breakdown"]["weights"]


def test_estimate_table_uses_binary_units():
    result = runner.invoke(app, ["estimate", "gpt2", "-b", "2", *TINY_GPT, "--device", "cpu"])
    assert result.exit_code == 0
    assert "MiB" in result.stdout and "peak phase" in result.stdout


def test_bad_options_exit_1_with_one_line():
    for args, message in [
        (["estimate", "gpt2", "-p", "fp8"], "unknown precision 'fp8'"),
        (["estimate", "gpt2", "-o", "lion"], "unknown optimizer 'lion'"),
        (["estimate", "gpt2", "--device", "tpu"], "unknown device 'tpu'"),
        (["estimate", "gpt2", "--grad-accum", "0"], "--grad-accum must be at least 1"),
        (["plan", "gpt2", "--budget", "lots"], "cannot read size 'lots'"),
        (["plan", "gpt2", "--budget", "1GiB", "--method", "greedy"], "unknown method 'greedy'"),
        (["plan", "gpt2", "--budget", "1GiB", "--calibrate-cpu"], "--calibrate-cpu prices a step on this machine's CPU"),
    ]:
        result = runner.invoke(app, args)
        assert result.exit_code == 1, (args, result.output)
        assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(("target", "precision", "message"), [
    ("tests/test_values_read_back.py:forever", "fp32", "values that depend on the data at one line"),
    ("tests/test_unseen_models.py:quantization_aware_training", "amp-bf16", "expected scalar type Float"),
])
def test_steps_the_estimate_refuses_exit_1_with_one_line(target, precision, message):
    """A loop that no fake value can end, and a step eager refuses (quantization-aware training's
    observers in bf16): one line on stderr, exit 1."""
    result = runner.invoke(app, ["estimate", target, "-p", precision, "-o", "sgd", "--device", "cpu"])
    assert result.exit_code == 1, result.output
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


# --------------------------------------------------------------------------------------------------
# Issue 7: the same columns everywhere, --json on every command, --gpu, --plot, exit codes

TINY_MLP = [f"--set={k}={v}" for k, v in TINY_OVERRIDES["mlp"].items()]
PNG = b"\x89PNG\r\n\x1a\n"


def _png_width(path) -> int:
    data = path.read_bytes()
    assert data.startswith(PNG)
    return int.from_bytes(data[16:20], "big")  # the IHDR chunk's width


def test_help_documents_the_exit_codes():
    result = runner.invoke(app, ["--help"])
    for text in ("0 ok", "1 bad input", "2 does not fit", "3 verify error", "MEMPLAN_DEBUG=1"):
        assert text in " ".join(result.stdout.split()), text


def test_estimate_table_names_the_dominant_category_and_the_gpu():
    result = runner.invoke(app, ["estimate", "gpt2", "-b", "2", *TINY_GPT, "-o", "sgd", "-p", "fp32", "-p", "bf16",
                                 "--gpu", "t4"])
    assert result.exit_code == 0, result.output
    header = result.stdout.splitlines()[1]
    for column in ("weights", "optimizer state", "activations", "peak", "peak phase", "fits on T4"):
        assert column in header
    assert "fp32, sgd: peak in " in result.stdout and "bf16, sgd: peak in " in result.stdout
    assert "T4: 14.75 GiB, 14.27 GiB usable after an assumed 500.00 MiB CUDA context" in result.stdout
    # bf16 has no hardware path on a T4 (compute capability 7.5): a warning, not an error
    assert "warning: T4 has compute capability 7.5; bf16" in result.stderr


def test_estimate_json_has_the_gpu_and_the_dominant_category():
    result = runner.invoke(app, ["estimate", "gpt2", "-b", "2", *TINY_GPT, "-o", "sgd", "--gpu", "rtx4090", "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["command"] == "estimate"
    assert payload["gpu"] == {"name": "RTX-4090", "capacity_bytes": 24563 * 2**20, "cuda_context_bytes": 500 * 2**20,
                              "usable_bytes": 24063 * 2**20, "compute_capability": [8, 9]}
    (row,) = payload["results"]
    assert row["fits_gpu"] is True
    assert set(row["dominant"]) == {"phase", "category", "share_pct", "module_group", "module_share_pct",
                                    "module_share_is_lower_bound"}
    assert row["dominant"]["category"] in row["breakdown"] and row["dominant"]["phase"] == row["peak_phase"]


def test_gpu_needs_the_cuda_target_and_a_known_name():
    for args, message in [
        (["--gpu", "rtx4090", "--device", "cpu"], "--gpu describes a CUDA GPU"),
        (["--gpu", "rtx5000"], "unknown GPU 'rtx5000'"),
    ]:
        result = runner.invoke(app, ["estimate", "mlp", *TINY_MLP, *args])
        assert result.exit_code == 1, result.output
        assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_plan_table_and_json_with_the_gpu_as_budget():
    args = ["plan", "mlp", "-b", "4", *TINY_MLP, "-o", "sgd", "--gpu", "a100-80gb"]
    table = runner.invoke(app, args)
    assert table.exit_code == 0, table.output
    assert "(none needed)" in table.stdout
    for column in ("peak", "peak phase", "budget", "fits on A100-80GB", "recompute overhead"):
        assert column in table.stdout
    assert "without a plan" in table.stdout and "with the plan" in table.stdout
    assert "recompute ≈ 0.0 ms per step on A100-80GB" in table.stdout
    payload = json.loads(runner.invoke(app, [*args, "--json"]).stdout)
    assert payload["command"] == "plan" and payload["gpu"]["name"] == "A100-80GB"
    assert payload["budget_bytes"] == payload["gpu"]["usable_bytes"] == 81920 * 2**20 - 500 * 2**20
    assert payload["feasible"] is True and payload["fits_gpu"] is True and payload["recompute_seconds"] == 0.0
    assert payload["recompute_bound_seconds"] is None  # no plan needed, nothing to bound
    for key, kind in [("predicted_peak_bytes", int), ("unplanned_peak_bytes", int), ("predicted_peak_phase", str),
                      ("unplanned_peak_phase", str), ("recompute_flops", int), ("step_flops", int),
                      ("recompute_overhead_pct", float), ("segments", list), ("excluded", list),
                      ("alternatives", list), ("method", str)]:
        assert isinstance(payload[key], kind), key


def test_plan_without_scipy_skips_the_recompute_bound_with_a_note(monkeypatch):
    """scipy is an optional dependency (the `plan` extra): without it the plan still comes back, the bound
    is null and one line on stderr says why."""
    unplanned = estimate(resolve_workload("gpt2", 2, TINY_OVERRIDES["gpt2"]), StepConfig(optimizer="sgd"), "cpu")
    budget = int(unplanned.peak_bytes - 0.3 * unplanned.breakdown.activations)
    monkeypatch.setitem(sys.modules, "scipy.optimize", None)  # import scipy.optimize now raises ImportError
    result = runner.invoke(app, ["plan", "gpt2", "-b", "2", *TINY_GPT, "-o", "sgd", "--device", "cpu",
                                 "--budget", str(budget), "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["feasible"] and payload["segments"] and payload["recompute_bound_seconds"] is None
    assert "not bounding what any plan recomputes: that needs scipy" in result.stderr


def test_plan_prices_on_this_cpu_when_asked():
    """--calibrate-cpu measures this machine's CPU time model first and prices the plan on it."""
    args = ["plan", "gpt2", "-b", "2", *TINY_GPT, "-o", "sgd", "--device", "cpu", "--budget", "1.5MiB"]
    built_in = runner.invoke(app, args)
    measured = runner.invoke(app, [*args, "--calibrate-cpu"])
    assert built_in.exit_code == measured.exit_code == 0, measured.output
    assert "measured on the 2-core CI machine" in built_in.stdout
    assert "measured on this machine" in measured.stdout


def test_plan_needs_a_budget_or_a_gpu():
    result = runner.invoke(app, ["plan", "mlp", *TINY_MLP, "--device", "cpu"])
    assert result.exit_code == 1
    assert "give --budget SIZE or --gpu NAME" in result.stderr


def test_plan_that_cannot_fit_exits_2_after_printing_its_json():
    result = runner.invoke(app, ["plan", "mlp", "-b", "4", *TINY_MLP, "-o", "sgd", "--device", "cpu",
                                 "--budget", "1KiB", "--json"])
    assert result.exit_code == 2, result.output
    assert json.loads(result.stdout)["feasible"] is False
    assert result.stderr.startswith("memplan: does not fit: no checkpoint plan brings the peak under 1.00 KiB")


def test_a_plan_not_found_above_the_floor_is_not_called_impossible():
    """Between the floor and the lowest plan found, a plan may exist that the planners do not consider:
    the message must not claim that none can fit."""
    from memplan.planner import plan_checkpoints

    workload = resolve_workload("mlp", 4, TINY_OVERRIDES["mlp"])
    lowest = plan_checkpoints(workload, StepConfig(precision="fp32", optimizer="sgd", steps=2), 0, device="cpu")
    assert lowest.floor.peak_bytes < lowest.plan.predicted_peak_bytes  # a gap to put the budget in
    budget = (lowest.floor.peak_bytes + lowest.plan.predicted_peak_bytes) // 2
    options = [f"--set={k}={v}" for k, v in TINY_OVERRIDES["mlp"].items()]
    result = runner.invoke(app, ["plan", "mlp", "-b", "4", *options, "-o", "sgd", "--device", "cpu",
                                 "--budget", str(budget)])
    assert result.exit_code == 2, result.output
    assert "does not fit: no plan found brings the peak under" in result.stderr
    assert "none is proven impossible" in result.stderr and "none can" not in result.stderr


def test_max_batch_table_json_and_exit_2():
    args = ["max-batch", "mlp", *TINY_MLP, "-o", "sgd", "--device", "cpu", "--budget", "40KiB"]
    table = runner.invoke(app, args)
    assert table.exit_code == 2, table.output
    assert all(column in table.stdout for column in ("max batch", "budget", "recompute overhead", "40.00 KiB"))
    assert "not even batch 1 fits in 40.00 KiB" in table.stderr
    payload = json.loads(runner.invoke(app, [*args, "--json"]).stdout)
    assert payload["command"] == "max-batch" and payload["budget_bytes"] == 40 * 1024
    assert payload["max_batch_without_plan"] == payload["max_batch_with_plan"] == 0


def test_verify_exit_0_then_3_above_the_tolerance(monkeypatch):
    import dataclasses

    import cli.verify_cmd

    args = ["verify", "mlp", "-b", "4", *TINY_MLP, "-o", "sgd", "--steps", "1", "--device", "cpu"]
    table = runner.invoke(app, args)
    assert table.exit_code == 0, table.output
    assert all(column in table.stdout for column in ("phase", "measured", "predicted", "error %"))
    real_predict = cli.verify_cmd.predict

    def off_by_4kib(*a, **k):  # whatever the estimator's accuracy, the prediction is now off
        prediction = real_predict(*a, **k)
        return dataclasses.replace(prediction, peak_bytes=prediction.peak_bytes + 4096)

    monkeypatch.setattr(cli.verify_cmd, "predict", off_by_4kib)
    result = runner.invoke(app, [*args, "--tolerance", "0.0000001", "--json"])
    assert result.exit_code == 3, result.output
    assert json.loads(result.stdout)["command"] == "verify"
    assert "more than the tolerance of 1e-07%" in result.stderr


def test_emit_json(tmp_path):
    plan_path, module = tmp_path / "plan.json", tmp_path / "ckpt.py"
    result = runner.invoke(app, ["plan", "mlp", "-b", "4", *TINY_MLP, "--device", "cpu", "--budget", "1GiB",
                                 "--out", str(plan_path), "--json"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["emit", str(plan_path), "-o", str(module), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == {"command": "emit", "plan": str(plan_path), "output": str(module),
                                         "segments": 0}
    assert "def apply_checkpointing" in module.read_text()


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib is not installed")
def test_plots_from_estimate_and_plan(tmp_path):
    png, svg, both = tmp_path / "estimate.png", tmp_path / "estimate.svg", tmp_path / "plan.png"
    for path in (png, svg):
        result = runner.invoke(app, ["estimate", "gpt2", "-b", "2", *TINY_GPT, "-o", "sgd", "--plot", str(path)])
        assert result.exit_code == 0, result.output
        assert f"wrote {path}" in result.stderr
    assert b"<svg" in svg.read_bytes()[:1000]
    result = runner.invoke(app, ["plan", "gpt2", "-b", "2", *TINY_GPT, "-o", "sgd", "--device", "cpu",
                                 "--budget", "1.2MiB", "--plot", str(both)])
    assert result.exit_code in (0, 2), result.output  # the figure is drawn either way
    assert _png_width(both) > 1.8 * _png_width(png)  # two panels side by side


def test_plot_needs_a_known_suffix_before_any_work():
    result = runner.invoke(app, ["estimate", "mlp", *TINY_MLP, "--plot", "memory.jpg"])
    assert result.exit_code == 1 and "must end in .png, .svg, .html" in result.stderr


def test_an_unexpected_error_is_one_line(monkeypatch):
    import cli.estimate_cmd

    def boom(*args, **kwargs):
        raise RuntimeError("the first line names it\nparagraphs of advice follow")

    monkeypatch.setattr(cli.estimate_cmd, "estimate", boom)
    result = runner.invoke(app, ["estimate", "mlp", *TINY_MLP])
    assert result.exit_code == 1
    assert result.stderr == "memplan: RuntimeError: the first line names it (set MEMPLAN_DEBUG=1 for the traceback)\n"


# --------------------------------------------------------------------------------------------------
# A new user's mistakes: every one is one line on stderr (and, with --json, one object on stdout), exit 1

def _one_line_error(result, code: int = 1) -> str:
    assert result.exit_code == code, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("memplan: "), result.stderr
    return lines[0]


@pytest.mark.parametrize("args, message", [
    (["estimate", "mlp", "-b", "abc"], "--batch-size"),
    (["estimate", "mlp", "--steps", "x"], "--steps"),
    (["estimate", "mlp", "--no-such-option"], "No such option: --no-such-option"),
    (["estimate"], "Missing argument"),
    (["estimat", "mlp"], "No such command 'estimat'"),
])
def test_usage_errors_are_one_line_and_exit_1_not_2(args, message):
    # exit 2 means "does not fit": a typo must not read as that, nor print click's framed box
    line = _one_line_error(runner.invoke(app, args))
    assert message in line and "--help" in line


@pytest.mark.parametrize("args, command, message", [
    (["estimate", "mlp", *TINY_MLP, "-p", "fp8"], "estimate", "unknown precision 'fp8'"),
    (["plan", "mlp", *TINY_MLP, "--budget", "12XB"], "plan", "cannot read size '12XB'"),
    (["max-batch", "mlp", *TINY_MLP, "--gpu", "h1000"], "max-batch", "unknown GPU 'h1000'"),
    (["emit", "no-such-plan.json", "-o", "x.py"], "emit", "plan file not found"),
    (["estimate", "mlp", "-b", "abc"], "estimate", "--batch-size"),
])
def test_errors_with_json_print_one_error_object(args, command, message):
    result = runner.invoke(app, [*args, "--json"])
    line = _one_line_error(result)
    payload = json.loads(result.stdout)  # exactly one object: json.loads refuses trailing text
    assert payload["command"] == command and payload["exit_code"] == 1
    assert message in payload["error"] and payload["error"] in line


def test_a_plan_that_does_not_fit_prints_one_json_object_not_two():
    result = runner.invoke(app, ["plan", "mlp", "-b", "4", *TINY_MLP, "-o", "sgd", "--device", "cpu",
                                 "--budget", "1KiB", "--json"])
    assert result.exit_code == 2
    assert "error" not in json.loads(result.stdout)


@pytest.mark.parametrize("size", ["12XB", "-1GiB", "1.5.2GiB", "", "0", "0GiB", "0.0001", "1.5", "1e9", "nan", "1."])
def test_budget_garbage_is_refused_before_any_work(size):
    line = _one_line_error(runner.invoke(app, ["max-batch", "mlp", *TINY_MLP, "--device", "cpu", "--budget", size]))
    assert repr(size) in line


@pytest.mark.parametrize("size, expected", [
    ("24GiB", 24 * 1024**3), ("80GB", 80 * 1000**3), ("512MiB", 512 * 1024**2), ("4096", 4096), ("1.5 KiB", 1536),
    (".5GiB", 512 * 1024**2), ("0.1GiB", 107374182), ("7 kb", 7000),
])
def test_budget_formats_are_exact_bytes(size, expected):
    result = runner.invoke(app, ["plan", "mlp", "-b", "2", *TINY_MLP, "-o", "sgd", "--device", "cpu", "--budget", size,
                                 "--json"])
    assert json.loads(result.stdout)["budget_bytes"] == expected


def test_a_budget_above_every_gpu_is_a_warning():
    result = runner.invoke(app, ["plan", "mlp", "-b", "2", *TINY_MLP, "-o", "sgd", "--budget", "1000TB", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["budget_bytes"] == 10**15
    assert "warning: --budget" in result.stderr and "more than any known GPU" in result.stderr
    # --device cpu: host memory can be that large; no warning
    result = runner.invoke(app, ["plan", "mlp", "-b", "2", *TINY_MLP, "-o", "sgd", "--budget", "1000TB",
                                 "--device", "cpu"])
    assert result.exit_code == 0 and "warning" not in result.stderr


USER_MODELS = '''
import sys
import torch
from torch import nn

def raises(batch_size: int = 2):
    raise ValueError("first line of the user's message\\nsecond line")

def frozen(batch_size: int = 2):
    model = nn.Linear(4, 4)
    model.requires_grad_(False)
    return model, (torch.randn(batch_size, 4),)

def no_parameters(batch_size: int = 2):
    return nn.ReLU(), (torch.randn(batch_size, 4),)

def exits(batch_size: int = 2):
    sys.exit(5)

def wrong_shape(batch_size: int = 2):
    return nn.Linear(8, 8), (torch.randn(batch_size, 7),)

def no_batch_size():
    return nn.Linear(4, 4), (torch.randn(3, 4),)
'''


@pytest.fixture
def user_models(tmp_path):
    path = tmp_path / "user_models.py"
    path.write_text(USER_MODELS)
    return path


@pytest.mark.parametrize("name, message", [
    ("raises", "ValueError: first line of the user's message"),
    ("frozen", "no trainable parameters"),
    ("no_parameters", "no trainable parameters"),
    ("exits", "sys.exit(5)"),
    ("wrong_shape", "RuntimeError"),
])
def test_user_factory_failures_are_one_line(user_models, name, message):
    import logging

    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    # torch logs the failed meta kernel with a traceback before raising: not on the user's terminal
    keep, logger = Keep(level=logging.DEBUG), logging.getLogger("torch._subclasses.fake_tensor")
    logger.addHandler(keep)
    try:
        result = runner.invoke(app, ["estimate", f"{user_models}:{name}", "--device", "cpu", "-o", "sgd"])
    finally:
        logger.removeHandler(keep)
    assert message in _one_line_error(result)
    assert not [r for r in records if r.levelno >= logging.ERROR]


def test_a_factory_without_batch_size_says_default(user_models):
    result = runner.invoke(app, ["estimate", f"{user_models}:no_batch_size", "--device", "cpu", "-o", "sgd"])
    assert result.exit_code == 0, result.output
    assert "batch default," in result.stdout and "None" not in result.stdout


def test_module_syntax_finds_a_module_in_the_working_directory(user_models, monkeypatch):
    monkeypatch.chdir(user_models.parent)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(user_models.parent))])
    result = runner.invoke(app, ["estimate", "user_models:no_batch_size", "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.stderr


def _plan_json(**changes) -> dict:
    plan = {"format": 1, "model": "mlp", "batch_size": 2, "precision": "fp32", "optimizer": "sgd", "grad_accum": 1,
            "device": "cpu", "method": "optimal-dp", "segments": [{"modules": ["net.0"]}], "feasible": True,
            "budget_bytes": 2**20, "predicted_peak_bytes": 1000, "unplanned_peak_bytes": 2000, "recompute_flops": 10,
            "step_flops": 100}
    return {**plan, **changes}


@pytest.mark.parametrize("content, message", [
    ("", "not JSON"),
    ("[1, 2]", "not a memplan plan"),
    (json.dumps(_plan_json(format=0)), "run `memplan plan --out` again"),
    (json.dumps(_plan_json(format=2)), "upgrade memplan"),
    (json.dumps(_plan_json(segments=[{"modules": "net.0"}])), "'modules' must be list of str"),
    (json.dumps(_plan_json(segments=[{"modules": ["net.0"], "activation_bytes": "x"}])), "must be int"),
    (json.dumps(_plan_json(segments=None)), "'segments' must be a list"),
    (json.dumps(_plan_json(segments=[{"modules": []}])), "names no module"),
    (json.dumps(_plan_json(colour=3)), "unknown key 'colour'"),
    (json.dumps({k: v for k, v in _plan_json().items() if k != "step_flops"}), "lacks the key 'step_flops'"),
    (json.dumps(_plan_json(feasible="yes")), "'feasible' must be bool"),
])
def test_a_broken_plan_file_is_one_line_and_writes_nothing(tmp_path, content, message):
    plan_path, out = tmp_path / "plan.json", tmp_path / "out.py"
    plan_path.write_text(content)
    for args in (["emit", str(plan_path), "-o", str(out)],
                 ["verify", "mlp", "-b", "2", *TINY_MLP, "--device", "cpu", "--plan", str(plan_path)]):
        assert message in _one_line_error(runner.invoke(app, args))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]


def test_a_run_its_model_does_not_call_in_that_order_is_one_line(tmp_path):
    """A plan whose run lists two blocks in another order than the model calls them (only the forward can
    tell: runs need not follow the registration order) fails at the step's first forward: one line, exit 1,
    and no second line for the prediction that failed the same way."""
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(json.dumps(_plan_json(model="gpt2", options=TINY_OVERRIDES["gpt2"], segments=[{"modules": ["h.1", "h.0"]}])))
    line = _one_line_error(runner.invoke(app, ["verify", "gpt2", "-b", "2", *TINY_GPT, "-o", "sgd", "--device", "cpu",
                                               "--steps", "1", "--plan", str(plan_path)]))
    assert "#1 of a checkpointed run of 2 modules was not called with the previous module's output" in line


def test_output_paths_are_checked_before_planning(tmp_path, monkeypatch):
    import cli.plan_cmd

    def no_planning(*args, **kwargs):
        raise AssertionError("planned before checking the output paths")

    monkeypatch.setattr(cli.plan_cmd, "plan_checkpoints", no_planning)
    existing, folder = tmp_path / "ckpt.py", tmp_path / "folder"
    existing.write_text("# mine\n")
    folder.mkdir()
    base = ["plan", "mlp", *TINY_MLP, "--device", "cpu", "--budget", "1GiB"]
    for args, message in [
        (["--emit", str(existing)], "--force"),
        (["--out", str(folder)], "is a directory"),
        (["--emit", str(folder), "--force"], "is a directory"),
        (["--out", str(tmp_path / "missing" / "plan.json")], "directory not found"),
    ]:
        assert message in _one_line_error(runner.invoke(app, [*base, *args]))
    assert existing.read_text() == "# mine\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.py", "folder"]


def test_a_failed_write_leaves_no_file(tmp_path, monkeypatch):
    import os

    plan_path, out = tmp_path / "plan.json", tmp_path / "ckpt.py"
    plan_path.write_text(json.dumps(_plan_json(segments=[])))

    def disk_full(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", disk_full)
    line = _one_line_error(runner.invoke(app, ["emit", str(plan_path), "-o", str(out)]))
    assert "No space left on device" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]


def test_emit_is_skipped_with_a_note_when_no_plan_fits(tmp_path):
    module = tmp_path / "ckpt.py"
    result = runner.invoke(app, ["plan", "mlp", "-b", "4", *TINY_MLP, "-o", "sgd", "--device", "cpu",
                                 "--budget", "1KiB", "--emit", str(module)])
    assert result.exit_code == 2
    assert f"not writing {module}" in result.stderr and not module.exists()


def test_a_failed_verify_leaves_no_partial_snapshot(tmp_path, monkeypatch):
    import cli.verify_cmd

    def crashes_after_writing(workload, config, device, plan, snapshot=None):
        snapshot.write_bytes(b"half a pickle")
        raise RuntimeError("the step crashed")

    monkeypatch.setattr(cli.verify_cmd, "measure", crashes_after_writing)
    snapshot = tmp_path / "snap.pickle"
    result = runner.invoke(app, ["verify", "mlp", "-b", "2", *TINY_MLP, "--device", "cpu", "--snapshot", str(snapshot)])
    assert "the step crashed" in _one_line_error(result)
    assert list(tmp_path.iterdir()) == []


def test_verify_refuses_a_tolerance_that_is_not_a_number():
    line = _one_line_error(runner.invoke(app, ["verify", "mlp", *TINY_MLP, "--device", "cpu", "--tolerance", "nan"]))
    assert "--tolerance" in line


def test_selective_takes_no_method():
    line = _one_line_error(runner.invoke(app, ["plan", "mlp", *TINY_MLP, "--device", "cpu", "--budget", "1GiB",
                                               "--selective", "--method", "sqrt-n"]))
    assert "--method" in line
    assert "brute-force" not in runner.invoke(app, ["plan", "--help"]).stdout


def test_max_batch_says_when_the_search_limit_is_reached(monkeypatch):
    import cli.plan_cmd

    monkeypatch.setattr(cli.plan_cmd, "MAX_BATCH_LIMIT", 8)
    args = ["max-batch", "mlp", *TINY_MLP, "-o", "sgd", "--device", "cpu", "--budget", "1GiB"]
    table = runner.invoke(app, args)
    assert table.exit_code == 0, table.output
    assert ">= 8" in table.stdout and "search stops at batch 8" in table.stderr
    payload = json.loads(runner.invoke(app, [*args, "--json"]).stdout)
    assert payload["max_batch_with_plan"] == payload["max_batch_limit"] == 8


CHAIN = (
    "import torch\nfrom torch import nn\n\n"
    "def build(batch_size: int = 4):\n"
    "    layers = [m for _ in range(3) for m in (nn.Linear(16, 16), nn.Tanh())]\n"
    "    return nn.Sequential(*layers), (torch.randn(batch_size, 16),)\n"
)


def test_max_batch_on_a_user_model_file(tmp_path):
    path = tmp_path / "chain.py"
    path.write_text(CHAIN)
    args = ["-o", "sgd", "--device", "cpu", "--json"]
    result = runner.invoke(app, ["max-batch", f"{path}:build", "--budget", "7KiB", *args])
    assert result.exit_code == 0, result.output
    best = json.loads(result.stdout)["max_batch_without_plan"]
    assert best >= 1
    for batch, fits in ((best, True), (best + 1, False)):  # the answer, checked against the estimate itself
        peak = json.loads(runner.invoke(app, ["estimate", f"{path}:build", "-b", str(batch), *args]).stdout)
        assert (peak["results"][0]["peak_bytes"] <= 7 * 1024) is fits


def test_selective_plan_on_a_user_model_file(tmp_path):
    path, plan_path = tmp_path / "chain.py", tmp_path / "plan.json"
    path.write_text(CHAIN)
    args = [f"{path}:build", "-b", "64", "-o", "sgd", "--device", "cpu", "--json"]
    unplanned = json.loads(runner.invoke(app, ["estimate", *args]).stdout)["results"][0]["peak_bytes"]
    result = runner.invoke(app, ["plan", *args, "--selective", "--budget", str(unplanned - 1), "--out", str(plan_path)])
    assert result.exit_code in (0, 2), result.output
    payload = json.loads(result.stdout)
    assert payload["unplanned_peak_bytes"] == unplanned and payload["feasible"] is (result.exit_code == 0)
    assert json.loads(plan_path.read_text())["model"] == f"{path}:build"
    if payload["feasible"]:  # the file reads back: the module is written from it
        result = runner.invoke(app, ["emit", str(plan_path), "-o", str(tmp_path / "ckpt.py")])
        assert result.exit_code == 0, result.output


def test_the_smallest_peak_reached_is_never_above_the_unplanned_one(tmp_path):
    import re

    # four Linear(32) + Tanh pairs at batch 64, 58.6 KiB: the plan that comes back peaks above the step without one
    path = tmp_path / "chain.py"
    path.write_text(CHAIN.replace("range(3)", "range(4)").replace("16", "32"))
    result = runner.invoke(app, ["plan", f"{path}:build", "-b", "64", "-o", "sgd", "--device", "cpu", "--budget", "60000",
                                 "--json"])
    assert result.exit_code == 2, result.output
    unplanned = json.loads(result.stdout)["unplanned_peak_bytes"]
    kib = float(re.search(r"the smallest reached is ([0-9.]+) KiB", result.stderr).group(1))
    assert kib * 1024 <= unplanned + 5  # two decimals of KiB


def test_an_output_never_replaces_the_plan_it_comes_from(tmp_path):
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(json.dumps(_plan_json(segments=[])))
    line = _one_line_error(runner.invoke(app, ["emit", str(plan_path), "-o", str(plan_path), "--force"]))
    assert "the plan itself" in line
    line = _one_line_error(runner.invoke(app, ["plan", "mlp", *TINY_MLP, "--device", "cpu", "--budget", "1GiB",
                                               "--out", str(plan_path), "--emit", str(plan_path), "--force"]))
    assert "same file" in line
    assert json.loads(plan_path.read_text())["format"] == 1


def test_a_selective_plan_file_reads_back_into_a_module(tmp_path):
    plan_path, module = tmp_path / "plan.json", tmp_path / "ckpt.py"
    # for a CUDA GPU: priced on its roofline, keeping op outputs pays off at this size (on the CPU, not),
    # at a budget where a selective plan beats the block-level one (at a quarter of the activations cut,
    # the block-level plan is the cheapest)
    options = {**TINY_OVERRIDES["gpt2"], "n_layer": 6}
    unplanned = estimate(resolve_workload("gpt2", 4, options), StepConfig(optimizer="sgd"), "cuda")
    budget = int(unplanned.peak_bytes - 0.5 * unplanned.breakdown.activations)
    result = runner.invoke(app, ["plan", "gpt2", "-b", "4", *(f"--set={k}={v}" for k, v in options.items()), "-o", "sgd",
                                 "--device", "cuda", "--selective", "--budget", str(budget), "--out", str(plan_path),
                                 "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)  # what it recomputes, and the least any plan could (memplan.recompute_bound)
    assert 0 < payload["recompute_bound_seconds"] <= payload["recompute_seconds"]
    kept = [op for s in json.loads(plan_path.read_text())["segments"] for op in s["saved_ops"]]
    assert kept  # op-level policies, which the plan file must carry through
    result = runner.invoke(app, ["emit", str(plan_path), "-o", str(module), "--json"])
    assert result.exit_code == 0, result.output
    assert all(op.split(".")[1] in module.read_text() for op in kept)


def test_help_into_a_pipe_closed_early_exits_without_a_traceback():
    """`memplan verify --help | head -2`: the reader goes away mid-help; no traceback, a non-zero exit."""
    import subprocess
    from pathlib import Path

    process = subprocess.Popen([sys.executable, "-m", "cli.main", "verify", "--help"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={"COLUMNS": "80", "PATH": ""},
                               cwd=Path(__file__).resolve().parents[1])
    process.stdout.readline()
    process.stdout.close()  # as head does after its lines
    stderr = process.stderr.read().decode()
    assert process.wait(timeout=120) != 0
    assert "Traceback" not in stderr, stderr
