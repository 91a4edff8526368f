"""The planner's closed loop: plans are judged by re-estimating the checkpointed model, and by the
CPU allocator on the emitted model."""

import json

import pytest
from typer.testing import CliRunner

from cli.main import app
from memplan.estimate import estimate
from memplan.planner import candidate_blocks, max_batch, plan_checkpoints
from memplan.estimate import estimate_and_trace
from memplan.step import StepConfig
from memplan.verify import measure
from memplan.workload import resolve_workload
from models import TINY_OVERRIDES

CONFIG = StepConfig(precision="fp32", optimizer="sgd", steps=2)
runner = CliRunner()


def _gpt(layers=6):
    return resolve_workload("gpt2", 4, {**TINY_OVERRIDES["gpt2"], "n_layer": layers})


@pytest.fixture(scope="module")
def gpt_unplanned():
    return estimate(_gpt(), CONFIG, device="cpu")


@pytest.mark.parametrize("cut", [0.25, 0.5])
def test_plan_fits_when_predicted_and_when_measured(gpt_unplanned, cut):
    budget = int(gpt_unplanned.peak_bytes - cut * gpt_unplanned.breakdown.activations)
    plan = plan_checkpoints(_gpt(), CONFIG, budget, device="cpu").plan
    assert plan.feasible and plan.predicted_peak_bytes <= budget
    assert plan.segments and plan.recompute_flops > 0
    measured = measure(_gpt(), CONFIG, device="cpu", plan=plan).measured_peak_bytes
    assert measured <= budget
    assert abs(measured - plan.predicted_peak_bytes) <= 0.01 * measured


def test_optimal_plan_costs_no_more_than_any_baseline_that_fits(gpt_unplanned):
    budget = int(gpt_unplanned.peak_bytes - 0.25 * gpt_unplanned.breakdown.activations)
    best = plan_checkpoints(_gpt(), CONFIG, budget, device="cpu").plan
    for method in ("every-block", "sqrt-n", "uniform-k"):
        baseline = plan_checkpoints(_gpt(), CONFIG, budget, device="cpu", method=method).plan
        if baseline.feasible:
            assert best.recompute_flops <= baseline.recompute_flops, method


def test_no_plan_needed_when_it_already_fits(gpt_unplanned):
    plan = plan_checkpoints(_gpt(), CONFIG, gpt_unplanned.peak_bytes, device="cpu").plan
    assert plan.feasible and plan.segments == () and plan.recompute_flops == 0


def test_batchnorm_blocks_are_excluded_with_a_reason():
    workload = resolve_workload("resnet18", 2, TINY_OVERRIDES["resnet18"])
    _, trace = estimate_and_trace(workload, CONFIG, device="cpu")
    candidates = candidate_blocks(trace)
    assert candidates.excluded and "running statistics" in candidates.excluded[0].reason
    assert not candidates.blocks


def test_chain_candidates_are_the_transformer_blocks():
    _, trace = estimate_and_trace(_gpt(4), CONFIG, device="cpu")
    blocks = candidate_blocks(trace).blocks
    assert [b.path for b in blocks] == ["h.0", "h.1", "h.2", "h.3"]
    assert all(b.saved_bytes > b.input_bytes > 0 and b.flops > 0 and b.group == "h" for b in blocks)


def test_infeasible_budget_exits_2_with_smallest_peak_and_alternatives():
    options = [f"--set={k}={v}" for k, v in {**TINY_OVERRIDES["gpt2"], "n_layer": 4}.items()]
    result = runner.invoke(app, ["plan", "gpt2", "-b", "4", *options, "--budget", "1MiB", "--device", "cpu",
                                 "-o", "adamw", "--json"])
    assert result.exit_code == 2
    payload = json.loads(result.stdout)
    assert payload["feasible"] is False and payload["budget_bytes"] == 2**20
    assert payload["predicted_peak_bytes"] > 2**20
    assert "does not fit" in result.stderr


def test_plan_json_and_files(tmp_path):
    workload = _gpt(4)
    unplanned = estimate(workload, CONFIG, device="cpu")
    budget = int(unplanned.peak_bytes - 0.3 * unplanned.breakdown.activations)
    options = [f"--set={k}={v}" for k, v in {**TINY_OVERRIDES["gpt2"], "n_layer": 4}.items()]
    out, emitted = tmp_path / "plan.json", tmp_path / "ckpt.py"
    result = runner.invoke(app, ["plan", "gpt2", "-b", "4", *options, "--budget", str(budget), "--device", "cpu",
                                 "-o", "sgd", "--out", str(out), "--emit", str(emitted), "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    for key in ("feasible", "budget_bytes", "predicted_peak_bytes", "unplanned_peak_bytes", "recompute_flops",
                "step_flops", "segments"):
        assert key in payload
    assert payload["predicted_peak_bytes"] <= budget
    assert json.loads(out.read_text())["segments"] and "def apply_checkpointing" in emitted.read_text()


def test_max_batch_is_the_largest_that_fits():
    workload = resolve_workload("mlp", 1, TINY_OVERRIDES["mlp"])
    budget = estimate(resolve_workload("mlp", 16, TINY_OVERRIDES["mlp"]), CONFIG, device="cpu").peak_bytes
    result = max_batch(workload, CONFIG, budget, device="cpu", limit=64)
    assert result.without_plan >= 16
    over = resolve_workload("mlp", result.without_plan + 1, TINY_OVERRIDES["mlp"])
    assert estimate(over, CONFIG, device="cpu").peak_bytes > budget
    assert result.with_plan >= result.without_plan
