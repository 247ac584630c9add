"""``attnres convert SOURCE OUT.gguf --to gguf``: a Kimi Linear-backbone model as llama.cpp's ``kimi-k3``.

llama.cpp (``src/models/kimi-k3.cpp``) runs the released Kimi K3: §10's Block AttnRes (docs/method.md)
around Kimi Linear's KDA / MLA / MoE sublayers. This module writes our models in that architecture
with the ``gguf`` package (``pip install 'attnres[serving]'``); its constants predate ``kimi-k3``,
so the K3 keys and tensor names are written literally. The re-expressions (all exact, see
:mod:`attnres.serving.k3`):

- SwiGLU -> SiTU with ``activation.situ_beta`` = 2^60 and ``situ_linear_beta`` = 0 (off); a model
  with ``situ_beta`` / ``situ_linear_beta`` (K3's SiTU) writes its own;
- the depth attention's query w and key-norm weight g -> ``*_res_score`` = g ⊙ w, and
  ``attn_res.block_size`` = B in decoder layers (S = 2B sublayers; Full AttnRes is refused);
- KDA's low-rank output gate g_b · g_a -> K3's full-rank ``ssm_g`` (their product, float64; with
  ``kda_full_rank_gate`` the gate itself); ``kda_gate_lower_bound`` -> ``kda.gate_lower_bound``;
  ``A_log`` -> ``ssm_a`` = -exp(A_log) (llama.cpp folds it at conversion); the fused q/k/v short
  convolution -> three [1, P, 1, K] tensors;
- MLA's ``kv_b_proj`` -> the absorbed ``attn_k_b`` [H, rank, nope] and ``attn_v_b`` [H, v, rank];
- ``mla_output_gate`` -> ``attn_gate``; the latent MoE (``moe_latent_dim``, ``moe_latent_norm``) ->
  ``expert_latent_length`` and ``ffn_routed_down`` / ``ffn_routed_up`` / ``ffn_routed_norm``; grouped
  routing -> the general ``expert_group_count`` / ``expert_group_used_count``;
- per-layer ``head_count_kv``: 1 for MLA (served as MQA over the latent), 0 marks a KDA layer;
- the tokenizer (byte-level BPE, or bytes as 256 tokens without merges) as ``gpt2``.

Refused with the field named: a non-Kimi backbone, residual schemes §10 cannot store, KDA head
counts other than ``n_heads`` (llama.cpp's kimi-k3 has one ``attention.head_count`` for both), and
layer patterns without both KDA and MLA layers (llama.cpp's hybrid cache aborts on them), , and the one K3
option llama.cpp's kimi-k3 has no key for: ``moe_layer_freq`` != 1 (every layer after the dense ones
is MoE there).
Numbers llama.cpp computes differently without a field to say so: the l2 norm of KDA's q / k and
MLA's latent RMSNorms use ``rms_norm_eps`` there (1e-6 in transformers); equal when norm_eps = 1e-6.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from attnres.files import atomic_path
from attnres.model.backbones import KDA, MLA, kimi_sizes, layer_kinds, moe_layers
from attnres.ops import fuse_score_weight
from attnres.serving.k3 import (
    SWIGLU_SITU_BETA,
    ServingError,
    check_kimi_backbone,
    layout_block_size,
)

ARCH = "kimi-k3"
# --dtype -> (GGML type name, general.file_type: ALL_F32 = 0, MOSTLY_F16 = 1, MOSTLY_BF16 = 32)
OUT_TYPES = {"float32": ("F32", 0), "float16": ("F16", 1), "bfloat16": ("BF16", 32)}
_GATING_SIGMOID = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
_NO_TOKEN_MERGE = ("~", "~")  # two ASCII bytes, each its own token
_TOKEN_NORMAL, _TOKEN_CONTROL, _TOKEN_USER, _TOKEN_UNUSED = 1, 3, 4, 5


def _import_gguf():
    try:
        import gguf
    except ImportError as e:
        raise ServingError(f"writing GGUF needs the gguf package: pip install 'attnres[serving]' ({e})") from None
    return gguf


def _lm(model):
    """The AttnResLM of an AttnResLM or AttnResForCausalLM."""
    return getattr(model, "model", model) if not hasattr(model, "residual") else model


def check_gguf(config) -> int | None:
    """What llama.cpp's kimi-k3 cannot run, as ServingError; returns §10's B (None: PreNorm)."""
    check_kimi_backbone(config, "GGUF (llama.cpp's kimi-k3)")
    b = layout_block_size(config, "GGUF (llama.cpp's kimi-k3)")
    kinds = layer_kinds(config)
    if KDA not in kinds or MLA not in kinds:
        raise ServingError(
            f"ModelConfig.kimi_layer_pattern={config.kimi_layer_pattern!r} over {config.n_layers} layers "
            "has only one attention kind: llama.cpp's kimi-k3 keeps a hybrid cache (KDA states and "
            "MLA latents) and aborts without both; use a pattern with K and M (such as 'KKKM')"
        )
    if any(moe_layers(config)) and config.moe_layer_freq != 1:
        raise ServingError(
            f"ModelConfig.moe_layer_freq={config.moe_layer_freq} cannot be written for llama.cpp's kimi-k3, "
            "which makes every layer after leading_dense_block_count a mixture of experts; use "
            "moe_layer_freq=1, or serve the model through mlx-lm (attnres convert --to mlx)"
        )
    heads = kimi_sizes(config)["kda_heads"]
    if heads != config.n_heads:
        raise ServingError(
            f"ModelConfig.kda_heads={heads} differs from n_heads={config.n_heads}: llama.cpp's "
            "kimi-k3 has one attention.head_count for KDA and MLA layers; use kda_heads=None "
            "(= n_heads)"
        )
    return b


# ----------------------------------------------------------------------------- tensors


@torch.no_grad()
def gguf_tensors(model) -> dict[str, np.ndarray]:
    """llama.cpp kimi-k3 tensor name -> float64 array (numpy shape = GGUF's ne reversed) of ``model``
    (an AttnResLM or AttnResForCausalLM with the Kimi Linear backbone)."""
    lm = _lm(model)
    c = lm.config
    b = check_gguf(c)
    sd = {k: v.detach().to(torch.float64).cpu() for k, v in lm.state_dict().items()}
    s, kinds, sparse = kimi_sizes(c), layer_kinds(c), moe_layers(c)
    out: dict[str, torch.Tensor] = {
        "token_embd.weight": sd["embed.weight"],
        "output_norm.weight": sd["norm.weight"],
        "output.weight": sd["embed.weight"] if c.tie_embeddings else sd["lm_head.weight"],
    }
    if b is not None:  # the fused score vectors: key-norm weight ⊙ pseudo-query, per consumer l = 0 … L
        score = torch.stack(
            [
                fuse_score_weight(w, g)
                for w, g in zip(sd["residual.queries"], sd["residual.key_norm_weight"], strict=True)
            ]
        )
        out["output_res_score.weight"] = score[c.n_sublayers]
    for i in range(c.n_layers):
        p, t = f"blocks.{i}.", f"blk.{i}."
        out[t + "attn_norm.weight"] = sd[p + "attn_norm.weight"]
        out[t + "ffn_norm.weight"] = sd[p + "mlp_norm.weight"]
        if b is not None:
            out[t + "attn_res_score.weight"] = score[2 * i]
            out[t + "ffn_res_score.weight"] = score[2 * i + 1]
        a = p + "attn."
        if kinds[i] == KDA:
            width, kernel = s["kda_heads"] * s["kda_head_dim"], c.kda_conv_kernel
            for n in "qkv":
                out[t + f"attn_{n}.weight"] = sd[a + f"{n}_proj.weight"]
            conv = sd[a + "conv1d.weight"]  # [3P, 1, K]: q, k, v channels
            for j, n in enumerate("qkv"):
                out[t + f"ssm_conv1d_{n}.weight"] = conv[j * width : (j + 1) * width].reshape(1, width, 1, kernel)
            out[t + "ssm_f_a.weight"] = sd[a + "forget_gate.f_a_proj.weight"]
            out[t + "ssm_f_b.weight"] = sd[a + "forget_gate.f_b_proj.weight"]
            out[t + "ssm_beta.weight"] = sd[a + "b_proj.weight"]
            out[t + "ssm_a"] = -torch.exp(sd[a + "forget_gate.A_log"].reshape(-1))
            out[t + "ssm_dt.bias"] = sd[a + "forget_gate.dt_bias"].reshape(-1)
            gate = sd[a + "g_b_proj.weight"]  # full rank: g_b_proj alone (g_a_proj is the identity)
            out[t + "ssm_g.weight"] = gate if c.kda_full_rank_gate else gate @ sd[a + "g_a_proj.weight"]
            out[t + "ssm_norm.weight"] = sd[a + "o_norm.weight"]
        else:
            if c.mla_q_rank:
                out[t + "attn_q_a.weight"] = sd[a + "q_a_proj.weight"]
                out[t + "attn_q_a_norm.weight"] = sd[a + "q_a_layernorm.weight"]
                out[t + "attn_q_b.weight"] = sd[a + "q_b_proj.weight"]
            else:
                out[t + "attn_q.weight"] = sd[a + "q_proj.weight"]
            out[t + "attn_kv_a_mqa.weight"] = sd[a + "kv_a_proj_with_mqa.weight"]
            out[t + "attn_kv_a_norm.weight"] = sd[a + "kv_a_layernorm.weight"]
            nope, v, rank = s["mla_qk_nope_dim"], s["mla_v_dim"], s["mla_kv_rank"]
            kv_b = sd[a + "kv_b_proj.weight"].reshape(c.n_heads, nope + v, rank)
            out[t + "attn_k_b.weight"] = kv_b[:, :nope].transpose(1, 2)  # [H, rank, nope]
            out[t + "attn_v_b.weight"] = kv_b[:, nope:]  # [H, v, rank]
            if c.mla_output_gate:
                out[t + "attn_gate.weight"] = sd[a + "g_proj.weight"]
        out[t + "attn_output.weight"] = sd[a + "o_proj.weight"]
        m = p + "mlp."
        if sparse[i]:
            out[t + "ffn_gate_inp.weight"] = sd[m + "gate.weight"]
            out[t + "exp_probs_b.bias"] = sd[m + "gate.e_score_correction_bias"]
            gate_up, width = sd[m + "experts.gate_up_proj"], s["moe_d_ff"]  # [E, 2F, d]: gate rows, then up
            out[t + "ffn_gate_exps.weight"] = gate_up[:, :width]
            out[t + "ffn_up_exps.weight"] = gate_up[:, width:]
            out[t + "ffn_down_exps.weight"] = sd[m + "experts.down_proj"]
            if c.moe_latent_dim is not None:  # the routed experts' latent: down, (norm), up
                out[t + "ffn_routed_down.weight"] = sd[m + "routed_expert_down_proj.weight"]
                out[t + "ffn_routed_up.weight"] = sd[m + "routed_expert_up_proj.weight"]
                if c.moe_latent_norm:
                    out[t + "ffn_routed_norm.weight"] = sd[m + "routed_expert_norm.weight"]
            if c.moe_shared_experts:
                for n in ("gate", "up", "down"):
                    out[t + f"ffn_{n}_shexp.weight"] = sd[m + f"shared_experts.{n}_proj.weight"]
        else:
            for n in ("gate", "up", "down"):
                out[t + f"ffn_{n}.weight"] = sd[m + f"{n}_proj.weight"]
    return {k: v.contiguous().numpy() for k, v in out.items()}


def _stays_float32(name: str, array: np.ndarray) -> bool:
    """Vectors (norms, scores, biases, ssm_a), the short convolutions and the router stay float32 in
    16-bit files, as llama.cpp's converters keep them."""
    return array.ndim <= 1 or "ssm_conv1d" in name or name.endswith("ffn_gate_inp.weight")


# ----------------------------------------------------------------------------- metadata


def gguf_metadata(config, block_size: int | None) -> dict[str, tuple[str, Any]]:
    """key -> (GGUF value kind, value) of the kimi-k3 hyperparameters (llama.cpp's key names)."""
    s, kinds, sparse = kimi_sizes(config), layer_kinds(config), moe_layers(config)
    moe = any(sparse)
    swiglu = config.situ_beta is None
    a = ARCH
    meta: dict[str, tuple[str, Any]] = {
        f"{a}.context_length": ("u32", config.max_seq_len),
        f"{a}.embedding_length": ("u32", config.d_model),
        f"{a}.block_count": ("u32", config.n_layers),
        f"{a}.feed_forward_length": ("u32", config.d_ff),
        f"{a}.vocab_size": ("u32", config.vocab_size),
        f"{a}.attention.head_count": ("u32", config.n_heads),
        f"{a}.attention.head_count_kv": ("u32[]", [0 if k == KDA else 1 for k in kinds]),
        f"{a}.attention.layer_norm_rms_epsilon": ("f32", config.norm_eps),
        f"{a}.attention.kv_lora_rank": ("u32", s["mla_kv_rank"]),
        f"{a}.attention.key_length": ("u32", s["mla_kv_rank"] + s["mla_qk_rope_dim"]),
        f"{a}.attention.value_length": ("u32", s["mla_kv_rank"]),
        f"{a}.attention.key_length_mla": ("u32", s["mla_qk_nope_dim"] + s["mla_qk_rope_dim"]),
        f"{a}.attention.value_length_mla": ("u32", s["mla_v_dim"]),
        f"{a}.rope.dimension_count": ("u32", s["mla_qk_rope_dim"]),
        f"{a}.ssm.conv_kernel": ("u32", config.kda_conv_kernel),
        f"{a}.kda.head_dim": ("u32", s["kda_head_dim"]),
        f"{a}.expert_count": ("u32", config.moe_experts if moe else 0),
        f"{a}.expert_used_count": ("u32", config.moe_top_k if moe else 0),
        f"{a}.expert_feed_forward_length": ("u32", s["moe_d_ff"]),
        f"{a}.expert_shared_count": ("u32", config.moe_shared_experts if moe else 0),
        f"{a}.leading_dense_block_count": ("u32", sparse.index(True) if moe else config.n_layers),
        f"{a}.expert_weights_scale": ("f32", float(config.moe_routed_scale)),
        f"{a}.expert_weights_norm": ("bool", bool(config.moe_renormalize)),
        f"{a}.expert_gating_func": ("u32", _GATING_SIGMOID),
        f"{a}.activation.situ_beta": ("f32", SWIGLU_SITU_BETA if swiglu else float(config.situ_beta)),
        # <= 0: the up branch is left as is
        f"{a}.activation.situ_linear_beta": ("f32", float(config.situ_linear_beta or 0.0)),
        f"{a}.attn_res.block_size": ("u32", block_size or 0),  # 0: plain PreNorm residual
    }
    if config.mla_q_rank:
        meta[f"{a}.attention.q_lora_rank"] = ("u32", config.mla_q_rank)
    if config.kda_gate_lower_bound is not None:  # absent: Kimi Linear's softplus decay
        meta[f"{a}.kda.gate_lower_bound"] = ("f32", float(config.kda_gate_lower_bound))
    if moe and config.moe_groups > 1:  # llama.cpp's loader reads these for every architecture
        meta[f"{a}.expert_group_count"] = ("u32", config.moe_groups)
        meta[f"{a}.expert_group_used_count"] = ("u32", config.moe_topk_groups)
    if moe and config.moe_latent_dim is not None:
        meta[f"{a}.expert_latent_length"] = ("u32", config.moe_latent_dim)
    return meta


def tokenizer_metadata(backend, vocab_size: int, special: dict[str, int]) -> dict[str, tuple[str, Any]]:
    """The ``tokenizer.ggml.*`` keys of a byte-level BPE ``tokenizers.Tokenizer`` (ours, native or
    Hugging Face), padded with unused tokens up to the model's ``vocab_size``."""
    data = json.loads(backend.to_str())
    model = data.get("model") or {}
    if model.get("type") != "BPE":
        raise ServingError(
            f"tokenizer model type={model.get('type')!r}: only byte-level BPE tokenizers are written "
            "to GGUF here; convert the vocabulary with llama.cpp's convert_hf_to_gguf.py instead"
        )
    tokens: dict[int, tuple[str, int]] = {i: (tok, _TOKEN_NORMAL) for tok, i in model["vocab"].items()}
    for added in data.get("added_tokens") or []:
        tokens[added["id"]] = (added["content"], _TOKEN_CONTROL if added.get("special") else _TOKEN_USER)
    n = max(tokens) + 1 if tokens else 0
    if n > vocab_size:
        raise ServingError(
            f"the tokenizer has {n} tokens but ModelConfig.vocab_size={vocab_size}: the model has no "
            "embedding for the extra ones; use the run's own tokenizer"
        )
    names = [tokens.get(i, (f"<|attnres_unused_{i}|>", _TOKEN_UNUSED)) for i in range(vocab_size)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    if not merges:
        # gguf stores no empty array and llama.cpp's gpt2 vocabulary needs its merges: a byte tokenizer
        # gets one merge whose product is no token, which llama.cpp spells back as its two byte tokens
        merges = [f"{_NO_TOKEN_MERGE[0]} {_NO_TOKEN_MERGE[1]}"]
        if "".join(_NO_TOKEN_MERGE) in model["vocab"]:
            raise ServingError("the tokenizer has no merges but a token '~~': cannot write its vocabulary")
    pre = data.get("pre_tokenizer") or {}
    regex = pre.get("type") == "ByteLevel" and pre.get("use_regex", True)
    meta: dict[str, tuple[str, Any]] = {
        "tokenizer.ggml.model": ("str", "gpt2"),
        # GPT-2's split for a ByteLevel pre-tokenizer with its regex; without merges (bytes) any split is exact
        "tokenizer.ggml.pre": ("str", "gpt-2" if regex else "default"),
        "tokenizer.ggml.tokens": ("str[]", [t for t, _ in names]),
        "tokenizer.ggml.token_type": ("i32[]", [k for _, k in names]),
        "tokenizer.ggml.merges": ("str[]", merges),
        "tokenizer.ggml.add_bos_token": ("bool", False),
        "tokenizer.ggml.add_eos_token": ("bool", False),
    }
    for key in ("bos", "eos", "pad"):
        if special.get(f"{key}_token_id") is not None:
            meta[f"tokenizer.ggml.{key}_token_id"] = ("u32", int(special[f"{key}_token_id"]))
    return meta


# ----------------------------------------------------------------------------- writing


def write_gguf(
    model, path, *, dtype: str = "float32", tokenizer=None, special: dict[str, int] | None = None, name: str = "attnres"
) -> Path:
    """Write ``model`` (AttnResLM / AttnResForCausalLM, Kimi Linear backbone) to the GGUF file ``path``.
    ``dtype``: "float32", "float16" or "bfloat16" for the matrices (vectors, convolutions and the
    router stay float32). ``tokenizer``: a ``tokenizers.Tokenizer`` (byte-level BPE), or None for a
    file without vocabulary (structure tests; llama.cpp needs one). ``special``: bos / eos / pad ids."""
    gguf = _import_gguf()
    if dtype not in OUT_TYPES:
        raise ServingError(f"dtype={dtype!r}: GGUF output is one of {', '.join(OUT_TYPES)}")
    lm = _lm(model)
    b = check_gguf(lm.config)
    tensors = gguf_tensors(lm)
    meta = gguf_metadata(lm.config, b)
    if tokenizer is not None:
        meta.update(tokenizer_metadata(tokenizer, lm.config.vocab_size, special or {}))
    qname, file_type = OUT_TYPES[dtype]
    path = Path(path)
    with atomic_path(path) as tmp:  # a write cut short leaves no file with a valid header under path
        _write_gguf_file(gguf, tmp, tensors, meta, qname, file_type, name)
    return path


def _write_gguf_file(gguf, path: Path, tensors, meta, qname: str, file_type: int, name: str) -> None:
    qtype = getattr(gguf.GGMLQuantizationType, qname)
    writer = gguf.GGUFWriter(str(path), ARCH)
    writer.add_string("general.name", name)
    writer.add_uint32("general.file_type", file_type)
    kinds = {"u32": writer.add_uint32, "f32": writer.add_float32, "bool": writer.add_bool, "str": writer.add_string}
    for key, (kind, value) in meta.items():
        if kind.endswith("[]"):
            sub = {
                "u32[]": gguf.GGUFValueType.UINT32,
                "i32[]": gguf.GGUFValueType.INT32,
                "str[]": gguf.GGUFValueType.STRING,
            }[kind]
            writer.add_key_value(key, list(value), gguf.GGUFValueType.ARRAY, sub_type=sub)
        else:
            kinds[kind](key, value)
    for tname, array in tensors.items():
        data = array.astype(np.float32)
        if qname == "F32" or _stays_float32(tname, array):
            writer.add_tensor(tname, data)
        elif qname == "F16":
            writer.add_tensor(tname, data.astype(np.float16))
        else:
            writer.add_tensor(tname, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def load_for_serving(source):
    """(AttnResForCausalLM, ``tokenizers.Tokenizer`` or None, special ids) of a run / checkpoint
    directory, an AttnRes Hugging Face directory or a Kimi Linear checkpoint (plain: PreNorm)."""
    from attnres.hf.convert import reading_model
    from attnres.hf.directories import source_kind
    from attnres.hf.tokenizer import hf_tokenizer

    src = Path(source)
    kind = source_kind(src)
    if kind != "native":
        from attnres.hf.remote_code import refuse_remote_code

        refuse_remote_code(src)
    if kind == "native":
        from attnres.hf.modeling import native_to_hf_with_tokenizer

        model, native = native_to_hf_with_tokenizer(src)
        tokenizer = hf_tokenizer(native).backend_tokenizer if native is not None else None
    elif kind == "attnres":
        from transformers import AutoModelForCausalLM

        import attnres.hf  # noqa: F401  (registers the model with AutoModelForCausalLM)

        with reading_model(src):
            model = AutoModelForCausalLM.from_pretrained(str(src), local_files_only=True, trust_remote_code=False)
        tokenizer = _tokenizer_file(src)
    elif kind == "kimi_linear":
        from attnres.hf.convert import read_source_config
        from attnres.hf.kimi import attn_res_block_size, convert_kimi_linear
        from attnres.hf.kimi.k3 import read_k3_config

        config = read_k3_config(src) or read_source_config(src, "a kimi_linear checkpoint directory")
        plain = attn_res_block_size(config) is None
        with reading_model(src):
            model = convert_kimi_linear(src, residual="prenorm" if plain else None)
        tokenizer = _tokenizer_file(src)
    else:
        raise _not_kimi(src)
    special = {k: getattr(model.config, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    return model.eval(), tokenizer, special


def _not_kimi(src: Path) -> ServingError:
    """Why a Hugging Face model of another family has no GGUF / MLX form here, and what serves it."""
    config = json.loads((src / "config.json").read_text(encoding="utf-8"))  # source_kind read it already
    options = config.get("attnres_retrofit")
    family = options.get("source_model_type") if isinstance(options, dict) else config.get("model_type")
    k3 = (
        "GGUF and MLX export write Kimi K3 (llama.cpp's kimi-k3, mlx-lm's kimi_k3), which only models with the "
        "Kimi Linear backbone have"
    )
    if isinstance(options, dict):
        return ServingError(
            f"{src} is a retrofit of a {family} model (AttnRes around its own layers, model_type "
            f"'attnres_retrofit'): {k3}; no converter gives a {family} model that backbone. Serve the retrofit "
            "with transformers (AutoModelForCausalLM.from_pretrained) or train a Kimi Linear-backbone model "
            "(--set backbone=kimi_linear)"
        )
    return ServingError(
        f"{src} is a {family} Hugging Face model, not AttnRes with the Kimi Linear backbone: {k3}, and a "
        f"{family} model, retrofitted or not, has none. Export the plain model with llama.cpp's "
        "convert_hf_to_gguf.py / mlx_lm.convert, or serve a retrofit of it with transformers"
    )


def _tokenizer_file(src: Path):
    from tokenizers import Tokenizer

    path = src / "tokenizer.json"
    return Tokenizer.from_file(str(path)) if path.is_file() else None


def convert_to_gguf(
    source, out, *, dtype: str | None = None, force: bool = False, log: Callable[[str], None] = print
) -> Path:
    """``attnres convert SOURCE OUT.gguf --to gguf``: :func:`load_for_serving` then :func:`write_gguf`
    (``dtype``: "float32" default, "float16", "bfloat16")."""
    out = Path(out)
    dtype = "float32" if dtype in (None, "auto") else dtype
    if dtype not in OUT_TYPES:
        raise ServingError(f"--dtype {dtype}: GGUF output is one of {', '.join(OUT_TYPES)}")
    if out.is_dir():
        raise ServingError(
            f"{out} is a directory; GGUF output is one file: name the file (such as {out / 'model.gguf'})"
        )
    if out.exists() and not force:
        raise ServingError(f"{out} exists; pass --force to overwrite it, or choose another file name")
    from attnres.files import nested_paths

    nested = nested_paths(source, out)
    if nested is not None:
        raise ServingError(f"{nested}; write the GGUF file outside {source}")
    from attnres.hf.directories import check_writable

    check_writable(out, "file")
    model, tokenizer, special = load_for_serving(source)
    b = check_gguf(model.config.model_config())
    if tokenizer is None:
        raise ServingError(
            f"{source} has no tokenizer (tokenizer.json): llama.cpp needs the vocabulary; convert "
            "a run directory (it keeps its tokenizer) or add tokenizer.json"
        )
    write_gguf(model, out, dtype=dtype, tokenizer=tokenizer, special=special, name=Path(source).name)
    layout = "PreNorm" if b is None else f"Block AttnRes, attn_res.block_size={b}"
    log(f"written {out}: llama.cpp kimi-k3, {model.config.model_config().n_layers} layers, {layout}, {dtype}")
    return out
