"""Our Kimi Linear-backbone models as mlx-lm's ``kimi_k3`` (an independent K3 implementation, used as
an oracle by ``tests/serving/test_mlx.py`` and for serving on Apple silicon).

:func:`save_mlx` writes a K3 checkpoint directory: the weights in the released layout that
``attnres.hf.kimi.save_kimi_linear`` writes (per-expert ``w1``/``w2``/``w3``, separate short
convolutions, docs/method.md §10's ``*_res_proj`` / ``*_res_norm``), and a ``config.json`` with
``model_type = "kimi_k3"`` whose ``text_config`` is :func:`attnres.serving.k3.k3_text_config`
(SiTU with the beta that makes it SwiGLU). ``mlx_lm.load`` / ``mlx_lm.generate`` read the directory
once a tokenizer is copied beside it; :func:`mlx_logits` runs it on token ids without one.
Needs ``pip install 'attnres[mlx]'`` (mlx; on Linux its CPU build) only to run, not to write.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

from attnres.model.backbones import moe_layers
from attnres.serving.k3 import ServingError, k3_text_config

_DENSE_STORED = "block_sparse_moe."  # transformers' Kimi Linear mapping stores every layer's MLP there


def _dense_mlps_as_mlp(out: Path, dense: list[int]) -> None:
    """Rename the dense layers' MLP weights to ``model.layers.{i}.mlp.*``, where K3 keeps them (the
    mixture of experts alone lives under ``block_sparse_moe``)."""
    from safetensors.numpy import load_file, save_file

    prefixes = tuple(f"model.layers.{i}.{_DENSE_STORED}" for i in dense)
    index_path = out / "model.safetensors.index.json"
    index = json.loads(index_path.read_text()) if index_path.is_file() else None
    for name in sorted(set(index["weight_map"].values())) if index else ["model.safetensors"]:
        tensors = load_file(str(out / name))
        renamed = {_renamed(k, prefixes): v for k, v in tensors.items()}
        if renamed.keys() != tensors.keys():
            save_file(renamed, str(out / name), metadata={"format": "pt"})
    if index:
        index["weight_map"] = {_renamed(k, prefixes): v for k, v in index["weight_map"].items()}
        index_path.write_text(json.dumps(index, indent=2, sort_keys=True))


def _renamed(name: str, prefixes: tuple[str, ...]) -> str:
    for p in prefixes:
        if name.startswith(p):
            return p[: -len(_DENSE_STORED)] + "mlp." + name[len(p) :]
    return name


def save_mlx(model, out_dir) -> Path:
    """Write ``model`` (AttnResLM / AttnResForCausalLM, Kimi Linear backbone, PreNorm or Block AttnRes
    that the §10 layout stores) as a ``kimi_k3`` checkpoint directory for mlx-lm."""
    from attnres.hf.kimi import save_kimi_linear

    lm = getattr(model, "model", model) if not hasattr(model, "residual") else model
    text = k3_text_config(lm.config)  # refuses what K3 cannot express before anything is written
    out = Path(out_dir)
    save_kimi_linear(lm, out)
    _dense_mlps_as_mlp(out, [i for i, sparse in enumerate(moe_layers(lm.config)) if not sparse])
    config = {
        "model_type": "kimi_k3",
        "architectures": ["KimiK3ForConditionalGeneration"],
        "text_config": text,
        "tie_word_embeddings": False,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return out


def convert_to_mlx(source, out, *, force: bool = False, log: Callable[[str], None] = print) -> Path:
    """``attnres convert SOURCE OUT --to mlx``: a run, AttnRes Hugging Face or Kimi Linear directory as
    a ``kimi_k3`` directory with its tokenizer (``mlx_lm.generate --model OUT`` reads it)."""
    from attnres.serving.gguf import load_for_serving

    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise ServingError(f"{out} exists and is not empty; pass --force to write into it, or choose another directory")
    model, tokenizer, special = load_for_serving(source)
    save_mlx(model, out)
    if tokenizer is not None:
        from transformers import PreTrainedTokenizerFast

        names = {k.replace("_id", ""): tokenizer.id_to_token(i) for k, i in special.items() if i is not None}
        PreTrainedTokenizerFast(
            tokenizer_object=tokenizer, clean_up_tokenization_spaces=False, **names
        ).save_pretrained(str(out))
    log(f"written {out}: mlx-lm kimi_k3{'' if tokenizer is not None else ' (no tokenizer: add one for mlx_lm.load)'}")
    return out


def mlx_logits(path, input_ids) -> np.ndarray:
    """Logits [batch, tokens, vocab] (float32 numpy) of mlx-lm's ``kimi_k3`` model loaded from the
    directory ``path`` on ``input_ids`` (an integer array or tensor [batch, tokens]), on the CPU."""
    try:
        import mlx.core as mx
        from mlx_lm.utils import load_model
    except ImportError as e:
        raise ServingError(f"running mlx-lm needs pip install 'attnres[mlx]' ({e})") from None
    mx.set_default_device(mx.cpu)
    model, _ = load_model(Path(path))
    ids = np.asarray(input_ids.cpu() if hasattr(input_ids, "cpu") else input_ids, dtype=np.int32)
    logits = model(mx.array(ids))
    return np.array(logits.astype(mx.float32))
