"""The floor: a peak no checkpoint plan goes below. It must lie under every plan's peak, predicted and
measured by the CPU allocator, and be close enough to prove a budget out of reach."""

import json
import random

import pytest
import torch
from conftest import skip_unless_cpu_runs_bf16_lstm
from typer.testing import CliRunner

from cli.main import app
from memplan.emit import apply_plan
from memplan.estimate import estimate, estimate_and_trace
from memplan.planner import peak_floor, plan_checkpoints, random_plan
from memplan.selective import plan_selective
from memplan.step import StepConfig
from memplan.verify import measure
from memplan.workload import Workload, resolve_workload
from models import TINY_OVERRIDES

CONFIG = StepConfig(precision="fp32", optimizer="sgd", steps=2)
runner = CliRunner()


def test_floor_lies_under_every_plan_measured_or_predicted():
    workload = resolve_workload("resnet18", 4, {**TINY_OVERRIDES["resnet18"], "image_size": 64})
    unplanned = estimate(workload, CONFIG, device="cpu")
    plans = [plan_checkpoints(workload, CONFIG, budget, device="cpu", method=method)
             for budget in (0, int(unplanned.peak_bytes * 0.9)) for method in ("optimal-dp", "every-block")]
    floor = plans[0].floor
    assert floor is not None and floor.op.startswith("aten.") and 0 < floor.peak_bytes < unplanned.peak_bytes
    assert all(floor.peak_bytes <= result.plan.predicted_peak_bytes for result in plans)
    lowest = plans[0].plan  # budget 0: the lowest peak the planner reaches
    assert not lowest.feasible and lowest.segments
    assert floor.peak_bytes <= measure(workload, CONFIG, device="cpu", plan=lowest).measured_peak_bytes


@pytest.mark.parametrize("name", [*TINY_OVERRIDES, "tests/fixtures/user_models.py:self_attention",
                                  "tests/fixtures/user_models.py:transformer_encoder",
                                  "tests/fixtures/user_models.py:gru_conv1d"])
def test_floor_lies_under_the_unplanned_peak(name):
    """No plan is a plan too. (self_attention sums gradients in place, which the floor once counted twice.)"""
    workload = resolve_workload(name, 4, TINY_OVERRIDES.get(name, {}))
    unplanned, trace = estimate_and_trace(workload, StepConfig(precision="fp32", optimizer="adamw", steps=2), "cpu")
    assert 0 < peak_floor(trace).peak_bytes <= unplanned.peak_bytes


@pytest.mark.parametrize("name, config", [
    ("gpt2", CONFIG),
    ("llama2-7b", CONFIG),
    ("unet", CONFIG),
    ("lstm", StepConfig(precision="amp-bf16", optimizer="adamw", steps=2, grad_accum=2)),
])
def test_floor_lies_under_random_plans(name, config):
    """Any set of disjoint segments the planner could choose, at any depth, re-estimated; the first
    also measured."""
    if config.precision == "amp-bf16" and name == "lstm":
        skip_unless_cpu_runs_bf16_lstm()
    workload = resolve_workload(name, 4, TINY_OVERRIDES[name])
    unplanned, trace = estimate_and_trace(workload, config, "cpu")
    floor = peak_floor(trace)
    rng = random.Random(name)
    for trial in range(4):
        plan = random_plan(workload, config, "cpu", trace, unplanned, rng)
        planned = estimate(workload, config, "cpu", transform=lambda model, plan=plan: apply_plan(model, plan))
        assert floor.peak_bytes <= planned.peak_bytes, plan.segments
        if trial == 0 and config.precision == "fp32":
            assert floor.peak_bytes <= measure(workload, config, device="cpu", plan=plan).measured_peak_bytes


def test_floor_lies_under_a_selective_plan():
    """Kept op outputs live from forward on, recomputed ones come back with their segment: the same floor."""
    workload = resolve_workload("gpt2", 4, TINY_OVERRIDES["gpt2"])
    unplanned = estimate(workload, CONFIG, device="cpu")
    result = plan_selective(workload, CONFIG, int(0.6 * unplanned.peak_bytes), device="cpu", processor="h100",
                            baselines=())  # the DP's own plan, not the block-level one
    assert result.plan.feasible and any(segment.policy == "selective" for segment in result.plan.segments)
    measured = measure(workload, CONFIG, device="cpu", plan=result.plan).measured_peak_bytes
    assert result.floor.peak_bytes <= min(measured, result.plan.predicted_peak_bytes)


