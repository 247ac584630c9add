"""An independent oracle: mlx-lm's ``kimi_k3`` (Apple's implementation of the released K3) runs the
directory attnres.serving.mlx.save_mlx writes, on the same ids as our model; float32 logits agree to
1e-4. Skipped without mlx (``pip install 'attnres[mlx]'``; ``make test-serving`` runs it)."""

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm.models.kimi_k3")

from attnres.model import AttnResLM, ModelConfig
from attnres.serving.k3 import ServingError
from attnres.serving.mlx import mlx_logits, save_mlx

TOLERANCE = 1e-4


def tiny(seed: int, **overrides) -> AttnResLM:
    fields = dict(
        backbone="kimi_linear",
        vocab_size=96,
        d_model=32,
        n_layers=4,
        n_heads=2,
        d_ff=64,
        max_seq_len=32,
        init_std=0.1,
        moe_experts=4,
        moe_top_k=2,
        moe_shared_experts=1,
        residual="block",
        attnres_block_size=4,
    )
    fields.update(overrides)
    if fields["residual"] != "block":
        fields.pop("attnres_block_size")
    torch.manual_seed(seed)
    lm = AttnResLM(ModelConfig(**fields)).eval()
    with torch.no_grad():  # non-zero depth weights and balancing biases, so that every part acts
        if lm.config.residual == "block":
            lm.residual.queries.normal_(0.0, 0.5)
            lm.residual.key_norm_weight.uniform_(0.5, 1.5)
        for block in lm.blocks:
            if block.is_moe:
                block.mlp.gate.e_score_correction_bias.normal_(0.0, 0.05)
            block.attn_norm.weight.uniform_(0.5, 1.5)
    return lm


@pytest.mark.parametrize(
    "overrides",
    [
        dict(),  # 3 KDA : 1 MLA, MoE + shared, B = 2
        dict(kimi_layer_pattern="KM", mla_q_rank=16, attnres_block_size=2, moe_shared_experts=2),  # B = 1
        dict(kimi_layer_pattern="M", moe_experts=0, residual="prenorm", tie_embeddings=True),  # MLA, dense
        dict(kimi_layer_pattern="K", kda_heads=4, kda_head_dim=8, attnres_block_size=8),  # one depth block
    ],
    ids=["kkkm-moe", "km-qrank-b1", "mla-prenorm-tied", "kda-one-block"],
)
def test_mlx_kimi_k3_matches_ours(tmp_path, overrides):
    _compare(tmp_path, tiny(0, **overrides), overrides or {"kimi_layer_pattern": "KKKM"})


K3_OPTIONS = {
    "situ": dict(situ_beta=1.0),
    "situ-linear-beta": dict(situ_beta=2.0, situ_linear_beta=3.0),
    "kda-full-rank-gate": dict(kda_full_rank_gate=True),
    "kda-gate-lower-bound": dict(kda_gate_lower_bound=-5.0),
    "mla-output-gate": dict(mla_output_gate=True, mla_q_rank=16),
    "latent-moe": dict(moe_latent_dim=16),
    "latent-moe-norm": dict(moe_latent_dim=16, moe_latent_norm=True),
    "moe-layer-freq": dict(moe_layer_freq=2, moe_dense_layers=0, n_layers=6, attnres_block_size=6),
    "grouped-routing": dict(moe_experts=8, moe_groups=4, moe_topk_groups=2, moe_top_k=3, moe_routed_scale=2.5),
}
K3_OPTIONS["all"] = {k: v for options in K3_OPTIONS.values() for k, v in options.items()}


@pytest.mark.parametrize("overrides", K3_OPTIONS.values(), ids=K3_OPTIONS.keys())
def test_mlx_kimi_k3_matches_ours_with_k3_options(tmp_path, overrides):
    """Each K3 option of the backbone (attnres.model.k3_blocks), and all of them together, against
    mlx-lm's kimi_k3 on random weights (the norms' weights drawn away from one)."""
    lm = tiny(0, **overrides)
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if name.endswith(("o_norm.weight", "routed_expert_norm.weight", "mlp_norm.weight")):
                p.uniform_(0.5, 1.5)
    _compare(tmp_path, lm, overrides)


def _compare(tmp_path, lm, overrides) -> None:
    ids = torch.randint(0, lm.config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = lm(ids)
    ours = (out if torch.is_tensor(out) else out[0]).numpy()
    theirs = mlx_logits(save_mlx(lm, tmp_path / "k3"), ids)
    assert theirs.shape == ours.shape
    assert np.abs(ours).max() > 0.5
    diff = float(np.abs(theirs - ours).max())
    print(
        f"mlx-lm kimi_k3 vs attnres, float32, {'/'.join(f'{k}={v}' for k, v in overrides.items())}: "
        f"max |logit diff| {diff:.1e} (max |logit| {np.abs(ours).max():.2f})"
    )
    assert diff <= TOLERANCE


def test_full_attnres_is_refused_by_name(tmp_path):
    with pytest.raises(ServingError, match="residual='full'"):
        save_mlx(tiny(0, residual="full"), tmp_path / "k3")


def test_cli_writes_a_directory_mlx_lm_loads(tmp_path):
    from attnres.cli import main
    from attnres.data import ByteTokenizer
    from attnres.hf import AttnResForCausalLM
    from attnres.hf.tokenizer import hf_tokenizer

    lm = tiny(1, vocab_size=256)
    AttnResForCausalLM.from_attnres_lm(lm).save_pretrained(str(tmp_path / "hf"))
    hf_tokenizer(ByteTokenizer()).save_pretrained(str(tmp_path / "hf"))
    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "mlx"), "--to", "mlx"]) == 0
    assert (tmp_path / "mlx" / "tokenizer.json").is_file()
    ids = torch.tensor([list(b"ROMEO: O")])
    with torch.no_grad():
        ours = lm(ids)
    ours = (ours if torch.is_tensor(ours) else ours[0]).numpy()
    assert np.abs(mlx_logits(tmp_path / "mlx", ids) - ours).max() <= TOLERANCE


@pytest.mark.parametrize(
    "name, key, off",
    [
        ("situ", "activation_situ_beta", 2.0**60),
        ("situ-linear-beta", "activation_situ_linear_beta", None),
        ("kda-gate-lower-bound", "linear_attn_config.gate_lower_bound", None),
        ("grouped-routing", "num_expert_group", 1),
    ],
)
def test_the_oracle_sees_each_option(tmp_path, name, key, off):
    """The comparisons above can fail: the same weights with the option switched off in config.json
    give mlx-lm logits far from ours."""
    import json

    lm = tiny(0, **K3_OPTIONS[name])
    path = save_mlx(lm, tmp_path / "k3")
    data = json.loads((path / "config.json").read_text())
    text = data["text_config"]
    if key.startswith("linear_attn_config."):
        text["linear_attn_config"].pop(key.split(".", 1)[1])
    else:
        text[key] = off
    (path / "config.json").write_text(json.dumps(data))
    ids = torch.randint(0, lm.config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = lm(ids)
    ours = (ours if torch.is_tensor(ours) else ours[0]).numpy()
    assert np.abs(mlx_logits(path, ids) - ours).max() > 1e-3
