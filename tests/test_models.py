"""The bundled model zoo: published parameter counts, tiny CPU training steps, meta and fake-tensor builds."""

import time

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from memplan.errors import BadInput
from models import TINY_OVERRIDES, ZOO, zoo_names

# Stated here as well as in the zoo, so that a wrong number in the zoo cannot pass as its own reference.
PUBLISHED = {
    "gpt2": 124_439_808,
    "gpt2-medium": 354_823_168,
    "gpt2-large": 774_030_080,
    "gpt2-xl": 1_557_611_200,
    "bert-base": 109_483_778,
    "bert-large": 335_143_938,
    "resnet18": 11_689_512,
    "resnet50": 25_557_032,
    "vit-b16": 86_567_656,
    "llama2-7b": 6_738_415_616,
    "llama2-13b": 13_015_864_320,
    "llama2-70b": 68_976_648_192,
    "llama3-8b": 8_030_261_248,
}
FAMILIES = ["gpt2", "bert", "llama", "resnet", "vit", "mlp", "unet", "lstm"]
ONE_PER_FAMILY = [next(n for n in zoo_names() if ZOO[n].family == f) for f in FAMILIES]


def n_params(model):
    return sum(p.numel() for p in model.parameters())


def run(model, inputs):
    return model(**inputs) if isinstance(inputs, dict) else model(*inputs)


def loss_of(output):
    """The loss the planner would backpropagate: the model's own, else the mean of its logits."""
    if isinstance(output, dict):
        return output["loss"]
    return output if output.ndim == 0 else output.float().mean()


def test_zoo_has_every_name_and_family():
    assert set(PUBLISHED) | {"mlp", "unet", "lstm"} == set(zoo_names())
    assert sorted({e.family for e in ZOO.values()}) == sorted(FAMILIES)
    assert set(TINY_OVERRIDES) == set(zoo_names())
    for name, entry in ZOO.items():
        assert entry.name == name
        assert entry.published_params == PUBLISHED.get(name)


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_param_count_on_meta_matches_published(name):
    entry = ZOO[name]
    with torch.device("meta"):
        model, inputs = entry.build(entry.default_batch_size)
    assert n_params(model) == PUBLISHED[name]
    assert model.training
    tensors = inputs.values() if isinstance(inputs, dict) else inputs
    assert all(t.device.type == "meta" and t.shape[0] == entry.default_batch_size for t in tensors)


def test_llama2_70b_builds_instantly_on_meta():
    start = time.perf_counter()
    with torch.device("meta"):
        ZOO["llama2-70b"].build(1)
    assert time.perf_counter() - start < 2.0


@pytest.mark.parametrize("name", zoo_names())
def test_tiny_forward_backward_on_cpu(name):
    torch.manual_seed(0)
    model, inputs = ZOO[name].build(2, **TINY_OVERRIDES[name])
    loss = loss_of(run(model, inputs))
    assert loss.ndim == 0 and torch.isfinite(loss)
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing, f"no gradient for {missing}"


@pytest.mark.parametrize("device", ["meta", "fake"])
@pytest.mark.parametrize("name", ONE_PER_FAMILY)
def test_tiny_builds_and_runs_without_data(name, device):
    with FakeTensorMode() if device == "fake" else torch.device("meta"):
        model, inputs = ZOO[name].build(2, **TINY_OVERRIDES[name])
        loss = loss_of(run(model, inputs))
        loss.backward()
    assert loss.ndim == 0
    assert isinstance(loss, FakeTensor) if device == "fake" else loss.device.type == "meta"


def test_overrides_shape_inputs_and_config():
    with torch.device("meta"):
        model, (idx, _) = ZOO["llama3-8b"].build(3, seq_len=128, n_layer=1)
        assert idx.shape == (3, 128) and len(model.layers) == 1
        _, (images,) = ZOO["resnet50"].build(4, image_size=64)
        assert images.shape == (4, 3, 64, 64)
        _, inputs = ZOO["bert-base"].build(2)
        assert inputs["input_ids"].shape == (2, 512) and inputs["labels"].shape == (2,)


def test_unknown_override_is_bad_input():
    with pytest.raises(BadInput, match=r"unknown option 'foo' for gpt2; expected one of seq_len, block_size"):
        ZOO["gpt2"].build(1, foo=3)
    with pytest.raises(BadInput, match="unknown option 'seq_len' for resnet18"):
        ZOO["resnet18"].build(1, seq_len=3)


def test_sequence_longer_than_position_table_is_rejected():
    with torch.device("meta"), pytest.raises(ValueError, match="exceeds block_size 1024"):
        ZOO["gpt2"].build(1, seq_len=2048)
