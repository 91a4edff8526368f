"""The bundled model zoo: each name maps to a builder of (model, example inputs)."""

import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

from torch import nn

from memplan.errors import BadInput
from models import bert, gpt2, llama, lstm, mlp, resnet, unet, vit


@dataclass(frozen=True)
class ZooEntry:
    name: str
    family: str
    build: Callable[..., tuple[nn.Module, tuple | dict]]  # build(batch_size, **overrides) -> (model, inputs)
    default_batch_size: int
    input_desc: str
    published_params: int | None


def _entry(name: str, family: ModuleType, default_batch_size: int, input_desc: str,
           published_params: int | None = None) -> ZooEntry:
    """Wrap family.build(config, batch_size, **input_options) into build(batch_size, **overrides).

    An override is either one of family.build's input options (seq_len, image_size) or a config field.
    """
    config = family.CONFIGS[name]
    input_options = [p for p in inspect.signature(family.build).parameters if p not in ("config", "batch_size")]
    allowed = input_options + [f.name for f in dataclasses.fields(config)]

    def build(batch_size: int, **overrides):
        for key in overrides:
            if key not in allowed:
                raise BadInput(f"unknown option {key!r} for {name}; expected one of {', '.join(allowed)}")
        inputs = {k: v for k, v in overrides.items() if k in input_options}
        fields = {k: v for k, v in overrides.items() if k not in input_options}
        return family.build(dataclasses.replace(config, **fields), batch_size, **inputs)

    family_name = family.__name__.rpartition(".")[2]
    return ZooEntry(name, family_name, build, default_batch_size, input_desc, published_params)


ZOO: dict[str, ZooEntry] = {e.name: e for e in [
    _entry("gpt2", gpt2, 8, "1024 tokens", 124_439_808),
    _entry("gpt2-medium", gpt2, 8, "1024 tokens", 354_823_168),
    _entry("gpt2-large", gpt2, 8, "1024 tokens", 774_030_080),
    _entry("gpt2-xl", gpt2, 8, "1024 tokens", 1_557_611_200),
    _entry("bert-base", bert, 16, "512 tokens", 109_483_778),
    _entry("bert-large", bert, 16, "512 tokens", 335_143_938),
    _entry("llama2-7b", llama, 1, "4096 tokens", 6_738_415_616),
    _entry("llama2-13b", llama, 1, "4096 tokens", 13_015_864_320),
    _entry("llama2-70b", llama, 1, "4096 tokens", 68_976_648_192),
    _entry("llama3-8b", llama, 1, "8192 tokens", 8_030_261_248),
    _entry("resnet18", resnet, 32, "3x224x224", 11_689_512),
    _entry("resnet50", resnet, 32, "3x224x224", 25_557_032),
    _entry("vit-b16", vit, 32, "3x224x224", 86_567_656),
    _entry("mlp", mlp, 64, "784 features"),
    _entry("unet", unet, 8, "3x128x128"),
    _entry("lstm", lstm, 32, "256 tokens"),
]}


def zoo_names() -> list[str]:
    return list(ZOO)


# Overrides that shrink each model to CPU-test size (forward+backward well under a second)
# while keeping its structure: same block types, grouped-query attention where the original has it.
_TINY_GPT2 = {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 512, "block_size": 64, "seq_len": 32}
_TINY_BERT = {"n_layer": 2, "n_embd": 64, "n_head": 4, "ffn_dim": 128, "vocab_size": 512, "max_positions": 64, "seq_len": 32}
_TINY_LLAMA = {"n_layer": 2, "n_embd": 64, "n_head": 4, "ffn_dim": 128, "vocab_size": 512, "seq_len": 32}
_TINY_LLAMA_GQA = dict(_TINY_LLAMA, n_kv_head=2)
_TINY_RESNET = {"width": 16, "num_classes": 10, "image_size": 32}

TINY_OVERRIDES: dict[str, dict] = {
    "gpt2": _TINY_GPT2,
    "gpt2-medium": _TINY_GPT2,
    "gpt2-large": _TINY_GPT2,
    "gpt2-xl": _TINY_GPT2,
    "bert-base": _TINY_BERT,
    "bert-large": _TINY_BERT,
    "llama2-7b": dict(_TINY_LLAMA, n_kv_head=4),
    "llama2-13b": dict(_TINY_LLAMA, n_kv_head=4),
    "llama2-70b": _TINY_LLAMA_GQA,
    "llama3-8b": _TINY_LLAMA_GQA,
    "resnet18": _TINY_RESNET,
    "resnet50": _TINY_RESNET,
    "vit-b16": {"image_size": 32, "patch_size": 8, "n_layer": 2, "n_embd": 64, "n_head": 4, "ffn_dim": 128, "num_classes": 10},
    "mlp": {"in_features": 64, "hidden_size": 128, "num_classes": 10},
    "unet": {"base_channels": 8, "depth": 2, "image_size": 32},
    "lstm": {"vocab_size": 512, "n_embd": 32, "hidden_size": 64, "seq_len": 32},
}
