"""Kimi K3 directories (model_type "kimi_k3") load into the Kimi Linear backbone when K3's additions are
off or exact (SiTU with the SwiGLU beta): the directory `attnres convert --to mlx` writes comes back
bit for bit; each addition the backbone lacks is refused by name (attnres.hf.kimi.k3)."""

import json

import pytest
import torch

pytest.importorskip("transformers")

from attnres.hf.convert import ConversionError
from attnres.hf.kimi import convert_kimi_linear
from attnres.model import AttnResLM, ModelConfig
from attnres.serving.mlx import save_mlx


@pytest.fixture(scope="module")
def k3_dir(tmp_path_factory):
    torch.manual_seed(0)
    config = ModelConfig(
        backbone="kimi_linear",
        vocab_size=64,
        d_model=32,
        n_layers=4,
        n_heads=2,
        max_seq_len=32,
        moe_experts=4,
        moe_top_k=2,
        residual="block",
        attnres_block_size=4,
    )
    lm = AttnResLM(config).eval()
    with torch.no_grad():
        lm.residual.queries.normal_(0.0, 0.5)
        lm.residual.key_norm_weight.uniform_(0.5, 1.5)
    return lm, save_mlx(lm, tmp_path_factory.mktemp("k3") / "k3")


def test_a_k3_directory_loads_bit_for_bit(k3_dir):
    lm, path = k3_dir
    assert json.loads((path / "config.json").read_text())["model_type"] == "kimi_k3"
    model = convert_kimi_linear(path)
    assert model.config.model_config().block_size == lm.config.block_size
    ours, theirs = lm.state_dict(), model.model.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, lm(ids))


@pytest.mark.parametrize(
    "field, value",
    [
        ("activation_situ_beta", 1.0),
        ("activation_situ_linear_beta", 2.0),
        ("linear_attn_config.use_full_rank_gate", True),
        ("linear_attn_config.gate_lower_bound", -5.0),
        ("mla_use_output_gate", True),
        ("routed_expert_hidden_size", 16),
        ("moe_layer_freq", 2),
    ],
)
def test_k3_additions_are_refused_by_name(k3_dir, tmp_path, field, value):
    _, path = k3_dir
    data = json.loads((path / "config.json").read_text())
    text = data["text_config"]
    if field.startswith("linear_attn_config."):
        text["linear_attn_config"][field.split(".", 1)[1]] = value
    else:
        text[field] = value
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(ConversionError, match=f"{field}={value!r}") as info:
        convert_kimi_linear(tmp_path)
    assert "\n" not in str(info.value)


def test_attnres_convert_takes_a_k3_directory(k3_dir, tmp_path):
    from attnres.cli import main
    from attnres.hf import AttnResForCausalLM

    lm, path = k3_dir
    assert main(["convert", str(path), str(tmp_path / "hf"), "--to", "hf"]) == 0
    model = AttnResForCausalLM.from_pretrained(str(tmp_path / "hf"))
    assert all(torch.equal(v, model.model.state_dict()[k]) for k, v in lm.state_dict().items())
