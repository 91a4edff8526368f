"""memplan.report: the dominant category line, module grouping, and the plots (each format, one and two panels)."""

import importlib.util
from pathlib import Path

import pytest

from memplan.errors import BadInput
from memplan.estimate import Breakdown, Estimate, estimate
from memplan.gpus import gpu_spec
from memplan.report import (
    CUDA_CONTEXT_BYTES,
    check_plot_path,
    dominant,
    module_group,
    panel,
    plot_timelines,
    usable_bytes,
)
from memplan.step import StepConfig
from memplan.workload import resolve_workload
from models import TINY_OVERRIDES

needs_matplotlib = pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is None, reason="matplotlib is not installed (pip install 'memplan[plot]')"
)


def _estimate(breakdown: Breakdown, top_modules=()) -> Estimate:
    return Estimate(
        model="m", precision="fp32", optimizer="sgd", batch_size=1, grad_accum=1, device="cuda",
        peak_bytes=sum(breakdown.as_dict().values()), reserved_bytes=None, peak_phase="backward",
        breakdown=breakdown, phase_peaks={}, first_step_peak_bytes=0, later_steps_peak_bytes=None, step_flops=0,
        top_modules=tuple(top_modules), approximate=False,
    )


@pytest.mark.parametrize("path, group", [
    ("h.3.attn", "h.*"), ("layers.10", "layers.*"), ("encoder.layer.11.attention.self", "encoder.layer.*"),
    ("0.conv", "*"), ("conv1", "conv1"), ("lm_head", "lm_head"), ("", "(top level)"),
])
def test_module_group_merges_numbered_siblings(path, group):
    assert module_group(path) == group


def test_dominant_groups_blocks_and_says_when_it_saw_every_module():
    result = _estimate(Breakdown(weights=20, activations=60, temporaries=20),
                       [("h.0.attn", 21), ("h.1.mlp", 21), ("lm_head", 18)])
    line = dominant(result)
    assert (line.category, line.share_pct, line.module_group, line.module_share_pct) == ("activations", 60, "h.*", 70)
    assert line.describe() == "peak in backward: activations 60%, of which h.* 70%"
    partial = dominant(_estimate(Breakdown(activations=100), [("h.0", 30), ("h.1", 20)]))
    assert partial.describe() == "peak in backward: activations 100%, of which h.* at least 50%"
    assert dominant(_estimate(Breakdown(weights=3, optimizer_state=6, activations=1))).describe() == (
        "peak in backward: optimizer state 60%"
    )


def test_usable_memory_leaves_the_cuda_context():
    assert usable_bytes(gpu_spec("rtx4090")) == 24563 * 2**20 - CUDA_CONTEXT_BYTES


def test_plot_path_must_be_a_known_format(tmp_path):
    with pytest.raises(BadInput, match=r"\.png, \.svg, \.html"):
        check_plot_path(tmp_path / "x.jpg")
    with pytest.raises(BadInput, match="directory not found"):
        check_plot_path(tmp_path / "missing" / "x.png")


def test_missing_matplotlib_is_bad_input(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.partition(".")[0] == "matplotlib":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(BadInput, match=r"plots need matplotlib: pip install 'memplan\[plot\]'"):
        check_plot_path(tmp_path / "x.png")


@pytest.fixture(scope="module")
def tiny_estimate():
    workload = resolve_workload("gpt2", 2, dict(TINY_OVERRIDES["gpt2"]))
    return estimate(workload, StepConfig(optimizer="sgd"), device="cpu", with_timeline=True)


@needs_matplotlib
@pytest.mark.parametrize("name, signature", [
    ("one.png", b"\x89PNG\r\n\x1a\n"), ("one.svg", b"<svg"), ("one.html", b"<!DOCTYPE html>"),
])
def test_plot_writes_each_format(tmp_path, tiny_estimate, name, signature):
    path = plot_timelines(tmp_path / name, [panel("fp32, sgd", tiny_estimate)], "tiny gpt2",
                          budget_bytes=2**21, gpu=gpu_spec("t4"))
    data = Path(path).read_bytes()
    assert signature in data[:512]
    assert [p.name for p in tmp_path.iterdir()] == [name]  # no temporary file left behind
    if name.endswith(".html"):
        assert b"<?xml" not in data and b"</svg>" in data


@needs_matplotlib
def test_plot_two_panels_is_wider(tmp_path, tiny_estimate):
    import struct

    one = plot_timelines(tmp_path / "one.png", [panel("a", tiny_estimate)], "t")
    two = plot_timelines(tmp_path / "two.png", [panel("a", tiny_estimate), panel("b", tiny_estimate)], "t")
    width = [struct.unpack(">I", Path(p).read_bytes()[16:20])[0] for p in (one, two)]  # IHDR width
    assert width[1] > 1.8 * width[0]


def test_panel_needs_a_timeline(tiny_estimate):
    with pytest.raises(ValueError, match="with_timeline"):
        panel("x", _estimate(Breakdown(weights=1)))
