"""The CLI through typer's CliRunner: tables, JSON schemas, exit codes."""

import json

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
    ]:
        result = runner.invoke(app, args)
        assert result.exit_code == 1, (args, result.output)
        assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1
