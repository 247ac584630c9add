"""GGUF export for llama.cpp's kimi-k3 (attnres.serving.gguf): the file's structure read back with
gguf's reader, the exact re-expressions in float64, the refusals, and the CLI verb. llama.cpp itself
runs in scripts/llama_cpp_parity.py (not in CI; docs/serving.md)."""

import math

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from attnres.model import AttnResLM, ModelConfig  # noqa: E402
from attnres.ops import depth_attention_reference  # noqa: E402
from attnres.serving.gguf import write_gguf  # noqa: E402
from attnres.serving.k3 import (  # noqa: E402
    SWIGLU_EXACT_ABOVE,
    SWIGLU_EXACT_BELOW,
    SWIGLU_SITU_BETA,
    ServingError,
    situ,
)

D, LAYERS, HEADS, VOCAB = 32, 4, 2, 256


def tiny(seed=0, **overrides) -> AttnResLM:
    fields = dict(
        backbone="kimi_linear",
        vocab_size=VOCAB,
        d_model=D,
        n_layers=LAYERS,
        n_heads=HEADS,
        d_ff=64,
        max_seq_len=32,
        moe_experts=4,
        moe_top_k=2,
        moe_shared_experts=1,
        residual="block",
        attnres_block_size=4,
        mla_q_rank=16,
    )
    fields.update(overrides)
    if fields["residual"] != "block":
        fields.pop("attnres_block_size")
    torch.manual_seed(seed)
    lm = AttnResLM(ModelConfig(**fields)).eval()
    if lm.config.residual == "block":
        with torch.no_grad():
            lm.residual.queries.normal_(0.0, 0.5)
            lm.residual.key_norm_weight.uniform_(0.5, 1.5)
    return lm


def byte_tokenizer():
    from attnres.data import ByteTokenizer
    from attnres.hf.tokenizer import hf_tokenizer, special_token_ids

    native = ByteTokenizer()
    return hf_tokenizer(native).backend_tokenizer, special_token_ids(native)


def read(path):
    reader = gguf.GGUFReader(str(path))
    fields = {name: f.contents() for name, f in reader.fields.items()}
    tensors = {t.name: t for t in reader.tensors}
    return fields, tensors


def ne(t) -> list:
    return [int(x) for x in t.shape]


@pytest.fixture(scope="module")
def block_file(tmp_path_factory):
    lm = tiny()
    tokenizer, special = byte_tokenizer()
    path = write_gguf(lm, tmp_path_factory.mktemp("gguf") / "m.gguf", tokenizer=tokenizer, special=special)
    return lm, read(path)


