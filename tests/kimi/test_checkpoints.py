"""Kimi Linear checkpoints: exactness against transformers (attnres bench kimi), the released AttnRes
layout of docs/method.md §10 against an independent transcription of its schedule, the round trip,
rejected parts, and attnres convert."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import attnres.hf  # noqa: F401  (registers the Auto classes)
from attnres.bench.kimi import KimiBenchConfig, format_table, run
from attnres.hf import ConversionError, convert_kimi_linear, save_kimi_linear

# float32 rounding bound (transformers' RMSNorm and KDA compute in float32 whatever the dtype): logits
# are O(1), float32's unit roundoff is 6e-8; the measured figures are 2e-7 .. 6e-7 (README, Kimi Linear)
FLOAT32_BOUND = 5e-6


def test_exact_against_transformers_and_cached_decoding():
    """Prenorm is transformers' Kimi Linear bit for bit; Block/Full with zero queries agree to float32
    rounding; cached decoding (hybrid cache) agrees with the full forward to the same bound."""
    result = run(KimiBenchConfig(seq_len=8, cases=["3:1, MoE", "1:1, dense"]))
    for case, row in result["rows"].items():
        assert row["max_abs_logit"] > 0.3, case  # not a degenerate model
        assert row["prenorm"] == 0.0, case
        for key in ("block", "full", "prenorm_cached", "block_cached", "full_cached"):
            assert 0 <= row[key] < FLOAT32_BOUND, (case, key, row[key])
    assert "| 3:1, MoE | KKKM | 4 |" in format_table(result)


# ----------------------------------------------------------------------------- the §10 layout

N_LAYERS, B = 7, 3  # uneven: depth blocks of 3, 3 and 1 layers (S = 6 sublayers, the last block 2)


def released_checkpoint(path, pattern, seed=0, prefix=""):
    """A §10 checkpoint built without our code: transformers' KimiLinearForCausalLM (random float64
    weights), saved by transformers, plus attn_res_block_size and random non-zero depth-attention
    weights written straight into the files."""
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    layer_types = [
        "linear_attention" if pattern[i % len(pattern)] == "K" else "full_attention" for i in range(N_LAYERS)
    ]
    config = KimiLinearConfig(
        vocab_size=48,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=N_LAYERS,
        num_attention_heads=2,
        num_key_value_heads=2,
        layer_types=layer_types,
        mlp_layer_types=["dense"] + ["sparse"] * (N_LAYERS - 1),
        linear_num_heads=2,
        linear_head_dim=8,
        kv_lora_rank=8,
        q_lora_rank=None,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=8,
        n_group=1,
        topk_group=1,
        max_position_embeddings=32,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
    )
    config._experts_implementation = "eager"  # transformers' grouped_mm has no float64
    torch.manual_seed(seed)
    model = KimiLinearForCausalLM(config).double()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.05)
    model.save_pretrained(str(path))
    tensors = load_file(str(path / "model.safetensors"))
    d = config.hidden_size
    for name in [f"model.layers.{i}.{site}" for i in range(N_LAYERS) for site in ("self_attention_res", "mlp_res")] + [
        "model.output_attn_res"
    ]:
        tensors[f"{name}_proj.weight"] = torch.randn(1, d, generator=g, dtype=torch.float64)
        tensors[f"{name}_norm.weight"] = 1 + 0.3 * torch.randn(d, generator=g, dtype=torch.float64)
    tensors = {prefix + k: v.contiguous() for k, v in tensors.items()}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    data = json.loads((path / "config.json").read_text())
    data["attn_res_block_size"] = B
    (path / "config.json").write_text(json.dumps(data))
    return model, tensors


@torch.no_grad()
def transcription(model, tensors, ids):
    """docs/method.md §10's schedule, step by step, over transformers' sublayers and norms."""
    eps = model.config.rms_norm_eps

    def read(sources, name):
        proj, norm = tensors[f"{name}_proj.weight"][0], tensors[f"{name}_norm.weight"]
        v = torch.stack(sources)
        scores = (v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + eps) * norm * proj).sum(-1)
        return (torch.softmax(scores, dim=0).unsqueeze(-1) * v).sum(0)

    sealed, r = [], tensors["model.embed_tokens.weight"][ids]
    for i, layer in enumerate(model.model.layers):
        x = r if not sealed else read(sealed + [r], f"model.layers.{i}.self_attention_res")
        if i % B == 0:
            sealed, r = sealed + [r], None
        h = layer.input_layernorm(x)
        out = (
            layer.self_attn(h, attention_mask=None)
            if layer.block_type == "linear_attention"
            else layer.self_attn(h, attention_mask=None)[0]
        )
        r = out if r is None else r + out
        r = r + layer.mlp(layer.post_attention_layernorm(read(sealed + [r], f"model.layers.{i}.mlp_res")))
    return model.lm_head(model.model.norm(read(sealed + [r], "model.output_attn_res")))


@pytest.mark.parametrize("pattern", ["M", "KKKM"])
def test_released_layout_equals_the_transcribed_schedule(tmp_path, pattern):
    from transformers import AutoModelForCausalLM

    reference, tensors = released_checkpoint(tmp_path, pattern)
    ids = torch.randint(0, 48, (3, 10), generator=torch.Generator().manual_seed(3))
    expected = transcription(reference.eval(), tensors, ids)
    ours = convert_kimi_linear(tmp_path)
    c = ours.config.model_config()
    assert (c.residual, c.block_size, c.num_blocks, c.attnres_scale_norm_eps) == ("block", 6, 3, False)
    got = ours(ids).logits
    auto = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float64)
    assert type(auto).__name__ == "AttnResForCausalLM"
    torch.testing.assert_close(auto(ids).logits, got, rtol=0, atol=0)
    # float64 throughout; the float32 inside transformers' norms (and KDA) sees the same inputs up to
    # float64 rounding, so the agreement is float64-tight (measured: 0.0, bit-identical, on both patterns)
    assert (got - expected).abs().max().item() <= 1e-10
    # the depth weights are not uniform: a PreNorm retrofit of the same sublayers gives other logits
    assert (got - reference(ids).logits).abs().max().item() > 1e-3


def test_layout_round_trip_is_bit_exact_with_prefix(tmp_path):
    _, tensors = released_checkpoint(tmp_path / "src", "KKKM", prefix="language_model.")
    ours = convert_kimi_linear(tmp_path / "src")
    save_kimi_linear(ours, tmp_path / "out", language_model=True)
    written = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(written) == set(tensors)
    for name, t in tensors.items():
        assert written[name].dtype == t.dtype and torch.equal(written[name], t), name
    assert json.loads((tmp_path / "out" / "config.json").read_text())["attn_res_block_size"] == B
    again = convert_kimi_linear(tmp_path / "out")
    for (n, a), (m, b) in zip(ours.state_dict().items(), again.state_dict().items(), strict=True):
        assert n == m and torch.equal(a, b), n


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda c, t: c.update(hidden_act="gelu"), r"activation 'gelu' \(hidden_act='gelu'\)"),
        (lambda c, t: c.update(quantization_config={"quant_method": "fp8"}), r"quantised weights \('fp8'\)"),
        (lambda c, t: c.update(moe_router_activation_func="softmax"), r"router activation 'softmax'"),
        (lambda c, t: c.update(num_expert_group=2), r"grouped expert routing \(num_expert_group=2\)"),
        (
            lambda c, t: t.update({"vision_tower.patch_embed.weight": torch.zeros(2, 2)}),
            r"no place for .*\['vision_tower.patch_embed.weight'\]",
        ),
        (
            lambda c, t: t.update({"model.layers.1.mlp.experts.down_proj": torch.zeros(4, 16, 8, dtype=torch.int8)}),
            r"model.layers.1.mlp.experts.down_proj is a torch.int8 tensor \(quantised weights\)",
        ),
        (
            lambda c, t: t.pop("model.output_attn_res_norm.weight"),
            r"lacks depth-attention weights: "
            r"\['model.output_attn_res_norm.weight'\]",
        ),
    ],
)
def test_unimplemented_parts_are_rejected_by_name(tmp_path, edit, match):
    released_checkpoint(tmp_path, "KM")
    config = json.loads((tmp_path / "config.json").read_text())
    tensors = load_file(str(tmp_path / "model.safetensors"))
    edit(config, tensors)
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ConversionError, match=match) as e:
        convert_kimi_linear(tmp_path)
    assert "\n" not in str(e.value)
