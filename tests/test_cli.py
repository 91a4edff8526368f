"""The CLI through typer's CliRunner: tables, JSON schemas, exit codes."""

import importlib.util
import json

import pytest
from typer.testing import CliRunner

import memplan
from cli.main import app
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
    ]:
        result = runner.invoke(app, args)
        assert result.exit_code == 1, (args, result.output)
        assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1


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
    for key, kind in [("predicted_peak_bytes", int), ("unplanned_peak_bytes", int), ("predicted_peak_phase", str),
                      ("unplanned_peak_phase", str), ("recompute_flops", int), ("step_flops", int),
                      ("recompute_overhead_pct", float), ("segments", list), ("excluded", list),
                      ("alternatives", list), ("method", str)]:
        assert isinstance(payload[key], kind), key


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
