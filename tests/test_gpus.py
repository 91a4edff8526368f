"""The GPU registry and the roofline estimate."""

from dataclasses import replace

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import SAC_IGNORED_OPS

from memplan.errors import BadInput
from memplan.gpus import GPUS, GpuSpec, gpu_spec, peak_flops, supports_precision
from memplan.step import PRECISIONS, StepConfig
from memplan.timing import CPU, bytes_moved, op_seconds, time_model
from memplan.trace import trace_step
from memplan.workload import Workload


@pytest.mark.parametrize(
    "name, expected",
    [
        ("H100", "H100-80GB"),
        ("h100", "H100-80GB"),
        ("a100-80gb", "A100-80GB"),
        ("A100_40GB", "A100-40GB"),
        ("rtx4090", "RTX-4090"),
        ("RTX 3090", "RTX-3090"),
        ("t4", "T4"),
        # what torch.cuda.get_device_name() says
        ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
        ("NVIDIA H100 80GB HBM3", "H100-80GB"),
        ("NVIDIA GeForce RTX 4090", "RTX-4090"),
        ("Tesla V100-SXM2-16GB", "V100-16GB"),
        ("Tesla T4", "T4"),
        ("NVIDIA H200", "H200"),
    ],
)
def test_lookup_by_name_and_alias(name, expected):
    assert gpu_spec(name).name == expected


def test_every_name_and_alias_finds_its_own_entry():
    for spec in GPUS.values():
        for name in (spec.name, *spec.aliases):
            assert gpu_spec(name) is spec


def test_registry_entries_are_sane():
    for spec in GPUS.values():
        assert isinstance(spec.capacity_bytes, int) and 14 * 2**30 < spec.capacity_bytes <= 141 * 2**30
        assert spec.capacity_bytes % 2**20 == 0  # whole MiB, as torch and nvidia-smi report them
        assert (7, 0) <= spec.compute_capability <= (9, 0)
        assert spec.fp16_flops > spec.fp32_flops  # tensor cores
        assert (spec.bf16_flops is None) == (spec.compute_capability < (8, 0))
    assert GPUS["A100-80GB"].capacity_bytes == 80 * 2**30
    assert GPUS["H200"].capacity_bytes == 143156 * 2**20


def test_unknown_gpu_names_close_matches():
    with pytest.raises(BadInput, match="A100-40GB or A100-80GB"):
        gpu_spec("a100")  # ambiguous: both cards are suggested
    with pytest.raises(BadInput, match="unknown GPU 'banana'; known: V100-16GB"):
        gpu_spec("banana")


def test_roofline_compute_bound():
    # 624 TFLOP of bf16 matmuls at 312 TFLOP/s = 2 s; moving 2039 GB at 2039 GB/s would take only 1 s
    assert time_model("a100-80gb", "amp-bf16").seconds(624e12, 2039e9) == pytest.approx(2.0)
    # the same work in fp32: 624e12 / 19.5e12 = 32 s
    assert time_model("a100-80gb", "fp32").seconds(624e12, 2039e9) == pytest.approx(32.0)


def test_roofline_bandwidth_bound():
    h100 = time_model("h100", "fp32")
    # 6.7 TB at 3.35 TB/s = 2 s; 67 TFLOP of fp32 would take 1 s
    assert h100.seconds(67e12, 6.7e12) == pytest.approx(2.0)
    assert h100.seconds(0, 0) == 0.0


def test_formats_a_card_lacks_run_at_the_fp32_rate():
    t4 = gpu_spec("t4")
    assert peak_flops(t4, "tf32") == peak_flops(t4, "fp32") == 8.1e12
    assert peak_flops(gpu_spec("v100-16gb"), "bf16") == 15.7e12
    assert peak_flops(t4, "amp-fp16") == 65e12
    assert peak_flops(gpu_spec("h100"), "tf32") == 494.5e12  # 989 "with sparsity" halved


def test_roofline_rejects_negative_work():
    with pytest.raises(BadInput):
        time_model("l4").seconds(-1, 0)


def test_precision_warnings():
    assert "8.0+" in supports_precision(gpu_spec("v100-16gb"), "amp-bf16")
    assert "8.0+" in supports_precision(gpu_spec("t4"), "bf16")
    assert "TF32" in supports_precision(gpu_spec("t4"), "tf32")
    assert supports_precision(gpu_spec("t4"), "amp-fp16") is None
    assert supports_precision(gpu_spec("a100-40gb"), "bf16") is None
    pascal = GpuSpec("P100", 16 * 2**30, (6, 0), 9.3e12, None, 18.7e12, None, 732e9)
    assert "7.0+" in supports_precision(pascal, "fp16")
    with pytest.raises(BadInput, match="unknown precision"):
        supports_precision(gpu_spec("t4"), "fp8")