def test_structure(block_file):
    lm, (fields, tensors) = block_file
    a = "kimi-k3"
    assert fields["general.architecture"] == a
    expected = {
        "block_count": LAYERS,
        "embedding_length": D,
        "attention.head_count": HEADS,
        "attn_res.block_size": 2,
        "attention.head_count_kv": [0, 0, 0, 1],
        "expert_count": 4,
        "expert_used_count": 2,
        "expert_shared_count": 1,
        "leading_dense_block_count": 1,
        "kda.head_dim": D // HEADS,
        "ssm.conv_kernel": 4,
        "attention.q_lora_rank": 16,
        "expert_gating_func": 2,
        "expert_weights_norm": True,
        "vocab_size": VOCAB,
        "activation.situ_beta": SWIGLU_SITU_BETA,
        "activation.situ_linear_beta": 0.0,
    }
    assert {k: fields[f"{a}.{k}"] for k in expected} == expected
    assert len(fields["tokenizer.ggml.tokens"]) == VOCAB and fields["tokenizer.ggml.model"] == "gpt2"

    names = {"token_embd.weight", "output_norm.weight", "output.weight", "output_res_score.weight"}
    for i in range(LAYERS):
        names |= {
            f"blk.{i}.{n}"
            for n in (
                "attn_norm.weight",
                "ffn_norm.weight",
                "attn_res_score.weight",
                "ffn_res_score.weight",
                "attn_output.weight",
            )
        }
        if i == 3:  # MLA
            names |= {
                f"blk.{i}.{n}.weight"
                for n in (
                    "attn_q_a",
                    "attn_q_a_norm",
                    "attn_q_b",
                    "attn_kv_a_mqa",
                    "attn_kv_a_norm",
                    "attn_k_b",
                    "attn_v_b",
                )
            }
        else:  # KDA
            names |= {
                f"blk.{i}.{n}"
                for n in (
                    "attn_q.weight",
                    "attn_k.weight",
                    "attn_v.weight",
                    "ssm_f_a.weight",
                    "ssm_f_b.weight",
                    "ssm_beta.weight",
                    "ssm_a",
                    "ssm_dt.bias",
                    "ssm_g.weight",
                    "ssm_norm.weight",
                    "ssm_conv1d_q.weight",
                    "ssm_conv1d_k.weight",
                    "ssm_conv1d_v.weight",
                )
            }
        mlp = (
            ("ffn_gate", "ffn_up", "ffn_down")
            if i == 0
            else (
                "ffn_gate_inp",
                "ffn_gate_exps",
                "ffn_up_exps",
                "ffn_down_exps",
                "ffn_gate_shexp",
                "ffn_up_shexp",
                "ffn_down_shexp",
            )
        )
        names |= {f"blk.{i}.{n}.weight" for n in mlp} | ({f"blk.{i}.exp_probs_b.bias"} if i else set())
    assert set(tensors) == names
    # shapes as llama.cpp's loader asks for them (ne order)
    hd, e, f = D // HEADS, 4, lm.config.moe_d_ff or math.ceil(64 / 3)
    assert ne(tensors["blk.0.ssm_conv1d_q.weight"]) == [4, 1, D, 1]
    assert ne(tensors["blk.0.ssm_g.weight"]) == [D, D] and ne(tensors["blk.0.ssm_a"]) == [HEADS]
    assert ne(tensors["blk.0.ssm_f_a.weight"]) == [D, hd] and ne(tensors["blk.0.ssm_beta.weight"]) == [D, HEADS]
    assert ne(tensors["blk.3.attn_k_b.weight"]) == [hd, D // 2, HEADS]  # nope, kv rank, heads
    assert ne(tensors["blk.3.attn_v_b.weight"]) == [D // 2, hd, HEADS]  # kv rank, v, heads
    assert ne(tensors["blk.1.ffn_gate_exps.weight"]) == [D, f, e]
    assert ne(tensors["blk.1.ffn_down_exps.weight"]) == [f, D, e]
    assert ne(tensors["output_res_score.weight"]) == [D]
    assert all(t.tensor_type == gguf.GGMLQuantizationType.F32 for t in tensors.values())


def test_values_are_exact_re_expressions(block_file):
    """Every tensor against our weights: copies bit for bit, and the re-expressed ones (fused scores,
    full-rank gate, -exp(A_log), absorbed k_b / v_b, split expert stacks) against float64 arithmetic."""
    lm, (_, tensors) = block_file
    sd = {k: v.double() for k, v in lm.state_dict().items()}

    def got(name):
        return torch.from_numpy(np.array(tensors[name].data, dtype=np.float64)).reshape(
            [int(x) for x in reversed(tensors[name].shape)]
        )

    f32 = {"rtol": 0, "atol": 0}
    torch.testing.assert_close(got("token_embd.weight"), sd["embed.weight"].float().double(), **f32)
    score = sd["residual.key_norm_weight"] * sd["residual.queries"]
    torch.testing.assert_close(got("blk.2.ffn_res_score.weight"), score[5].float().double(), **f32)
    torch.testing.assert_close(got("output_res_score.weight"), score[2 * LAYERS].float().double(), **f32)
    a = "blocks.0.attn."
    gate = sd[a + "g_b_proj.weight"] @ sd[a + "g_a_proj.weight"]
    torch.testing.assert_close(got("blk.0.ssm_g.weight"), gate.float().double(), **f32)
    torch.testing.assert_close(
        got("blk.0.ssm_a"), -sd[a + "forget_gate.A_log"].exp().reshape(-1).float().double(), **f32
    )
    conv = sd[a + "conv1d.weight"].reshape(3, D, 4)
    torch.testing.assert_close(got("blk.0.ssm_conv1d_v.weight").reshape(D, 4), conv[2].float().double(), **f32)
    k_b, v_b = got("blk.3.attn_k_b.weight"), got("blk.3.attn_v_b.weight")  # [H, rank, nope], [H, v, rank]
    kv_b = torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(-1, D // 2)
    torch.testing.assert_close(kv_b, sd["blocks.3.attn.kv_b_proj.weight"].float().double(), **f32)
    gate_up = sd["blocks.2.mlp.experts.gate_up_proj"]
    both = torch.cat([got("blk.2.ffn_gate_exps.weight"), got("blk.2.ffn_up_exps.weight")], dim=1)
    torch.testing.assert_close(both, gate_up.float().double(), **f32)
    torch.testing.assert_close(got("blk.2.exp_probs_b.bias"), sd["blocks.2.mlp.gate.e_score_correction_bias"], **f32)


def test_fused_score_reads_like_the_pair_float64():
    """llama.cpp's read with the fused vector (query, no key-norm weight) is ours in float64."""
    torch.manual_seed(1)
    sources = torch.randn(5, 2, 3, D, dtype=torch.float64) * 3
    w, g = torch.randn(D, dtype=torch.float64), torch.rand(D, dtype=torch.float64) + 0.5
    ours = depth_attention_reference(sources, w, g, eps=1e-6)
    fused = depth_attention_reference(sources, g * w, None, eps=1e-6)
    torch.testing.assert_close(fused[0], ours[0], rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_situ_with_the_swiglu_beta_is_swiglu(dtype):
    """SwiGLU -> SiTU(beta = 2^60, no linear_beta) is exact: beta·tanh(gate/beta) = gate bit for bit for
    every |gate| from 2^-66 (float32; gate/beta stays a normal number) to 2^33, so SiTU =
    gate·sigmoid(gate)·up = silu(gate)·up (F.silu rounds its own way: within an ulp or two)."""
    torch.manual_seed(2)
    low = math.log10(SWIGLU_EXACT_ABOVE) + 1e-9
    magnitude = torch.logspace(low, math.log10(SWIGLU_EXACT_BELOW) - 1e-9, 20001, dtype=torch.float64)
    gate = (magnitude * torch.where(torch.rand_like(magnitude) < 0.5, -1.0, 1.0)).to(dtype)
    assert torch.equal(SWIGLU_SITU_BETA * torch.tanh(gate / SWIGLU_SITU_BETA), gate)
    up = torch.randn_like(gate)
    assert torch.equal(situ(up, gate, SWIGLU_SITU_BETA), gate * torch.sigmoid(gate) * up)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(
        situ(up, gate, SWIGLU_SITU_BETA), torch.nn.functional.silu(gate) * up, rtol=4 * eps, atol=0
    )


def test_16_bit_files(tmp_path):
    lm = tiny(residual="prenorm", moe_experts=0)
    for dtype, kind in (("float16", "F16"), ("bfloat16", "BF16")):
        fields, tensors = read(write_gguf(lm, tmp_path / f"{dtype}.gguf", dtype=dtype))
        assert fields["general.file_type"] == {"F16": 1, "BF16": 32}[kind]
        assert fields["kimi-k3.attn_res.block_size"] == 0 and fields["kimi-k3.leading_dense_block_count"] == LAYERS
        assert not any("res_score" in n for n in tensors)
        types = {n: t.tensor_type.name for n, t in tensors.items()}
        assert types["blk.0.ffn_up.weight"] == types["output.weight"] == kind
        assert types["blk.0.ssm_norm.weight"] == types["blk.0.ssm_conv1d_q.weight"] == "F32"
        up = gguf.quants.dequantize(tensors["blk.0.ffn_up.weight"].data, tensors["blk.0.ffn_up.weight"].tensor_type)
        want = lm.state_dict()["blocks.0.mlp.up_proj.weight"].numpy()
        assert np.abs(up.reshape(want.shape) - want).max() <= 2.0**-8 * np.abs(want).max()


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(backbone="llama", moe_experts=0, mla_q_rank=None), "backbone='llama'"),
        (dict(residual="full"), "residual='full'"),
        (dict(attnres_scale_norm_eps=True), "attnres_scale_norm_eps=True"),
        (dict(kda_heads=4), "kda_heads=4"),
        (dict(kimi_layer_pattern="M"), "kimi_layer_pattern='M'"),
        (dict(moe_layer_freq=2), "moe_layer_freq=2"),
    ],
)
def test_refusals_name_the_field(tmp_path, overrides, field):
    with pytest.raises(ServingError, match=field.replace("(", r"\(")) as info:
        write_gguf(tiny(**overrides), tmp_path / "x.gguf")
    assert "\n" not in str(info.value)
    if "llama" in field:
        assert "LLaMA-backbone AttnRes models have none" in str(info.value)


def test_k3_options_are_written_as_llama_cpp_reads_them(tmp_path):
    """K3's options of the backbone in llama.cpp's kimi-k3 terms: SiTU's betas, the KDA gate's lower bound
        (key present only when set), the full-rank KDA gate as ssm_g itself, MLA's output gate as attn_gate,
        the latent MoE's projections and norm with expert_latent_length, grouped routing as the general
    expert-group keys (llama.cpp's own logits with them: docs/serving.md)."""
    options = dict(
        situ_beta=2.0,
        situ_linear_beta=3.0,
        kda_gate_lower_bound=-5.0,
        kda_full_rank_gate=True,
        mla_output_gate=True,
        moe_latent_dim=8,
        moe_latent_norm=True,
        moe_groups=2,
        moe_topk_groups=1,
    )
    lm = tiny(**options)
    sd = {k: v.double() for k, v in lm.state_dict().items()}
    fields, tensors = read(write_gguf(lm, tmp_path / "k3.gguf"))
    assert fields["kimi-k3.activation.situ_beta"] == 2.0 and fields["kimi-k3.activation.situ_linear_beta"] == 3.0
    assert fields["kimi-k3.kda.gate_lower_bound"] == -5.0 and fields["kimi-k3.expert_latent_length"] == 8
    assert fields["kimi-k3.expert_group_count"] == 2 and fields["kimi-k3.expert_group_used_count"] == 1

    def got(name):
        t = tensors[name]
        return torch.from_numpy(np.array(t.data, dtype=np.float64)).reshape([int(x) for x in reversed(t.shape)])

    pairs = {
        "blk.0.ssm_g.weight": "blocks.0.attn.g_b_proj.weight",
        "blk.3.attn_gate.weight": "blocks.3.attn.g_proj.weight",
        "blk.2.ffn_routed_down.weight": "blocks.2.mlp.routed_expert_down_proj.weight",
        "blk.2.ffn_routed_up.weight": "blocks.2.mlp.routed_expert_up_proj.weight",
        "blk.2.ffn_routed_norm.weight": "blocks.2.mlp.routed_expert_norm.weight",
    }
    for name, ours in pairs.items():
        torch.testing.assert_close(got(name), sd[ours].float().double(), rtol=0, atol=0)
    assert ne(tensors["blk.2.ffn_gate_exps.weight"]) == [8, 64 // 3 + 1, 4]  # experts at the latent width
    plain, _ = read(write_gguf(tiny(), tmp_path / "plain.gguf"))
    only_k3 = {"kimi-k3.kda.gate_lower_bound", "kimi-k3.expert_latent_length", "kimi-k3.expert_group_count"}
    assert not only_k3 & set(plain)
    assert plain["kimi-k3.activation.situ_beta"] == SWIGLU_SITU_BETA


def test_cli_exports_a_hugging_face_directory(tmp_path, capsys):
    from attnres.cli import main
    from attnres.data import ByteTokenizer
    from attnres.hf import AttnResForCausalLM
    from attnres.hf.tokenizer import hf_tokenizer

    lm = tiny(seed=3)
    AttnResForCausalLM.from_attnres_lm(lm, pad_token_id=0).save_pretrained(str(tmp_path / "hf"))
    hf_tokenizer(ByteTokenizer()).save_pretrained(str(tmp_path / "hf"))
    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "m.gguf"), "--to", "gguf", "--dtype", "bfloat16"]) == 0
    fields, tensors = read(tmp_path / "m.gguf")
    assert fields["kimi-k3.attn_res.block_size"] == 2
    assert tensors["blk.1.ffn_up_exps.weight"].tensor_type.name == "BF16"
    assert fields["tokenizer.ggml.pad_token_id"] == 0
    # an existing file needs --force; retrofit flags do not apply
    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "m.gguf"), "--to", "gguf"]) == 2
    assert "pass --force" in capsys.readouterr().err
    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "n.gguf"), "--to", "gguf", "--residual", "block"]) == 2
    assert "--residual do not apply to --to gguf" in capsys.readouterr().err


