"""Tiny random configs of every decoder family the retrofit wraps (no downloads), with every weight
perturbed like a trained checkpoint (non-zero biases, norm weights away from one, routers off uniform)."""

from __future__ import annotations

import torch

VOCAB, WINDOW = 97, 8
_BASE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
_LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24)
_SLIDING = ["sliding_attention", "full_attention", "sliding_attention"]

# case name -> (model_type, config options, retrofit options)
CASES: dict[str, tuple[str, dict, dict]] = {
    "llama": ("llama", {}, {}),
    "llama_tied": ("llama", dict(tie_word_embeddings=True), {}),
    "llama3": ("llama", dict(rope_parameters=_LLAMA3, attention_bias=True, mlp_bias=True), {}),
    "mistral": ("mistral", dict(sliding_window=None), {}),
    "mistral_window": ("mistral", dict(sliding_window=WINDOW), {}),
    "ministral": ("ministral", dict(head_dim=8, sliding_window=WINDOW, layer_types=_SLIDING), {}),
    "qwen2": ("qwen2", {}, {}),
    "qwen3": ("qwen3", dict(head_dim=8), {}),
    "qwen3_moe": ("qwen3_moe", dict(head_dim=8, **_MOE), {}),
    "qwen2_moe": ("qwen2_moe", dict(shared_expert_intermediate_size=24, **_MOE), {}),
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW), {}),
    "deepseek_v3": (
        "deepseek_v3",
        dict(
            num_key_value_heads=4,
            kv_lora_rank=16,
            q_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            moe_intermediate_size=24,
            n_shared_experts=1,
            rope_interleave=True,
        ),
        {},
    ),
    "gpt_oss": (
        "gpt_oss",
        dict(
            num_local_experts=4,
            num_experts_per_tok=2,
            head_dim=8,
            sliding_window=WINDOW,
            layer_types=_SLIDING,
            intermediate_size=32,
        ),
        {},
    ),
    "gemma": ("gemma", dict(head_dim=8), {}),
    "gemma2": (
        "gemma2",
        dict(
            head_dim=8,
            sliding_window=WINDOW,
            attn_logit_softcapping=20.0,
            final_logit_softcapping=10.0,
            query_pre_attn_scalar=8,
        ),
        {},
    ),
    "gemma3_text": (
        "gemma3_text",
        dict(
            head_dim=8,
            sliding_window=WINDOW,
            layer_types=_SLIDING,
            final_logit_softcapping=10.0,
            query_pre_attn_scalar=8,
        ),
        {},
    ),
    "phi3": ("phi3", dict(), {}),
    "granite": (
        "granite",
        dict(embedding_multiplier=3.0, residual_multiplier=0.4, logits_scaling=2.5, attention_multiplier=0.3),
        {},
    ),
    "smollm3": ("smollm3", dict(no_rope_layer_interval=2), {}),
    "helium": ("helium", dict(head_dim=8), {}),
    "ernie4_5": ("ernie4_5", dict(head_dim=8), {}),
    "seed_oss": ("seed_oss", dict(head_dim=8), {}),
    "arcee": ("arcee", {}, {}),
    "glm4": ("glm4", dict(head_dim=8), {}),
    "starcoder2": ("starcoder2", dict(sliding_window=WINDOW), {}),
    "stablelm": ("stablelm", dict(use_parallel_residual=False, qk_layernorm=True), {}),
    "stablelm_parallel": ("stablelm", dict(use_parallel_residual=True), {}),
    "gpt_neox": ("gpt_neox", dict(use_parallel_residual=True, rotary_pct=0.25), {}),
    "gpt_neox_sequential": ("gpt_neox", dict(use_parallel_residual=False), {}),
    "phi": ("phi", dict(partial_rotary_factor=0.5), {}),
    "cohere": ("cohere", dict(logit_scale=0.5), {}),
    "gptj": ("gptj", dict(rotary_dim=4), {}),
    "gpt2": ("gpt2", {}, {}),
    "olmo2": ("olmo2", {}, dict(rescale_reads=True)),
    "olmo": ("olmo", {}, dict(rescale_reads=True)),
}

# names some configs spell their own way
_RENAME = {
    "gpt2": dict(
        hidden_size="n_embd",
        num_hidden_layers="n_layer",
        num_attention_heads="n_head",
        max_position_embeddings="n_positions",
        intermediate_size="n_inner",
    ),
    "gptj": dict(
        hidden_size="n_embd",
        num_hidden_layers="n_layer",
        num_attention_heads="n_head",
        max_position_embeddings="n_positions",
        intermediate_size="n_inner",
    ),
}
_DROP = {
    "gpt2": ("num_key_value_heads",),
    "gptj": ("num_key_value_heads",),
    "gpt_neox": ("num_key_value_heads",),
    "phi": (),
    "olmo": (),
}


def tiny_config(case: str):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type, options, _ = CASES[case]
    kwargs = {k: v for k, v in _BASE.items() if k not in _DROP.get(model_type, ())}
    for old, new in _RENAME.get(model_type, {}).items():
        kwargs[new] = kwargs.pop(old)
    config = CONFIG_MAPPING[model_type](**{**kwargs, **options})
    config._attn_implementation = "eager"
    return config


@torch.no_grad()
def tiny_model(case: str, seed: int = 0, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(case)).to(dtype).eval()
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.add_(torch.randn(p.shape, generator=gen, dtype=torch.float64).to(dtype) * (0.1 if p.dim() == 1 else 0.04))
    return model


def retrofit_options(case: str) -> dict:
    return dict(CASES[case][2])
