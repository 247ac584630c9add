"""``save_kimi_linear``: our Kimi Linear models written back as Kimi Linear checkpoints (prenorm as a
plain one, Block AttnRes in the §10 layout).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from attnres.hf.convert import ConversionError
from attnres.hf.kimi.layout import (
    MULTIMODAL_PREFIX,
    checkpoint_name,
    is_residual_name,
    residual_name,
)
from attnres.hf.modeling import AttnResForCausalLM
from attnres.model.config import ModelConfig
from attnres.model.k3 import K3_OPTIONS
from attnres.model.lm import AttnResLM


def released_block_size(model_config: ModelConfig) -> int | None:
    """B for the §10 layout (None: prenorm, written as a plain checkpoint); or a ConversionError
    naming the option the layout cannot store."""
    c = model_config
    if c.residual == "prenorm":
        return None
    if c.residual != "block":
        raise ConversionError(
            f"ModelConfig.residual={c.residual!r} cannot be written in the released layout "
            "(docs/method.md §10): it stores Block AttnRes only; use residual='block' or 'prenorm'"
        )
    for name, value, allowed in (
        ("attnres_weights", c.attnres_weights, "pseudo_query"),
        ("attnres_kernel", c.attnres_kernel, "softmax"),
        ("attnres_key_norm", c.attnres_key_norm, True),
        ("attnres_heads", c.attnres_heads, 1),
        ("attnres_scale_norm_eps", c.attnres_scale_norm_eps, False),
    ):
        if value != allowed:
            fix = (
                (
                    " (a retrofit: --set attnres_scale_norm_eps=false; the logits then move from the source's "
                    "by the eps term only)"
                )
                if name == "attnres_scale_norm_eps"
                else ""
            )
            raise ConversionError(
                f"ModelConfig.{name}={value!r} cannot be written in the released layout "
                f"(docs/method.md §10), which has {name}={allowed!r} only{fix}"
            )
    S, L = c.block_size, c.n_sublayers
    if S == L:
        return c.n_layers  # one depth block: any B >= the layer count
    if S % 2:
        raise ConversionError(
            f"ModelConfig.attnres_block_size={S} is odd; the released layout counts depth "
            "blocks in whole decoder layers (S = 2B): use an even S or a single block"
        )
    return S // 2


def k3_options_set(model_config: ModelConfig) -> list[str]:
    """The Kimi K3 options (``attnres.model.k3_blocks``) ``model_config`` sets away from their default."""
    import dataclasses

    defaults = {f.name: f.default for f in dataclasses.fields(model_config)}
    return [name for name in K3_OPTIONS if getattr(model_config, name) != defaults[name]]


@torch.no_grad()
def kimi_state_dict(lm: AttnResLM, *, language_model: bool = False) -> dict[str, torch.Tensor]:
    """Our model's tensors under the names of transformers' Kimi Linear modules, plus the §10
    depth-attention weights for Block AttnRes (what :func:`save_kimi_linear` writes, before
    transformers turns the module names into the released checkpoint layout)."""
    c = lm.config
    b = released_block_size(c)
    out = {}
    for name, t in lm.state_dict().items():
        if name.startswith("residual.") or (name == "lm_head.weight" and c.tie_embeddings):
            continue
        out[checkpoint_name(name)] = t
    if c.tie_embeddings:  # transformers' Kimi Linear never ties: store the head explicitly
        out["lm_head.weight"] = lm.embed.weight
    if b is not None:
        for j in range(c.n_sublayers + 1):
            out[residual_name(j, c.n_layers, "proj")] = lm.residual.get_parameter("queries")[j].detach().reshape(1, -1)
            out[residual_name(j, c.n_layers, "norm")] = lm.residual.get_parameter("key_norm_weight")[j].detach()
    if language_model:
        out = {MULTIMODAL_PREFIX + k: v for k, v in out.items()}
    return {k: v.detach().contiguous().clone() for k, v in out.items()}


def kimi_config_dict(model_config: ModelConfig) -> dict[str, Any]:
    """config.json of the checkpoint: transformers' KimiLinearConfig plus ``attn_res_block_size``."""
    from attnres.model.kimi_linear import kimi_linear_config

    if model_config.backbone != "kimi_linear":
        raise ConversionError(
            f"ModelConfig.backbone={model_config.backbone!r}: only kimi_linear models are "
            "written as Kimi Linear checkpoints"
        )
    b = released_block_size(model_config)
    k3 = k3_options_set(model_config)
    if k3:
        raise ConversionError(
            f"ModelConfig.{k3[0]}={getattr(model_config, k3[0])!r} is a Kimi K3 option, which a kimi_linear "
            "checkpoint (transformers' KimiLinearForCausalLM) cannot hold: write a K3 checkpoint instead "
            "(attnres convert RUN OUT --to mlx, attnres.serving.mlx.save_mlx)"
        )
    hf = kimi_linear_config(model_config, tie_word_embeddings=False)
    data = hf.to_dict()
    data["architectures"] = ["KimiLinearForCausalLM"]
    if b is not None:
        data["attn_res_block_size"] = b
    return data


