"""Kimi K3 directories (model_type "kimi_k3") load into the Kimi Linear backbone with K3's options
(attnres.model.k3_blocks): the directory `attnres convert --to mlx` writes comes back bit for bit, with
each option; what the backbone lacks is refused by name (attnres.hf.kimi.k3_layout)."""

import json

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from attnres.hf.convert import ConversionError
from attnres.hf.kimi import convert_kimi_linear
from attnres.model import AttnResLM, ModelConfig
from attnres.serving.mlx import save_mlx


@pytest.fixture(scope="module")
def k3_dir(tmp_path_factory):
    lm = k3_model()
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


K3_FEATURES = {
    "situ": dict(situ_beta=2.0),
    "situ-linear-beta": dict(situ_beta=1.0, situ_linear_beta=3.0),
    "kda-full-rank-gate": dict(kda_full_rank_gate=True),
    "kda-gate-lower-bound": dict(kda_gate_lower_bound=-5.0),
    "mla-output-gate": dict(mla_output_gate=True),
    "latent-moe": dict(moe_latent_dim=16, moe_latent_norm=True),
    "moe-layer-freq": dict(moe_layer_freq=2),
    "grouped-routing": dict(moe_groups=2, moe_topk_groups=1),
}


def k3_model(seed: int = 0, **options) -> AttnResLM:
    torch.manual_seed(seed)
    fields = dict(
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
    return AttnResLM(ModelConfig(**{**fields, **options})).eval()


@pytest.mark.parametrize("options", K3_FEATURES.values(), ids=K3_FEATURES.keys())
def test_each_k3_option_round_trips_through_a_k3_directory(tmp_path, options):
    lm = k3_model(**options)
    path = save_mlx(lm, tmp_path / "k3")
    model = convert_kimi_linear(path)
    back = model.config.model_config()
    assert all(getattr(back, k) == v for k, v in options.items())
    ours, theirs = lm.state_dict(), model.model.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, lm(ids))


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("hidden_act", "silu", "hidden_act='silu'"),
        ("mla_use_nope", False, "mla_use_nope=False"),
        ("num_shared_experts", 0, "num_shared_experts=0"),
        ("moe_router_activation_func", "softmax", "moe_router_activation_func='softmax'"),
        ("quantization_config", {"quant_method": "compressed-tensors"}, "quantization_config='compressed-tensors'"),
    ],
)
def test_what_the_backbone_lacks_is_refused_by_name(k3_dir, tmp_path, field, value, match):
    _, path = k3_dir
    data = json.loads((path / "config.json").read_text())
    data["text_config"][field] = value
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(ConversionError, match=match) as info:
        convert_kimi_linear(tmp_path)
    assert "\n" not in str(info.value)


