"""GPUs memplan knows: memory, compute capability, peak throughput (memplan.timing prices ops with them).

Throughput figures are the vendors' datasheet peaks for dense math (where NVIDIA quotes tensor-core figures
"with sparsity" only, they are halved here). Where a card has no hardware path for a format (TF32 or bf16
before compute capability 8.0) its entry is None and the estimate falls back to the fp32 rate.

capacity_bytes is the total that torch.cuda.get_device_properties(i).total_memory reports (shown by torch in
MB = 2^20 bytes), as seen in public logs; where none was found, nvidia-smi's memory.total (MiB). Both vary
by a few hundred MiB with driver and ECC settings, and a "80GB" card holds at most 80 GiB: prefer the live
device's figure when there is one.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass

from memplan.errors import BadInput


@dataclass(frozen=True)
class GpuSpec:
    name: str
    capacity_bytes: int
    compute_capability: tuple[int, int]
    fp32_flops: float  # FLOP/s, CUDA cores
    tf32_flops: float | None  # tensor cores, None: no TF32 (runs as fp32)
    fp16_flops: float  # tensor cores, fp32 accumulate where the card distinguishes it (GeForce halves it)
    bf16_flops: float | None  # tensor cores, None: no bf16 hardware
    bandwidth_bytes_per_s: float
    aliases: tuple[str, ...] = ()  # other spellings; lookups also ignore case, separators and vendor prefixes


# Sources, per card (datasheet throughput; memory as torch or nvidia-smi reports it, in MiB):
# V100      Tesla V100 datasheet, SXM2: 15.7 TFLOPS fp32, 125 tensor, 900 GB/s. torch: 16160 MB
#           (Tesla V100-SXM2-16GB), 32510 MB (Tesla V100-PCIE-32GB; nvidia-smi shows the same for SXM2-32GB).
# T4        T4 datasheet: 8.1 fp32, 65 mixed fp16/fp32, 320 GB/s. torch: 15109 MB (Colab; 14930-15109 seen).
# A10       A10 datasheet: 31.2 fp32, TF32 62.5, bf16/fp16 125 (dense), 600 GB/s. nvidia-smi: 23028 MiB.
# L4        L4 datasheet: 30.3 fp32, TF32 120, fp16/bf16 242 (both sparse), 300 GB/s. nvidia-smi: 23034 MiB.
# RTX 3090  Ampere GA102 whitepaper: 35.6 fp32, TF32 35.6, fp16/bf16 with fp32 accumulate 71, 936 GB/s.
#           torch: 24268 MB.
# RTX 4090  Ada Lovelace whitepaper: 82.6 fp32, TF32 82.6, fp16/bf16 with fp32 accumulate 165.2,
#           1008 GB/s. torch: 24563 MB.
# A100      A100 datasheet, SXM: 19.5 fp32, TF32 156, bf16/fp16 312; 1555 GB/s (40GB), 2039 GB/s (80GB).
#           40536 MB (A100-SXM4-40GB); torch 81920 MB for A100-SXM4-80GB on recent drivers (older: 81251).
# H100/H200 H100 and H200 datasheets, SXM: 67 fp32, TF32 989, bf16/fp16 1979 (both sparse); 3.35 TB/s
#           HBM3 (H100), 4.8 TB/s HBM3e (H200). torch: 81090 MB (H100 80GB HBM3; 81082-81090 seen),
#           143156 MB (H200).
# fmt: off
_TABLE = (
    # name        MiB     cc      fp32   TF32   fp16   bf16   GB/s  aliases
    ("V100-16GB", 16160,  (7, 0), 15.7,  None,  125,   None,  900,  ("v100-sxm2-16gb", "v100 16gb")),
    ("V100-32GB", 32510,  (7, 0), 15.7,  None,  125,   None,  900,  ("v100-sxm2-32gb", "v100 32gb")),
    ("T4",        15109,  (7, 5), 8.1,   None,  65,    None,  320,  ()),
    ("A10",       23028,  (8, 6), 31.2,  62.5,  125,   125,   600,  ()),
    ("L4",        23034,  (8, 9), 30.3,  60,    121,   121,   300,  ()),
    ("RTX-3090",  24268,  (8, 6), 35.6,  35.6,  71,    71,    936,  ("3090",)),
    ("RTX-4090",  24563,  (8, 9), 82.6,  82.6,  165.2, 165.2, 1008, ("4090",)),
    ("A100-40GB", 40536,  (8, 0), 19.5,  156,   312,   312,   1555, ("a100-sxm4-40gb", "a100 40gb")),
    ("A100-80GB", 81920,  (8, 0), 19.5,  156,   312,   312,   2039, ("a100-sxm4-80gb", "a100 80gb")),
    ("H100-80GB", 81090,  (9, 0), 67,    494.5, 989.5, 989.5, 3350, ("h100", "h100-sxm", "h100 80gb hbm3")),
    ("H200",      143156, (9, 0), 67,    494.5, 989.5, 989.5, 4800, ("h200-sxm", "h200-141gb")),
)
# fmt: on

GPUS: dict[str, GpuSpec] = {
    name: GpuSpec(
        name=name,
        capacity_bytes=mib * 2**20,
        compute_capability=cc,
        fp32_flops=fp32 * 1e12,
        tf32_flops=None if tf32 is None else tf32 * 1e12,
        fp16_flops=fp16 * 1e12,
        bf16_flops=None if bf16 is None else bf16 * 1e12,
        bandwidth_bytes_per_s=gb_per_s * 1e9,
        aliases=aliases,
    )
    for name, mib, cc, fp32, tf32, fp16, bf16, gb_per_s, aliases in _TABLE
}

# The number format a precision's matmuls run in; both memplan's precision names and bare formats.
_MATH_FORMAT = {
    "fp32": "fp32",
    "tf32": "tf32",
    "fp16": "fp16",
    "bf16": "bf16",
    "amp-fp16": "fp16",
    "fp16-master": "fp16",
    "amp-bf16": "bf16",
}

# format -> (least compute capability, what happens below it)
_NEEDS = {
    "tf32": ((8, 0), "TF32 needs compute capability 8.0+: matmuls run in plain fp32"),
    "bf16": ((8, 0), "bf16 needs compute capability 8.0+: it is emulated, slowly, or fails; use amp-fp16"),
    "fp16": ((7, 0), "fp16 tensor cores need compute capability 7.0+: fp16 runs on CUDA cores"),
}


def _key(name: str) -> str:
    """Spelling-insensitive lookup key: 'NVIDIA GeForce RTX 4090' and 'rtx-4090' both give 'rtx4090'."""
    key = re.sub(r"[^a-z0-9]", "", name.lower())
    return re.sub(r"^(nvidia|tesla|geforce)+", "", key)


_BY_KEY = {_key(alias): g for g in GPUS.values() for alias in (g.name, *g.aliases)}


def gpu_spec(name: str) -> GpuSpec:
    """Look a GPU up by name or alias, in any case and spelling of separators."""
    spec = _BY_KEY.get(_key(name))
    if spec is None:
        # a prefix first ("a100" -> both A100s), then near spellings
        starting = [k for k in _BY_KEY if k.startswith(_key(name))] if _key(name) else []
        close = difflib.get_close_matches(_key(name), _BY_KEY, n=6, cutoff=0.6)
        guesses = list(dict.fromkeys(_BY_KEY[k].name for k in starting + close))[:4]
        hint = f" (did you mean {' or '.join(guesses)}?)" if guesses else ""
        raise BadInput(f"unknown GPU {name!r}{hint}; known: {', '.join(GPUS)}")
    return spec


def _math_format(precision: str) -> str:
    if precision not in _MATH_FORMAT:
        raise BadInput(f"unknown precision {precision!r}; expected one of: {', '.join(_MATH_FORMAT)}")
    return _MATH_FORMAT[precision]


def peak_flops(gpu: GpuSpec, precision: str) -> float:
    """Dense peak FLOP/s for matmuls in `precision`; the fp32 rate where the card lacks that format."""
    rate = {
        "fp32": gpu.fp32_flops,
        "tf32": gpu.tf32_flops,
        "fp16": gpu.fp16_flops,
        "bf16": gpu.bf16_flops,
    }[_math_format(precision)]
    return gpu.fp32_flops if rate is None else rate


def supports_precision(gpu: GpuSpec, precision: str) -> str | None:
    """A warning when the GPU lacks hardware for `precision`, None when it is fine."""
    need = _NEEDS.get(_math_format(precision))
    if need is None or gpu.compute_capability >= need[0]:
        return None
    major, minor = gpu.compute_capability
    return f"{gpu.name} has compute capability {major}.{minor}; {need[1]}"