def test_floor_counts_everything_a_call_brings_back_at_once():
    """A two-layer nn.LSTM is one call no segment splits: recomputing it brings back both layers'
    saved tensors together. The floor counts them, so it lies within 3% of the lowest peak any plan
    reaches, measured (an op-by-op floor lay 38% under it)."""
    workload = resolve_workload("lstm", 4, {**TINY_OVERRIDES["lstm"], "seq_len": 128})
    lowest = plan_checkpoints(workload, CONFIG, 0, device="cpu")
    measured = measure(workload, CONFIG, device="cpu", plan=lowest.plan).measured_peak_bytes
    assert 0.97 * measured <= lowest.floor.peak_bytes <= measured


def test_floor_counts_what_a_segment_brings_back_when_a_child_first_unpacks():
    """A segment around a call recomputes all it dropped when backward first unpacks any of it: a
    tensor that only a child saved (the attention's output, which its `wo` projection saves; the
    feed-forward's gated product, which `w2` saves) brings back the call's own tensors too, and a child's
    output that a sibling saved (the norm's, which the attention's projections save) comes back with a
    segment around both. On the tiny Llama at six layers the floor lies within 20% of the lowest peak
    either planner reaches, measured (counting a call's tensors from the first read of one its own ops
    made and saved, it lay 22% under)."""
    workload = resolve_workload("llama2-7b", 8, {**TINY_OVERRIDES["llama2-7b"], "n_layer": 6})
    results = [plan_checkpoints(workload, CONFIG, 0, device="cpu"),
               plan_selective(workload, CONFIG, 0, device="cpu", baselines=())]
    lowest = min(results, key=lambda r: r.plan.predicted_peak_bytes)
    measured = measure(workload, CONFIG, device="cpu", plan=lowest.plan).measured_peak_bytes
    floor = results[0].floor.peak_bytes
    assert results[1].floor.peak_bytes == floor
    assert 0.8 * measured <= floor <= measured


def test_floor_on_a_cuda_target_counts_the_library_workspaces():
    """cuBLAS's workspace opens at each thread's first matrix product, the same op whatever the plan: on a
    tiny model it is most of the peak (without it the floor lay at 2% of the lowest plan's)."""
    workload = resolve_workload("gpt2", 4, TINY_OVERRIDES["gpt2"])
    config = StepConfig(precision="amp-bf16", optimizer="sgd", steps=2)
    lowest = plan_checkpoints(workload, config, 0, device="cuda")
    assert 0.95 * lowest.plan.predicted_peak_bytes <= lowest.floor.peak_bytes <= lowest.plan.predicted_peak_bytes


def test_a_budget_under_the_floor_is_reported_as_unreachable():
    # also: the alternatives skip micro-batch 1, which this BatchNorm model cannot run (exit 2, not a crash)
    options = [f"--set={k}={v}" for k, v in TINY_OVERRIDES["resnet18"].items()]
    result = runner.invoke(app, ["plan", "resnet18", "-b", "4", *options, "--budget", "1MiB", "--device", "cpu",
                                 "-o", "sgd", "--json"])
    assert result.exit_code == 2
    payload = json.loads(result.stdout)
    assert 2**20 < payload["peak_floor_bytes"] <= payload["predicted_peak_bytes"]
    assert "none can: at aten." in result.stderr


def test_floor_counts_what_the_optimizer_keeps_past_its_last_read():
    """A small batch under AdamW peaks in the optimizer, which no checkpoint changes: the floor is that
    peak as the allocator measures it, though a temporary there outlives its last read (it was 2,048 B
    under, and a budget between the two was called reachable and missed)."""
    measured = measure(OPTIMIZER_BOUND, ADAMW, device="cpu")
    assert measured.measured_peak_bytes == dict(measured.phase_peaks)["optimizer"]
    result = plan_checkpoints(OPTIMIZER_BOUND, ADAMW, 0, device="cpu")
    assert result.floor.peak_bytes == measured.measured_peak_bytes


@pytest.mark.parametrize("planner", [plan_checkpoints, plan_selective])
def test_where_no_plan_lowers_the_peak_the_plan_recomputes_nothing(planner):
    """A plan that peaks where no plan does (in the optimizer) is no lower than none, only slower: the
    planners returned segments there."""
    result = planner(OPTIMIZER_BOUND, ADAMW, measure(OPTIMIZER_BOUND, ADAMW, device="cpu").measured_peak_bytes - 1,
                     device="cpu")
    assert not result.plan.feasible and result.plan.segments == () and result.plan.recompute_flops == 0


def _optimizer_bound_mlp(batch_size):
    blocks = [torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU()) for _ in range(4)]
    return torch.nn.Sequential(*blocks, torch.nn.Linear(512, 10)), (torch.randn(batch_size, 512),)


OPTIMIZER_BOUND = Workload("mlp", _optimizer_bound_mlp, 2, {})
ADAMW = StepConfig(precision="fp32", optimizer="adamw", steps=2)
