"""Architectures memplan was not built on: Hugging Face models at tiny sizes, each one training step's
predicted peak (memplan.estimate) against the CPU allocator's own events (memplan.verify.measure).

    pip install transformers   # not a memplan dependency; models are built from configs, nothing is downloaded
    python benchmarks/hf_architectures.py [--models t5,mixtral,...] [--precisions fp32,bf16] [--optimizer adamw]
                                          [--grad-accum 1]
                                          [--plan 0.7 [--batch 16]]

One row per model and precision: the predicted and measured peaks, the error, each phase's difference
(predicted - measured, bytes), the ops whose data-dependent results the estimate assumed, and the updates
the real step's GradScaler skipped (inf/NaN gradients at every loss scale: the optimizer state is never
made, which the estimate, blind to values, assumes is). Random layer skipping (layerdrop) is off: the
estimate assumes every layer runs.

--plan FRACTION: instead, a selective checkpoint plan (memplan.selective.plan_selective, priced on the CPU)
for a budget of FRACTION of the predicted unplanned peak of the model built with `use_cache=False`
(as one trains with checkpoints; see without_cache): the plan's predicted peak, the peak the CPU
allocator measures on the planned model, whether the planned model's fp32 gradients equal eager's
(dropout included, the same seed), its recompute FLOPs %, the planning time and what it checkpoints.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from tabulate import tabulate

from memplan.estimate import estimate
from memplan.selective import plan_selective
from memplan.step import StepConfig
from memplan.verify import gradients_equal, measure
from memplan.workload import Workload

BATCH, SEQ, VOCAB = 2, 32, 256
SMALL = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
         "vocab_size": VOCAB, "max_position_embeddings": 128}
Build = Callable[[int], tuple[Any, dict]]


def _tokens(*shape: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, shape)


def _language(model: str, config: str, small: bool = True, **options: Any) -> Build:
    """A (causal or masked) language model whose labels are its inputs."""

    def build(batch_size: int = BATCH) -> tuple[Any, dict]:
        import transformers

        settings = {**(SMALL if small else {}), **options}
        tokens = _tokens(batch_size, SEQ)
        return getattr(transformers, model)(getattr(transformers, config)(**settings)), {"input_ids": tokens,
                                                                                         "labels": tokens}

    return build


def _seq2seq(model: str, config: str, **options: Any) -> Build:
    def build(batch_size: int = BATCH) -> tuple[Any, dict]:
        import transformers

        made = getattr(transformers, model)(getattr(transformers, config)(**{**SMALL, **options}))
        return made, {"input_ids": _tokens(batch_size, SEQ), "labels": _tokens(batch_size, 16)}

    return build


def _image_classifier(model: str, config: str, size: int = 32, **options: Any) -> Build:
    def build(batch_size: int = BATCH) -> tuple[Any, dict]:
        import transformers

        made = getattr(transformers, model)(getattr(transformers, config)(
            **{**SMALL, "image_size": size, "num_labels": 10, **options}))
        return made, {"pixel_values": torch.randn(batch_size, 3, size, size),
                      "labels": torch.randint(0, 10, (batch_size,))}

    return build


def _whisper(batch_size: int = BATCH) -> tuple[Any, dict]:
    import transformers

    config = transformers.WhisperConfig(
        d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=16, max_source_positions=50, vocab_size=VOCAB,
        decoder_start_token_id=1, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return transformers.WhisperForConditionalGeneration(config), {
        "input_features": torch.randn(batch_size, 16, 100), "labels": _tokens(batch_size, 12)}


def _wav2vec2(batch_size: int = BATCH) -> tuple[Any, dict]:
    import transformers

    config = transformers.Wav2Vec2Config(
        **{**SMALL, "vocab_size": 32}, conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
        num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, mask_time_prob=0.0, feat_extract_norm="group",
        ctc_loss_reduction="mean", layerdrop=0.0)
    return transformers.Wav2Vec2ForCTC(config), {"input_values": torch.randn(batch_size, 4000),
                                                 "labels": torch.randint(1, 32, (batch_size, 20))}


def _segformer(batch_size: int = BATCH) -> tuple[Any, dict]:
    import transformers

    config = transformers.SegformerConfig(
        num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32], num_attention_heads=[1, 2],
        patch_sizes=[7, 3], strides=[4, 2], decoder_hidden_size=32, num_labels=5)
    return transformers.SegformerForSemanticSegmentation(config), {
        "pixel_values": torch.randn(batch_size, 3, 64, 64), "labels": torch.randint(0, 5, (batch_size, 64, 64))}


def _autoformer(batch_size: int = BATCH) -> tuple[Any, dict]:
    import transformers

    config = transformers.AutoformerConfig(
        prediction_length=8, context_length=16, lags_sequence=[1, 2], d_model=32, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
        num_time_features=1)
    past = 16 + 2  # the context and the largest lag
    return transformers.AutoformerForPrediction(config), {
        "past_values": torch.randn(batch_size, past), "past_time_features": torch.randn(batch_size, past, 1),
        "past_observed_mask": torch.ones(batch_size, past), "future_values": torch.randn(batch_size, 8),
        "future_time_features": torch.randn(batch_size, 8, 1)}


def _vision_only(settings: dict) -> dict:
    return {key: value for key, value in settings.items() if key != "vocab_size"}


def _clip(batch_size: int = BATCH) -> tuple[Any, dict]:
    import transformers

    config = transformers.CLIPConfig(
        text_config=dict(SMALL), projection_dim=32,
        vision_config={**_vision_only(SMALL), "image_size": 32, "patch_size": 8})
    return transformers.CLIPModel(config), {"input_ids": _tokens(batch_size, 16),
                                            "pixel_values": torch.randn(batch_size, 3, 32, 32), "return_loss": True}


def _model(model: str, config: str, inputs: Callable[[int], dict], **settings: Any) -> Build:
    """Any model class and config from `settings` alone, fed `inputs(batch_size)`."""

    def build(batch_size: int = BATCH) -> tuple[Any, dict]:
        import transformers

        return getattr(transformers, model)(getattr(transformers, config)(**settings)), inputs(batch_size)

    return build


def _speech(batch_size: int) -> dict:
    return {"input_values": torch.randn(batch_size, 4000), "labels": torch.randint(1, 32, (batch_size, 20))}


def _text(length: int) -> Callable[[int], dict]:
    def inputs(batch_size: int) -> dict:
        tokens = _tokens(batch_size, length)
        return {"input_ids": tokens, "labels": tokens}

    return inputs


MODELS: dict[str, Build] = {
    "t5": _seq2seq("T5ForConditionalGeneration", "T5Config", d_model=64, d_ff=128, num_layers=2, num_heads=4,
                   d_kv=16, decoder_start_token_id=0),
    "bart": _seq2seq("BartForConditionalGeneration", "BartConfig", d_model=64, encoder_layers=2, decoder_layers=2,
                     encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128),
    "mixtral": _language("MixtralForCausalLM", "MixtralConfig", num_key_value_heads=2, num_local_experts=4,
                         num_experts_per_tok=2),
    "qwen2": _language("Qwen2ForCausalLM", "Qwen2Config", num_key_value_heads=2),
    "gemma": _language("GemmaForCausalLM", "GemmaConfig", num_key_value_heads=2, head_dim=16),
    "phi": _language("PhiForCausalLM", "PhiConfig"),
    "gpt_neox": _language("GPTNeoXForCausalLM", "GPTNeoXConfig"),
    "bloom": _language("BloomForCausalLM", "BloomConfig", n_layer=2, n_head=4),
    "opt": _language("OPTForCausalLM", "OPTConfig", ffn_dim=128, word_embed_proj_dim=64),
    "falcon": _language("FalconForCausalLM", "FalconConfig"),
    "mamba": _language("MambaForCausalLM", "MambaConfig", state_size=8),
    "deberta_v2": _language("DebertaV2ForMaskedLM", "DebertaV2Config", relative_attention=True,
                            pos_att_type=["p2c", "c2p"]),
    "reformer": _language("ReformerModelWithLMHead", "ReformerConfig", attention_head_size=16, axial_pos_embds=False,
                          attn_layers=["lsh", "local"], is_decoder=True, feed_forward_size=128, num_buckets=4,
                          lsh_attn_chunk_length=8, local_attn_chunk_length=8),
    "fnet": _language("FNetForMaskedLM", "FNetConfig", use_tpu_fourier_optimizations=False),
    "roformer": _language("RoFormerForMaskedLM", "RoFormerConfig"),
    "xlnet": _language("XLNetLMHeadModel", "XLNetConfig", small=False, vocab_size=VOCAB, d_model=64, n_layer=2,
                       n_head=4, d_inner=128),
    "funnel": _language("FunnelForMaskedLM", "FunnelConfig", small=False, vocab_size=VOCAB, block_sizes=[1, 1],
                        d_model=64, n_head=4, d_head=16, d_inner=128),
    "swin": _image_classifier("SwinForImageClassification", "SwinConfig", embed_dim=16, depths=[1, 1],
                              num_attention_heads=[2, 2], window_size=4, patch_size=2),
    "convnext": _image_classifier("ConvNextForImageClassification", "ConvNextConfig", hidden_sizes=[16, 32],
                                  depths=[1, 1]),
    "mobilevit": _image_classifier("MobileViTForImageClassification", "MobileViTConfig", hidden_sizes=[32, 48, 64],
                                   neck_hidden_sizes=[8, 8, 16, 16, 24, 32, 64]),
    "deit": _image_classifier("DeiTForImageClassification", "DeiTConfig", patch_size=8),
    "whisper": _whisper,
    "wav2vec2": _wav2vec2,
    "segformer": _segformer,
    "autoformer": _autoformer,
    "vit_mae": _model("ViTMAEForPreTraining", "ViTMAEConfig", lambda b: {"pixel_values": torch.randn(b, 3, 32, 32)},
                      **SMALL, image_size=32, patch_size=8, decoder_hidden_size=32, decoder_num_hidden_layers=1,
                      decoder_num_attention_heads=2, decoder_intermediate_size=64),
    "clip": _clip,
    "dinov2": _image_classifier("Dinov2ForImageClassification", "Dinov2Config", patch_size=8),
    "gptj": _model("GPTJForCausalLM", "GPTJConfig", _text(SEQ), n_embd=64, n_layer=2, n_head=4, rotary_dim=8,
                   vocab_size=VOCAB, n_positions=128),
    "gpt_bigcode": _model("GPTBigCodeForCausalLM", "GPTBigCodeConfig", _text(SEQ), n_embd=64, n_layer=2, n_head=4,
                          vocab_size=VOCAB, n_positions=128, multi_query=True),
    "bigbird": _model("BigBirdForMaskedLM", "BigBirdConfig", _text(64), **SMALL, attention_type="block_sparse",
                      block_size=4, num_random_blocks=2),
    "longformer": _model("LongformerForMaskedLM", "LongformerConfig", _text(SEQ), **SMALL, attention_window=8),
    "hubert": _model("HubertForCTC", "HubertConfig", _speech, **{**SMALL, "vocab_size": 32}, conv_dim=(16, 16),
                     conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
                     num_conv_pos_embedding_groups=4, mask_time_prob=0.0, layerdrop=0.0),
    "perceiver": _model("PerceiverForMaskedLM", "PerceiverConfig",
                        lambda b: {"inputs": _tokens(b, 64), "labels": _tokens(b, 64)}, num_latents=16, d_latents=64,
                        d_model=64, num_blocks=1, num_self_attends_per_block=2, num_self_attention_heads=4,
                        num_cross_attention_heads=4, vocab_size=VOCAB, max_position_embeddings=64),
    "timesformer": _model("TimesformerForVideoClassification", "TimesformerConfig",
                          lambda b: {"pixel_values": torch.randn(b, 4, 3, 16, 16), "labels": torch.randint(0, 5, (b,))},
                          **_vision_only(SMALL), image_size=16, patch_size=8, num_frames=4, num_labels=5),
    "jamba": _model("JambaForCausalLM", "JambaConfig", _text(SEQ), **SMALL, num_key_value_heads=2, num_experts=4,
                    num_experts_per_tok=2, expert_layer_period=2, expert_layer_offset=1, attn_layer_period=2,
                    attn_layer_offset=0, mamba_d_state=8, use_mamba_kernels=False),
    "recurrent_gemma": _model("RecurrentGemmaForCausalLM", "RecurrentGemmaConfig", _text(SEQ),
                              **{**SMALL, "num_hidden_layers": 3}, lru_width=64, attention_window_size=16,
                              num_key_value_heads=1, block_types=["recurrent", "attention"]),
    # added 2026-12-01: more decoders, encoders and vision models of transformers 5
    "llama": _language("LlamaForCausalLM", "LlamaConfig"),
    "mistral": _language("MistralForCausalLM", "MistralConfig", num_key_value_heads=2, sliding_window=16),
    "gpt2": _language("GPT2LMHeadModel", "GPT2Config", small=False, n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB,
                      n_positions=64),
    "bert": _language("BertForMaskedLM", "BertConfig"),
    "roberta": _language("RobertaForMaskedLM", "RobertaConfig"),
    "electra": _language("ElectraForMaskedLM", "ElectraConfig", embedding_size=32),
    "albert": _language("AlbertForMaskedLM", "AlbertConfig", embedding_size=32),
    "distilbert": _language("DistilBertForMaskedLM", "DistilBertConfig", small=False, dim=64, n_layers=2, n_heads=4,
                            hidden_dim=128, vocab_size=VOCAB),
    "mpt": _language("MptForCausalLM", "MptConfig", small=False, d_model=64, n_heads=4, n_layers=2, vocab_size=VOCAB,
                     max_seq_len=128),
    "gemma2": _language("Gemma2ForCausalLM", "Gemma2Config", head_dim=16, num_key_value_heads=2, sliding_window=16),
    "gemma3": _language("Gemma3ForCausalLM", "Gemma3TextConfig", head_dim=16, num_key_value_heads=2, sliding_window=16),
    "qwen3": _language("Qwen3ForCausalLM", "Qwen3Config", head_dim=16, num_key_value_heads=2),
    "qwen3_moe": _language("Qwen3MoeForCausalLM", "Qwen3MoeConfig", head_dim=16, num_key_value_heads=2, num_experts=4,
                           num_experts_per_tok=2, moe_intermediate_size=32),
    "phi3": _language("Phi3ForCausalLM", "Phi3Config", num_key_value_heads=2, pad_token_id=0),
    "stablelm": _language("StableLmForCausalLM", "StableLmConfig", num_key_value_heads=2),
    "cohere": _language("CohereForCausalLM", "CohereConfig", num_key_value_heads=2),
    "olmo": _language("OlmoForCausalLM", "OlmoConfig", pad_token_id=0),
    "olmo2": _language("Olmo2ForCausalLM", "Olmo2Config", pad_token_id=0),
    "olmoe": _language("OlmoeForCausalLM", "OlmoeConfig", pad_token_id=0, num_experts=4, num_experts_per_tok=2),
    "granite": _language("GraniteForCausalLM", "GraniteConfig"),
    "modernbert": _language("ModernBertForMaskedLM", "ModernBertConfig", pad_token_id=0, bos_token_id=1,
                            eos_token_id=2, cls_token_id=1, sep_token_id=2, global_attn_every_n_layers=2,
                            local_attention=16),
    "codegen": _language("CodeGenForCausalLM", "CodeGenConfig", small=False, n_embd=64, n_layer=2, n_head=4,
                         vocab_size=VOCAB, n_positions=64, rotary_dim=8),
    "gpt_neo": _language("GPTNeoForCausalLM", "GPTNeoConfig", num_layers=2, attention_types=[[["global", "local"], 1]],
                         window_size=16),
    "xglm": _language("XGLMForCausalLM", "XGLMConfig", small=False, d_model=64, num_layers=2, attention_heads=4,
                      ffn_dim=128, vocab_size=VOCAB),
    "starcoder2": _language("Starcoder2ForCausalLM", "Starcoder2Config", num_key_value_heads=2),
    "nemotron": _language("NemotronForCausalLM", "NemotronConfig", num_key_value_heads=2, head_dim=16),
    "glm": _language("GlmForCausalLM", "GlmConfig", num_key_value_heads=2, head_dim=16, pad_token_id=0),
    "mamba2": _language("Mamba2ForCausalLM", "Mamba2Config", small=False, hidden_size=64, num_hidden_layers=2,
                        vocab_size=VOCAB, num_heads=8, head_dim=16, n_groups=1, state_size=16, chunk_size=16, expand=2),
    "falcon_mamba": _language("FalconMambaForCausalLM", "FalconMambaConfig", small=False, hidden_size=64,
                              num_hidden_layers=2, vocab_size=VOCAB, state_size=8),
    "deepseek_v3": _language("DeepseekV3ForCausalLM", "DeepseekV3Config", num_key_value_heads=4, q_lora_rank=32,
                             kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                             n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                             first_k_dense_replace=1, n_group=1, topk_group=1),
    "resnet": _image_classifier("ResNetForImageClassification", "ResNetConfig", embedding_size=16, hidden_sizes=[16, 32],
                                depths=[1, 1], layer_type="basic"),
    "beit": _image_classifier("BeitForImageClassification", "BeitConfig", patch_size=8, use_relative_position_bias=True),
    "levit": _image_classifier("LevitForImageClassification", "LevitConfig", size=64, hidden_sizes=[32, 48, 64],
                               num_attention_heads=[1, 2, 2], depths=[1, 1, 1], key_dim=[8, 8, 8]),
    "poolformer": _image_classifier("PoolFormerForImageClassification", "PoolFormerConfig",
                                    hidden_sizes=[16, 32, 48, 64], depths=[1, 1, 1, 1]),
    "mobilenet_v2": _image_classifier("MobileNetV2ForImageClassification", "MobileNetV2Config", depth_multiplier=0.25),
    "focalnet": _image_classifier("FocalNetForImageClassification", "FocalNetConfig", embed_dim=16, depths=[1, 1],
                                  num_heads=[1, 2]),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--optimizer", default="adamw")
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--plan", type=float, default=None, metavar="FRACTION")
    parser.add_argument("--batch", type=int, default=None, help="the batch size (default: each model's own, 2)")
    args = parser.parse_args()
    unknown = [name for name in args.models.split(",") if name not in MODELS]
    if unknown:
        parser.error(f"unknown model {unknown[0]!r}; expected some of: {', '.join(MODELS)}")
    if args.grad_accum < 1:
        parser.error(f"--grad-accum must be at least 1, got {args.grad_accum}")
    if args.plan is not None and not 0 < args.plan <= 1:
        parser.error(f"--plan takes a fraction of the unplanned peak in (0, 1], got {args.plan}")
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    try:
        import transformers
    except ImportError:
        parser.error("needs Hugging Face transformers (pip install transformers)")

    transformers.logging.set_verbosity_error()
    if args.plan is not None:
        plans(args)
        return
    rows, exact, compared = [], 0, 0
    for name in args.models.split(","):
        for precision in args.precisions.split(","):
            started = time.perf_counter()
            workload = Workload(name, MODELS[name], args.batch, {})
            config = StepConfig(precision=precision, optimizer=args.optimizer, grad_accum=args.grad_accum, steps=2)
            try:
                predicted = estimate(workload, config, device="cpu")
                measured = measure(workload, config, device="cpu")
            except Exception as error:  # noqa: BLE001 - a row says what failed, the others still run
                rows.append([name, precision, "-", "-", "-", f"{type(error).__name__}: {str(error)[:80]}", "", "", ""])
                continue
            compared += 1
            differences = {phase: predicted.phase_peaks.get(phase, 0) - measured.phase_peaks.get(phase, 0)
                           for phase in measured.phase_peaks}
            exact += predicted.peak_bytes == measured.measured_peak_bytes and not any(differences.values())
            error = 100 * (predicted.peak_bytes - measured.measured_peak_bytes) / measured.measured_peak_bytes
            rows.append([name, precision, predicted.peak_bytes, measured.measured_peak_bytes, f"{error:+.3f}",
                         " ".join(f"{phase[0]}{diff:+d}" for phase, diff in differences.items()),
                         ",".join(predicted.approximate_ops), measured.skipped_updates or "",
                         f"{time.perf_counter() - started:.1f}"])
    print(tabulate(rows, headers=["model", "precision", "predicted B", "measured B", "error %",
                                  "phase differences B (f/b/o)", "assumed ops", "skipped updates", "s"]))
    print(f"\n{exact}/{compared} compared rows exact in every phase")


def without_cache(build: Build) -> Build:
    """The model as one trains it with checkpoints: `use_cache=False`, as transformers' own gradient
    checkpointing forces and as memplan's planner asks (a layer that stores into its cache cannot be
    recomputed, so the planner leaves it out)."""

    def built(batch_size: int = BATCH) -> tuple[Any, dict]:
        model, inputs = build(batch_size)
        if hasattr(getattr(model, "config", None), "use_cache"):
            model.config.use_cache = False
        return model, inputs

    return built


def plans(args: argparse.Namespace) -> None:
    rows, exact, fitted, tried = [], 0, 0, 0
    for name in args.models.split(","):
        for precision in args.precisions.split(","):
            workload = Workload(name, without_cache(MODELS[name]), args.batch, {})
            config = StepConfig(precision=precision, optimizer=args.optimizer, grad_accum=args.grad_accum, steps=2)
            try:
                unplanned = estimate(workload, config, device="cpu")
                budget = int(args.plan * unplanned.peak_bytes)
                started = time.perf_counter()
                result = plan_selective(workload, config, budget, device="cpu")
                seconds = time.perf_counter() - started
                plan = result.plan
                measured = measure(workload, config, device="cpu", plan=plan).measured_peak_bytes if plan.feasible else None
                grads = "-" if not plan.feasible or precision != "fp32" else "yes" if gradients_equal(workload, plan) else "NO"
            except Exception as error:  # noqa: BLE001 - a row says what failed, the others still run
                rows.append([name, precision, "-", "-", "-", "-", "-", "-", f"{type(error).__name__}: {str(error)[:80]}"])
                continue
            tried += 1
            fitted += plan.feasible and measured <= budget
            exact += measured == plan.predicted_peak_bytes
            flops = 100 * plan.recompute_flops / unplanned.step_flops
            rows.append([name, precision, unplanned.peak_bytes, budget,
                         plan.predicted_peak_bytes if plan.feasible else f"no fit ({plan.predicted_peak_bytes})",
                         "-" if measured is None else measured, grads, "-" if not plan.feasible else f"{flops:.1f}",
                         f"{seconds:.1f}", " ".join(_segment(s) for s in plan.segments)])
    print(tabulate(rows, headers=["model", "precision", "unplanned B", "budget B", "planned predicted B", "measured B",
                                  "grads = eager", "FLOPs %", "plan s", "segments (module: full, or how many ops kept)"]))
    print(f"\n{fitted}/{tried} plans fit the budget as measured, {exact} measured as predicted")


def _segment(segment) -> str:
    modules = segment.modules[0] if len(segment.modules) == 1 else f"{segment.modules[0]}..{segment.modules[-1]}"
    return f"{modules}:{'full' if segment.policy == 'full' else len(segment.saved_ops)}"


if __name__ == "__main__":
    main()