def save_kimi_linear(model, out_dir, *, language_model: bool = False, dtype: torch.dtype | None = None) -> Path:
    """Write ``model`` (an AttnResLM or AttnResForCausalLM, backbone="kimi_linear") as a Kimi Linear
    checkpoint directory; Block AttnRes in the §10 layout.

    The Kimi Linear part is written by transformers (``KimiLinearForCausalLM.save_pretrained``), so the
    files hold the layout released checkpoints use (per-expert ``w1``/``w2``/``w3``, separate short
    convolutions), sharded as transformers shards; the depth-attention weights and
    ``attn_res_block_size`` are then added. ``language_model``: prefix every tensor name with
    ``language_model.`` (multimodal releases). ``dtype``: cast the weights (the routers' balancing
    bias stays float32, as in transformers)."""
    from safetensors.torch import load_file, save_file
    from transformers import KimiLinearForCausalLM

    from attnres.model.kimi_linear import kimi_linear_config

    lm = model.model if isinstance(model, AttnResForCausalLM) else model
    data = kimi_config_dict(lm.config)
    tensors = kimi_state_dict(lm)
    if dtype is not None:
        tensors = {k: (v if k.endswith("e_score_correction_bias") else v.to(dtype)) for k, v in tensors.items()}
    residual = {k: tensors.pop(k) for k in list(tensors) if is_residual_name(k)}
    with torch.device("meta"):
        text_model = KimiLinearForCausalLM(kimi_linear_config(lm.config, tie_word_embeddings=False))
    text_model.load_state_dict(tensors, strict=True, assign=True)
    out = Path(out_dir)
    text_model.save_pretrained(str(out))
    index_path = out / "model.safetensors.index.json"
    index = json.loads(index_path.read_text()) if index_path.is_file() else None
    files = sorted(set(index["weight_map"].values())) if index else ["model.safetensors"]
    if residual:
        extra = "model-attn-res.safetensors" if index else "model.safetensors"
        if index:
            files.append(extra)
            save_file(residual, str(out / extra), metadata={"format": "pt"})
            index["weight_map"].update(dict.fromkeys(residual, extra))
        else:
            save_file({**load_file(str(out / extra)), **residual}, str(out / extra), metadata={"format": "pt"})
    if language_model:
        for name in files:
            shard = load_file(str(out / name))
            save_file({MULTIMODAL_PREFIX + k: v for k, v in shard.items()}, str(out / name), metadata={"format": "pt"})
        if index:
            index["weight_map"] = {MULTIMODAL_PREFIX + k: v for k, v in index["weight_map"].items()}
    if index:
        index_path.write_text(json.dumps(index, indent=2, sort_keys=True))
    written = json.loads((out / "config.json").read_text())
    if "attn_res_block_size" in data:
        written["attn_res_block_size"] = data["attn_res_block_size"]
    (out / "config.json").write_text(json.dumps(written, indent=2, sort_keys=True))
    return out