def test_a_k3_release_drops_its_vision_tower_and_mtp_layers_and_reads_flat_a_log(k3_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    lm, path = k3_dir
    tensors = {"language_model." + k: v for k, v in load_file(str(path / "model.safetensors")).items()}
    for k in [k for k in tensors if k.endswith("A_log")]:
        tensors[k] = tensors[k].flatten()  # mlx-lm's spelling
    tensors["vision_tower.patch_embed.weight"] = torch.ones(3)
    tensors["language_model.model.mtp.0.proj.weight"] = torch.ones(3)
    tensors["language_model.model.layers.4.input_layernorm.weight"] = torch.ones(32)  # an MTP layer
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    model = convert_kimi_linear(tmp_path)
    assert all(torch.equal(v, model.model.state_dict()[k]) for k, v in lm.state_dict().items())


def test_k3_options_are_refused_in_a_kimi_linear_checkpoint(tmp_path):
    from attnres.hf.kimi import save_kimi_linear

    with pytest.raises(ConversionError, match="mla_output_gate=True is a Kimi K3 option.*--to mlx"):
        save_kimi_linear(k3_model(mla_output_gate=True), tmp_path / "kimi")


@pytest.mark.parametrize(
    "options, match",
    [
        (dict(situ_linear_beta=2.0), "situ_linear_beta=2.0 is invalid: squashes SiTU's up branch: set situ_beta"),
        (dict(situ_beta=0.0), "situ_beta=0.0 is invalid: must be a positive number"),
        (dict(kda_gate_lower_bound=1.0), "kda_gate_lower_bound=1.0 is invalid: must be a negative number"),
        (dict(moe_groups=3), "moe_groups=3 is invalid: must divide moe_experts=4"),
        (dict(moe_groups=2, moe_topk_groups=3), "moe_topk_groups=3 is invalid: must be at most moe_groups=2"),
        (dict(moe_latent_norm=True), "moe_latent_norm=True is invalid: .*set moe_latent_dim"),
        (dict(moe_layer_freq=8, moe_dense_layers=1), "moe_layer_freq=8 is invalid: .*leaves no MoE layer"),
    ],
)
def test_bad_k3_options_name_the_field(options, match):
    with pytest.raises(ValueError, match=match):
        k3_model(**options)


def test_attnres_convert_takes_a_k3_directory(k3_dir, tmp_path):
    from attnres.cli import main
    from attnres.hf import AttnResForCausalLM

    lm, path = k3_dir
    assert main(["convert", str(path), str(tmp_path / "hf"), "--to", "hf"]) == 0
    model = AttnResForCausalLM.from_pretrained(str(tmp_path / "hf"))
    assert all(torch.equal(v, model.model.state_dict()[k]) for k, v in lm.state_dict().items())


def test_k3_keys_read_with_mlx_lms_defaults():
    """What a K3 text config leaves out means what mlx-lm's kimi_k3 takes it to mean: SiTU's beta 1,
    and one expert per token is not renormalised (K3 renormalises two or more only)."""
    from attnres.hf.kimi.k3_layout import k3_model_fields
    from attnres.serving.k3 import k3_text_config

    text = k3_text_config(k3_model(situ_beta=1.0).config)
    del text["activation_situ_beta"]
    text.update(num_experts_per_token=1, moe_renormalize=True)
    fields = k3_model_fields(text)
    assert fields["situ_beta"] == 1.0 and fields["situ_linear_beta"] is None
    assert fields["moe_top_k"] == 1 and fields["moe_renormalize"] is False
    ModelConfig(**fields)  # a valid model


def test_one_renormalised_expert_is_refused_as_k3(tmp_path):
    from attnres.serving.k3 import ServingError

    with pytest.raises(ServingError, match="moe_top_k=1 with moe_renormalize=True"):
        save_mlx(k3_model(moe_top_k=1), tmp_path / "k3")


def random_mxfp4(*shape, seed: int):
    """uint8 bytes and scales of an MXFP4 matrix [*shape] (scales 2^-4 … 2^1, like trained weights')."""
    gen = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (*shape[:-1], shape[-1] // 2), generator=gen, dtype=torch.uint8)
    scales = torch.randint(123, 129, (*shape[:-1], shape[-1] // 32), generator=gen, dtype=torch.uint8)
    return packed, scales


def test_mxfp4_dequantisation_is_the_e2m1_table_times_the_group_scale():
    from attnres.hf.kimi.mxfp4 import E2M1, dequantize_mxfp4

    packed, scales = random_mxfp4(3, 64, seed=0)
    got = dequantize_mxfp4(packed, scales)
    for r in range(3):
        for c in range(64):
            byte = int(packed[r, c // 2])
            nibble = byte & 15 if c % 2 == 0 else byte >> 4
            assert got[r, c].item() == E2M1[nibble] * 2.0 ** (int(scales[r, c // 32]) - 127)
    try:
        import mlx.core as mx
    except ImportError:
        return
    mx.set_default_device(mx.cpu)
    theirs = mx.dequantize(
        mx.array(packed.numpy()).view(mx.uint32), mx.array(scales.numpy()), group_size=32, bits=4, mode="mxfp4"
    )
    assert torch.equal(torch.from_numpy(np.array(theirs.astype(mx.float32))), got)


def test_a_k3_directory_with_mxfp4_experts_loads_dequantised(tmp_path):
    """K3's release layout for its experts (compressed-tensors' weight_packed / weight_scale per expert
    matrix, quantization_config at the top of config.json) loads as the float model it encodes."""
    from safetensors.torch import load_file, save_file

    from attnres.hf.kimi.mxfp4 import dequantize_mxfp4

    lm = k3_model(moe_d_ff=32)
    packs = {}
    with torch.no_grad():
        for i, block in enumerate(lm.blocks):
            if block.is_moe:
                experts = block.mlp.experts
                for name, param in (("gate_up", experts.gate_up_proj), ("down", experts.down_proj)):
                    packed, scales = random_mxfp4(*param.shape, seed=10 * i + len(name))
                    param.copy_(dequantize_mxfp4(packed, scales))
                    packs[(i, name)] = packed, scales
    path = save_mlx(lm, tmp_path / "k3")
    tensors = load_file(str(path / "model.safetensors"))
    for (i, name), (packed, scales) in packs.items():
        for e in range(4):
            parts = (
                {"w2": (packed[e], scales[e])}
                if name == "down"
                else {
                    "w1": (packed[e, :32], scales[e, :32]),
                    "w3": (packed[e, 32:], scales[e, 32:]),
                }
            )
            for w, (p, s) in parts.items():
                key = f"model.layers.{i}.block_sparse_moe.experts.{e}.{w}"
                assert torch.equal(tensors.pop(f"{key}.weight"), dequantize_mxfp4(p, s))
                tensors[f"{key}.weight_packed"], tensors[f"{key}.weight_scale"] = p.contiguous(), s.contiguous()
    save_file(tensors, str(path / "model.safetensors"))
    data = json.loads((path / "config.json").read_text())
    data["quantization_config"] = {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized"}
    (path / "config.json").write_text(json.dumps(data))
    model = convert_kimi_linear(path)
    assert all(torch.equal(v, model.model.state_dict()[k]) for k, v in lm.state_dict().items())
