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

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

from attnres.serving.k3 import ServingError, k3_text_config


def save_mlx(model, out_dir) -> Path:
    """Write ``model`` (AttnResLM / AttnResForCausalLM, Kimi Linear backbone, PreNorm or Block AttnRes
    that the §10 layout stores) as a ``kimi_k3`` checkpoint directory for mlx-lm."""
    from safetensors.torch import save_file

    from attnres.hf.kimi import kimi_state_dict
    from attnres.hf.kimi.k3_layout import released_names

    lm = getattr(model, "model", model) if not hasattr(model, "residual") else model
    text = k3_text_config(lm.config)  # refuses what K3 cannot express before anything is written
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = released_names(kimi_state_dict(lm), lm.config)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
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
