"""Our Kimi Linear-backbone models as mlx-lm's ``kimi_k3`` (an independent K3 implementation, used as
an oracle by ``tests/serving/test_mlx.py`` and for serving on Apple silicon).

:func:`save_mlx` writes a K3 checkpoint directory: the weights in the released K3 layout
(``attnres.hf.kimi.k3_layout``: per-expert ``w1``/``w2``/``w3``, separate short convolutions,
docs/method.md §10's ``*_res_proj`` / ``*_res_norm``, K3's gates and latent MoE projections), and a
``config.json`` with ``model_type = "kimi_k3"`` whose ``text_config`` is
:func:`attnres.serving.k3.k3_text_config` (SiTU with the model's beta, or the one that makes it
SwiGLU; K3's options). ``attnres.hf.kimi.convert_kimi_linear`` reads it back exactly.
``mlx_lm.load`` / ``mlx_lm.generate`` read the directory
once a tokenizer is copied beside it; :func:`mlx_logits` runs it on token ids without one.
Needs ``pip install 'attnres[mlx]'`` (mlx; on Linux its CPU build) only to run, not to write.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from attnres.serving.k3 import ServingError, k3_text_config

# --dtype -> the weights' dtype in the file (mlx-lm runs these three; "auto" keeps the model's)
MLX_DTYPES = ("float32", "float16", "bfloat16")


def save_mlx(model, out_dir, *, dtype: str | None = None) -> Path:
    """Write ``model`` (AttnResLM / AttnResForCausalLM, Kimi Linear backbone, PreNorm or Block AttnRes
    that the §10 layout stores) as a ``kimi_k3`` checkpoint directory for mlx-lm. ``dtype``: one of
    :data:`MLX_DTYPES` for the floating-point weights (None or "auto": the model's own). Each file is
    written atomically."""
    import torch
    from safetensors.torch import save_file

    from attnres.files import atomic_path, atomic_write_json
    from attnres.hf.kimi import kimi_state_dict
    from attnres.hf.kimi.k3_layout import released_names

    cast = _mlx_dtype(dtype)
    lm = getattr(model, "model", model) if not hasattr(model, "residual") else model
    text = k3_text_config(lm.config)  # refuses what K3 cannot express before anything is written
    if cast is None and lm.embed.weight.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ServingError(
            f"the model's weights are {str(lm.embed.weight.dtype).removeprefix('torch.')}, which mlx-lm does not "
            f"run; pass --dtype (dtype=) one of {', '.join(MLX_DTYPES)}"
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = released_names(kimi_state_dict(lm), lm.config)
    if cast is not None:
        target = getattr(torch, cast)
        tensors = {k: v.to(target) if v.is_floating_point() else v for k, v in tensors.items()}
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    with atomic_path(out / "model.safetensors") as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    config = {
        "model_type": "kimi_k3",
        "architectures": ["KimiK3ForConditionalGeneration"],
        "text_config": text,
        "tie_word_embeddings": False,
    }
    atomic_write_json(out / "config.json", config)
    return out


def _mlx_dtype(dtype: str | None) -> str | None:
    if dtype in (None, "auto"):
        return None
    if dtype not in MLX_DTYPES:
        raise ServingError(f"--dtype {dtype}: mlx-lm runs weights in {', '.join(MLX_DTYPES)}; pick one of them")
    return dtype


def convert_to_mlx(
    source, out, *, dtype: str | None = None, force: bool = False, log: Callable[[str], None] = print
) -> Path:
    """``attnres convert SOURCE OUT --to mlx``: a run, AttnRes Hugging Face or Kimi Linear directory as
    a ``kimi_k3`` directory with its tokenizer (``mlx_lm.generate --model OUT`` reads it). ``dtype``: see
    :func:`save_mlx`. ``force``: replace an ``out`` that holds a model written earlier; the whole
    directory is written beside it and renamed once complete
    (:func:`attnres.hf.directories.check_output_dir`)."""
    from attnres.files import atomic_directory
    from attnres.hf.directories import check_output_dir
    from attnres.serving.gguf import load_for_serving

    out = Path(out)
    _mlx_dtype(dtype)
    check_output_dir(source, out, force)
    model, tokenizer, special = load_for_serving(source)
    with atomic_directory(out, replace=True) as tmp:
        save_mlx(model, tmp, dtype=dtype)
        if tokenizer is not None:
            from transformers import PreTrainedTokenizerFast

            names = {k.replace("_id", ""): tokenizer.id_to_token(i) for k, i in special.items() if i is not None}
            PreTrainedTokenizerFast(
                tokenizer_object=tokenizer, clean_up_tokenization_spaces=False, **names
            ).save_pretrained(str(tmp))
    weights = "" if dtype in (None, "auto") else f", {dtype}"
    log(
        f"written {out}: mlx-lm kimi_k3{weights}"
        f"{'' if tokenizer is not None else ' (no tokenizer: add one for mlx_lm.load)'}"
    )
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
