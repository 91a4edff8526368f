"""Workload resolution: every way MODEL can be wrong gives one line on stderr and exit code 1."""

import sys

import pytest
import torch
from typer.testing import CliRunner

from cli.main import app
from memplan.errors import BadInput
from memplan.step import StepConfig, loss_of
from memplan.units import format_bytes, parse_size
from memplan.workload import Workload, parse_options, resolve_workload

FIXTURE = "tests/fixtures/user_models.py"
runner = CliRunner()


def test_file_factory_builds_with_default_and_given_batch():
    _, inputs = resolve_workload(f"{FIXTURE}:tiny").build()
    assert inputs[0].shape == (3, 8)
    workload = resolve_workload(f"{FIXTURE}:tiny", 5, {"width": 4})
    _model, inputs = workload.build()
    assert inputs[0].shape == (5, 4) and workload.effective_batch_size == 5


def test_module_factory_and_keyword_inputs():
    model, inputs = resolve_workload("tests.fixtures.user_models:keyword_inputs").build()
    assert set(inputs) == {"x", "scale"}
    assert loss_of(model(**inputs)).dim() == 0


def test_zoo_name_uses_default_batch():
    assert resolve_workload("gpt2").batch_size == 8


@pytest.mark.parametrize(
    "spec, message",
    [
        ("gtp2", "unknown model 'gtp2'; did you mean gpt2"),
        ("no/such/file.py:tiny", "model file not found: no/such/file.py"),
        ("no_such_package.module:tiny", "module not found: no_such_package.module"),
        (f"{FIXTURE}:missing", "has no 'missing'"),
        (f"{FIXTURE}:NOT_CALLABLE", "is not callable"),
        (f"{FIXTURE}:raises", "raised ValueError: config is broken"),
        (f"{FIXTURE}:wrong_return", "must return (model, inputs), got Linear"),
        (f"{FIXTURE}:not_a_module", "must return an nn.Module first, got str"),
        (f"{FIXTURE}:bad_inputs", "must return inputs as a tuple or a dict, got Tensor"),
    ],
)
def test_bad_model_gives_one_line_and_exit_1(spec, message):
    result = runner.invoke(app, ["estimate", spec, "--device", "cpu"])
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert "Traceback" not in result.output


def test_set_options_parse_types():
    assert parse_options(["seq_len=2048", "p=0.1", "flag=true", "name=x"]) == {
        "seq_len": 2048, "p": 0.1, "flag": True, "name": "x"}
    with pytest.raises(BadInput, match="KEY=VALUE"):
        parse_options(["seq_len"])


def test_unknown_factory_option_is_reported():
    result = runner.invoke(app, ["estimate", "gpt2", "--set", "colour=3", "--device", "cpu"])
    assert result.exit_code == 1 and "unknown option 'colour'" in result.stderr


def test_loss_rules():
    scalar = torch.tensor(2.0)
    assert loss_of(scalar) is scalar
    assert loss_of({"loss": scalar, "logits": torch.ones(2)}) is scalar
    assert float(loss_of((torch.full((2, 2), 3.0, dtype=torch.bfloat16),))) == 3.0
    with pytest.raises(BadInput):
        loss_of("no tensor")


@pytest.mark.parametrize(
    "text, expected",
    [("24GiB", 24 * 2**30), ("80GB", 80 * 10**9), ("512MiB", 512 * 2**20), ("1000", 1000), ("1.5 KiB", 1536)],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


def test_parse_size_rejects_garbage():
    with pytest.raises(BadInput, match="cannot read size"):
        parse_size("lots")


def test_format_bytes_binary_units():
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(3 * 2**30) == "3.00 GiB"
    assert format_bytes(12) == "12 B"


def test_the_same_file_spelled_two_ways_is_the_same_model(tmp_path, monkeypatch):
    from memplan.workload import same_model

    monkeypatch.chdir(tmp_path)
    (tmp_path / "m.py").write_text("")
    assert same_model("./m.py:f", "m.py:f") and same_model(f"{tmp_path}/m.py:f", "m.py:f")
    assert not same_model("m.py:f", "m.py:g") and not same_model("gpt2", "gpt2-medium")


def test_a_package_in_the_working_directory_is_found(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    (tmp_path / "my_models_pkg").mkdir()
    (tmp_path / "my_models_pkg" / "__init__.py").write_text(
        "import torch\ndef build(batch_size=2):\n    return torch.nn.Linear(4, 1), (torch.randn(batch_size, 4),)\n")
    workload = resolve_workload("my_models_pkg:build", 2)
    model, _ = workload.build()
    assert model.in_features == 4


def test_a_loss_that_no_gradient_reaches_is_one_clear_error():
    from memplan.estimate import estimate

    class Argmax(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 3)

        def forward(self, x):
            return self.lin(x).argmax(-1).float().mean()

    workload = Workload("argmax", lambda batch_size=2: (Argmax(), (torch.randn(batch_size, 4),)), 2, {})
    with pytest.raises(BadInput, match="no gradient"):
        estimate(workload, StepConfig(), device="cpu")
