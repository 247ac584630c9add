"""Tiny LLaMA-family source models and the eps-compensation analysis aid, for tests/hf."""

import torch

from attnres.residual import source_plan

SMALL = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=48,
)


def tiny_source(arch: str, seed: int = 0, **overrides):
    """A random-initialised LLaMA-family causal LM built from its config (nothing is downloaded)."""
    import transformers

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[arch]
    torch.manual_seed(seed)
    return model_cls(config_cls(**{**SMALL, **overrides})).eval()


def source_counts(model_config):
    """K_l: how many sources each sublayer's norm (and, last, the final norm) averages at init."""
    return [
        complete + int(partial) for complete, partial in source_plan(model_config.n_sublayers, model_config.block_size)
    ]


def compensate_eps(hf_model):
    """Set each norm's eps to eps / K_l^2 in place: RMSNorm(S / K) with eps / K^2 equals
    RMSNorm(S) with eps, so this removes the only inexact part of a conversion (analysis aid;
    not persisted by save_pretrained)."""
    lm = hf_model.model
    cfg = lm.config
    counts = source_counts(cfg) if cfg.residual != "prenorm" else [1] * (cfg.n_sublayers + 1)
    for i, block in enumerate(lm.blocks):
        block.attn_norm.eps = cfg.norm_eps / counts[2 * i] ** 2
        block.mlp_norm.eps = cfg.norm_eps / counts[2 * i + 1] ** 2
    lm.norm.eps = cfg.norm_eps / counts[-1] ** 2
    return hf_model