def test_every_memplan_precision_is_understood():
    for name in PRECISIONS:
        supports_precision(gpu_spec("a100-80gb"), name)
        peak_flops(gpu_spec("a100-80gb"), name)


def test_time_models():
    h100 = time_model("h100", "amp-bf16")
    assert h100.seconds(989.5e12, 0) == pytest.approx(1.0)  # the roofline: the larger of the two times
    assert h100.seconds(989.5e12, 3.35e12) == pytest.approx(1.0)
    cpu = time_model("CPU")
    assert cpu is CPU and cpu.serial
    # on the CPU compute, memory and dispatch add up
    assert cpu.seconds(int(cpu.flops_per_s), int(cpu.bytes_per_s)) == pytest.approx(2.0 + cpu.seconds_per_op)
    with pytest.raises(BadInput, match="unknown GPU"):
        time_model("tpu")


def test_allocating_uninitialised_memory_moves_no_bytes():
    """Dropout on the CPU makes its mask with empty_like, then fills it with bernoulli_: only the
    filling moves memory, so recomputing a dropout is priced by what it writes, not twice that."""
    def build(batch_size=4):
        return nn.Sequential(nn.Linear(256, 256), nn.Dropout(0.1)), (torch.randn(batch_size, 256),)

    trace = trace_step(Workload("dropout", build, None, {}), StepConfig(steps=1))
    forward = {op.name: op for op in trace.ops if op.phase == "forward"}
    mask = forward["aten.empty_like.default"]
    assert mask.allocates and bytes_moved(trace, mask) == 0
    assert bytes_moved(trace, forward["aten.bernoulli_.float"]) == 4 * 256 * 4  # the mask it fills


def test_metadata_queries_are_not_ops_of_the_step():
    """Fake tensors, a tensor subclass, send `.device` and size queries through the tracer's mode, where
    a plain tensor answers them in C++ without a dispatch (checkpointing's policies ignore them too): they
    are not recorded, so they cost no time and shift no op positions."""
    def build(batch_size=4):
        return nn.Sequential(nn.Linear(16, 16), nn.ReLU()), (torch.randn(batch_size, 16),)

    trace = trace_step(Workload("mlp", build, None, {}), StepConfig(steps=1))
    assert not {op.name for op in trace.ops} & {str(query) for query in SAC_IGNORED_OPS if query != torch.ops.aten.detach.default}
    assert [op.name for op in trace.ops if op.phase == "forward"] == [
        "aten.t.default", "aten.addmm.default", "aten.relu.default", "aten.mean.default"]
    relu = next(op for op in trace.ops if op.name == "aten.relu.default")
    assert op_seconds(relu, trace, CPU) >= CPU.seconds_per_op > 0


def test_gelu_is_priced_by_its_form():
    """GELU's tanh form (GPT-2's) computes about 3x as long per element as its erf form on a CPU
    (benchmarks/cpu_calibration.py): the trace keeps which form ran, and the CPU model prices each by its
    own measured rate; a GPU's roofline, bound by bandwidth for both, prices them alike."""
    def build(approximate):
        return lambda batch_size=1024: (nn.Sequential(nn.Linear(256, 256), nn.GELU(approximate=approximate)),
                                     (torch.randn(batch_size, 256),))

    seconds = {}
    for form in ("none", "tanh"):
        trace = trace_step(Workload("mlp", build(form), None, {}), StepConfig(steps=1))
        gelu = next(op for op in trace.ops if op.name == "aten.gelu.default")
        assert gelu.variant == ("" if form == "none" else "tanh")
        seconds[form] = (op_seconds(gelu, trace, CPU), op_seconds(gelu, trace, time_model("h100")))
    assert seconds["tanh"][0] > 2 * seconds["none"][0]
    assert seconds["tanh"][1] == seconds["none"][1]
    # a form nobody measured is priced as its op
    unmeasured = replace(CPU, seconds_per_output_byte={k: v for k, v in CPU.seconds_per_output_byte.items()
                                                        if k != "aten.gelu.default[tanh]"})
    assert op_seconds(gelu, trace, unmeasured) == seconds["none"][0]