def test_every_source_kind_exports(tmp_path):
    """A native checkpoint (BPE tokenizer: merges and GPT-2's split), a Kimi Linear checkpoint in the
    released layout and a plain (PreNorm) one give the same tensors as the model they hold."""
    from attnres.data import train_bpe
    from attnres.hf import AttnResForCausalLM, hf_to_native, save_kimi_linear
    from attnres.hf.tokenizer import special_token_ids
    from attnres.serving.gguf import gguf_tensors, load_for_serving

    texts = ["ROMEO: O Romeo, wherefore art thou Romeo?", "JULIET: the depth attention reads"] * 20
    bpe = train_bpe(texts, vocab_size=VOCAB, min_frequency=1)
    lm = tiny(seed=4)
    hf_to_native(AttnResForCausalLM.from_attnres_lm(lm, **special_token_ids(bpe)), tmp_path / "run", bpe)
    save_kimi_linear(lm, tmp_path / "k3")
    plain = tiny(seed=5, residual="prenorm")
    save_kimi_linear(plain, tmp_path / "kimi")
    for source, want in (("run", lm), ("k3", lm), ("kimi", plain)):
        model, tokenizer, special = load_for_serving(tmp_path / source)
        got, expected = gguf_tensors(model), gguf_tensors(want)
        assert got.keys() == expected.keys() and all(np.array_equal(got[k], expected[k]) for k in got), source
    model, tokenizer, special = load_for_serving(tmp_path / "run")
    fields, _ = read(write_gguf(model, tmp_path / "bpe.gguf", tokenizer=tokenizer, special=special))
    assert fields["tokenizer.ggml.pre"] == "gpt-2" and len(fields["tokenizer.ggml.merges"]) > 0
    tokens = fields["tokenizer.ggml.tokens"]
    assert len(tokens) == VOCAB and tokens == [tokenizer.id_to_token(i) for i in range(VOCAB)]


def _hf_source(path, seed=3):
    from attnres.data import ByteTokenizer
    from attnres.hf import AttnResForCausalLM
    from attnres.hf.tokenizer import hf_tokenizer

    AttnResForCausalLM.from_attnres_lm(tiny(seed=seed), pad_token_id=0).save_pretrained(str(path))
    hf_tokenizer(ByteTokenizer()).save_pretrained(str(path))
    return path


@pytest.fixture
def quiet_transformers():
    """transformers' progress bars off (they share stderr with the one-line errors checked here)."""
    from transformers.utils import logging

    logging.disable_progress_bar()
    yield
    logging.enable_progress_bar()


def _one_line(err):
    lines = err.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("attnres convert: error: ") and "Traceback" not in err, err
    return lines[0]


def test_a_gguf_write_cut_short_leaves_no_file_and_keeps_the_old_one(tmp_path, capsys, monkeypatch, quiet_transformers):
    from attnres.cli import main

    src, out = _hf_source(tmp_path / "hf"), tmp_path / "m.gguf"
    argv = ["convert", str(src), str(out), "--to", "gguf"]

    def dies_midway(self, *args, **kwargs):  # the header and metadata are written: a valid GGUF start
        raise OSError(28, "No space left on device")

    real = gguf.GGUFWriter.write_tensors_to_file
    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", dies_midway)
    capsys.readouterr()
    assert main(argv) == 2
    assert "No space left on device" in _one_line(capsys.readouterr().err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no m.gguf, no hidden leftover
    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", real)
    assert main(argv) == 0
    good = out.read_bytes()
    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", dies_midway)
    assert main([*argv, "--force"]) == 2
    assert out.read_bytes() == good and sorted(p.name for p in tmp_path.iterdir()) == ["hf", "m.gguf"]


def test_gguf_refusals_name_the_real_reason(tmp_path, capsys, quiet_transformers):
    """Each refusal says what is wrong and what to do, never an advice that leads back to it."""
    import json

    import transformers

    from attnres.cli import main
    from attnres.hf import convert_to_attnres

    def llama():
        sizes = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**sizes, max_position_embeddings=32)).eval()

    src = _hf_source(tmp_path / "hf")
    (tmp_path / "out.gguf").mkdir()
    assert main(["convert", str(src), str(tmp_path / "out.gguf"), "--to", "gguf", "--force"]) == 2
    err = _one_line(capsys.readouterr().err)
    assert "out.gguf is a directory; GGUF output is one file" in err and "--force" not in err
    # a wrapped retrofit: neither "convert it first" nor "already retrofitted" alone, but the backbone
    retro = tmp_path / "retro"
    convert_to_attnres(llama()).save_pretrained(str(retro))
    for to in ("gguf", "mlx"):
        assert main(["convert", str(retro), str(tmp_path / f"r.{to}"), "--to", to]) == 2
        err = _one_line(capsys.readouterr().err)
        assert "is a retrofit of a llama model" in err and "only models with the Kimi Linear backbone" in err
        assert "convert it first" not in err
    assert main(["convert", str(retro), str(tmp_path / "again")]) == 2
    err = _one_line(capsys.readouterr().err)
    assert "already retrofitted" in err and "no native, Kimi Linear, GGUF or MLX form" in err
    plain = tmp_path / "llama"
    llama().save_pretrained(str(plain))
    assert main(["convert", str(plain), str(tmp_path / "l.gguf"), "--to", "gguf"]) == 2
    err = _one_line(capsys.readouterr().err)
    assert "is a llama Hugging Face model, not AttnRes with the Kimi Linear backbone" in err
    assert "retrofitted or not" in err and "convert it first" not in err
    # a run that stopped before its first checkpoint: what the trainer wrote, and no checkpoint/
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"model": tiny().config.to_dict(), "train": {}}))
    (run / "metrics.jsonl").write_text("")
    assert main(["convert", str(run), str(tmp_path / "run.gguf"), "--to", "gguf"]) == 2
    err = _one_line(capsys.readouterr().err)
    assert "is a run directory of attnres train without a checkpoint" in err and "--resume" in err
    assert "pretrained" not in err and not (tmp_path / "run.gguf").exists()
