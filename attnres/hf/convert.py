"""Retrofitting: pretrained LLaMA-family causal LMs -> AttnRes.

Retrofitting (docs/method.md §3). With zero pseudo-queries every depth weight is
uniform, so sublayer l reads the mean S_l / K_l of its K_l sources, where S_l
is exactly the PreNorm residual sum of the source model. The sublayer's
RMSNorm removes the 1/K_l:

    RMSNorm(S / K) = g * S / sqrt(mean(S^2) + K^2 eps)

so with the same eps the converted model would equal the original except that
each norm's eps is effectively multiplied by K_l^2 (the final norm likewise sees
the mean of all N + 1 block sums). Conversion therefore turns on
``attnres_scale_norm_eps`` (docs/method.md §3): each depth-mixed norm uses
eps / K_l^2, which cancels that factor, and the converted model computes the
source model's logits to floating-point rounding (`attnres convert` checks it on a
sample batch unless told not to).
Everything else (weights, RoPE, GQA, SwiGLU, tied head) maps one to one.

What AttnResLM cannot express is rejected with a :class:`ConversionError`
naming the feature and the config field, never silently approximated.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import pickle
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from attnres.hf.errors import ConversionError, config_error
from attnres.hf.modeling import AttnResForCausalLM
from attnres.hf.remote_code import refuse_remote_code
from attnres.hf.retrofit import FAMILIES, check_family, family_name, retrofit
from attnres.model.config import ModelConfig
from attnres.model.llama import rope_tables
from attnres.model.lm import AttnResLM
from attnres.residual import build_residual

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")  # the native layout; the wrapped one takes FAMILIES
LAYOUTS = ("auto", "native", "wrapped")
# residual schemes whose fresh initialisation computes the PreNorm function
EQUIVALENT_RESIDUALS = ("block", "full", "prenorm")
# ModelConfig fields that come from the source model and cannot be overridden
_FROM_SOURCE = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "rope_theta", "tie_embeddings")

_LAYER_MAP = {
    "self_attn.q_proj.weight": "attn.q_proj.weight",
    "self_attn.k_proj.weight": "attn.k_proj.weight",
    "self_attn.v_proj.weight": "attn.v_proj.weight",
    "self_attn.o_proj.weight": "attn.o_proj.weight",
    "mlp.gate_proj.weight": "mlp.gate_proj.weight",
    "mlp.up_proj.weight": "mlp.up_proj.weight",
    "mlp.down_proj.weight": "mlp.down_proj.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "mlp_norm.weight",
}


# ----------------------------------------------------------------------------- source access


@contextlib.contextmanager
def reading_model(src) -> Iterator[None]:
    """Failures while reading the model in directory ``src`` (no weights, truncated safetensors, bad
    config values) become one ConversionError naming the directory and its weight files."""
    try:
        with warnings.catch_warnings():
            # torch's note about a pickle protocol it may not read: the refusal below says what matters
            warnings.filterwarnings("ignore", message="Detected pickle protocol", category=UserWarning)
            yield
    except ConversionError:
        raise
    except pickle.UnpicklingError as e:
        # torch.load(weights_only=True) refused objects other than tensors: nothing ran, say so in one line
        raise ConversionError(
            f"refused to load the weights in {src}: a *.bin file holds pickled objects other than tensors "
            f"({' '.join(str(e).split())[:120]}...). Nothing was executed; convert the weights to safetensors "
            "with a tool you trust, or use a directory with model.safetensors"
        ) from None
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise _load_error(Path(src), e) from e
    except Exception as e:  # safetensors' SafetensorError derives from Exception only
        if (invalid := config_error(Path(src) / "config.json", e)) is not None:
            raise invalid from None
        if type(e).__name__ != "SafetensorError":
            raise
        raise _load_error(Path(src), e) from e


def _load_error(src: Path, e: Exception) -> ConversionError:
    weights = sorted(p.name for p in src.glob("*.safetensors")) + sorted(p.name for p in src.glob("*.bin"))
    files = ", ".join(weights) if weights else "no *.safetensors or *.bin weight files"
    detail = " ".join(str(e).split())[:300].rstrip(".")
    return ConversionError(
        f"cannot load the model in {src} ({files}): {type(e).__name__}: {detail}. Fix: copy "
        "the complete model directory (config.json and every weight file) again"
    )


def read_safetensors_dir(path: Path) -> dict[str, torch.Tensor] | None:
    """Every tensor of a (possibly sharded) safetensors checkpoint, or None if there is none."""
    from safetensors.torch import load_file

    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        return None
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        tensors.update(load_file(str(path / name), device="cpu"))
    return tensors


def check_state_fits(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str) -> None:
    """One-line errors for a state dict (``what``: "source", "checkpoint") that lacks tensors the
    model's ``expected`` state dict has, or holds them in other shapes."""
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ConversionError(f"the {what} lacks tensors the model needs: {missing[:8]}")
    shapes = [
        f"{k}: {what} {tuple(state[k].shape)}, expected {tuple(expected[k].shape)}"
        for k in expected
        if tuple(state[k].shape) != tuple(expected[k].shape)
    ]
    if shapes:
        raise ConversionError(f"tensor shapes do not match the config: {shapes[:4]}")


def read_source_config(path: Path, expected: str):
    """The transformers config of a local checkpoint directory (offline); ``expected`` names what the
    caller takes, for the error when the directory has no config.json."""
    if not (path / "config.json").is_file():
        raise ConversionError(f"{path} has no config.json: pass {expected} or a model object")
    refuse_remote_code(path)
    from transformers import AutoConfig

    with reading_model(path):  # an invalid config.json: one line
        return AutoConfig.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)


def _load_source(model_or_dir, copy_weights: bool) -> tuple[Any, dict[str, torch.Tensor]]:
    """(HF config, state dict) of a model object or a local directory."""
    if isinstance(model_or_dir, (str, os.PathLike)):
        path = Path(model_or_dir)
        config = read_source_config(path, "a Hugging Face model directory (config.json + weights)")
        with reading_model(path):
            tensors = read_safetensors_dir(path)
            if tensors is None:  # e.g. pytorch_model.bin: let transformers read it
                from transformers import AutoModelForCausalLM

                model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
                tensors = dict(model.state_dict())
        return config, tensors
    config = getattr(model_or_dir, "config", None)
    if config is None or not hasattr(model_or_dir, "state_dict"):
        raise ConversionError(
            f"cannot convert a {type(model_or_dir).__name__}: pass a transformers "
            "causal LM (e.g. LlamaForCausalLM) or a directory holding one"
        )
    tensors = {k: (v.detach().clone() if copy_weights else v.detach()) for k, v in model_or_dir.state_dict().items()}
    return config, tensors


# ----------------------------------------------------------------------------- architecture checks


def _feature_error(feature: str, field: str, value, why: str) -> ConversionError:
    return ConversionError(f"cannot convert: unsupported {feature} ({field}={value!r}): {why}")


def _rope_theta(config) -> float:
    """RoPE base from ``rope_parameters`` (transformers 5) or ``rope_theta`` / ``rope_scaling`` (4.x);
    anything but plain RoPE on the whole head is rejected."""
    params = getattr(config, "rope_parameters", None)
    scaling = getattr(config, "rope_scaling", None)
    if params is None and isinstance(scaling, Mapping) and "rope_theta" in scaling:
        params = scaling  # transformers 5 keeps rope_scaling as an alias of rope_parameters
        scaling = None
    if isinstance(params, Mapping):
        if any(isinstance(v, Mapping) for v in params.values()):
            raise _feature_error(
                "per-layer-type RoPE parameters",
                "rope_parameters",
                dict(params),
                "AttnResLM has one RoPE for every layer",
            )
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type != "default":
            raise _feature_error(
                f"RoPE scaling '{rope_type}'",
                "rope_parameters['rope_type']",
                rope_type,
                "AttnResLM implements plain RoPE (rope_type 'default') only",
            )
        factor = params.get("partial_rotary_factor", 1.0)
        if factor not in (None, 1, 1.0):
            raise _feature_error(
                "partial rotary embeddings",
                "rope_parameters['partial_rotary_factor']",
                factor,
                "AttnResLM rotates the whole head dimension",
            )
        theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    else:
        if scaling:
            kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, Mapping) else scaling
            raise _feature_error(
                f"RoPE scaling '{kind}'", "rope_scaling", scaling, "AttnResLM implements plain RoPE only"
            )
        theta = getattr(config, "rope_theta", None)
    factor = getattr(config, "partial_rotary_factor", None)
    if factor not in (None, 1, 1.0):
        raise _feature_error(
            "partial rotary embeddings", "partial_rotary_factor", factor, "AttnResLM rotates the whole head dimension"
        )
    if theta is None:
        raise ConversionError("cannot convert: the source config has no RoPE base (rope_theta)")
    return float(theta)


def _sliding_window(config) -> int | None:
    """The attention window of the source model, or None when every layer attends to all of the past."""
    model_type = getattr(config, "model_type", "")
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise _feature_error(
                f"attention layer types {unknown}",
                "layer_types",
                list(layer_types),
                "AttnResLM has causal full attention in every layer",
            )
        if "sliding_attention" not in layer_types:
            return None
        return window
    if model_type == "qwen2" and not getattr(config, "use_sliding_window", False):
        return None
    return window


def _check_source(config, tensors: Mapping[str, torch.Tensor], max_seq_len: int | None) -> dict[str, Any]:
    """Validate the source architecture; return the ModelConfig fields it determines."""
    model_type = getattr(config, "model_type", None)
    if model_type == "qwen3":
        raise _feature_error(
            "QK-norm (an RMSNorm on each head's queries and keys: q_norm / k_norm)",
            "model_type",
            model_type,
            "AttnResLM's attention has no query/key norms, so Qwen3 cannot be converted without changing its outputs",
        )
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConversionError(
            f"cannot convert model_type={model_type!r}: supported source models are "
            f"{', '.join(SUPPORTED_MODEL_TYPES)} (LLaMA-style decoders)"
        )
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise _feature_error(f"MLP activation '{act}'", "hidden_act", act, "AttnResLM's MLP is SwiGLU with SiLU")
    d, heads = config.hidden_size, config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if d % heads:
        raise _feature_error(
            "a hidden size not divisible by the head count",
            "num_attention_heads",
            heads,
            f"hidden_size={d} must be a multiple of it",
        )
    head_dim = getattr(config, "head_dim", None)
    if head_dim is not None and head_dim != d // heads:
        raise _feature_error(
            "a head dimension other than hidden_size / num_attention_heads",
            "head_dim",
            head_dim,
            f"AttnResLM uses head_dim = d_model / n_heads = {d // heads}",
        )
    theta = _rope_theta(config)
    positions = getattr(config, "max_position_embeddings", None)
    seq_len = max_seq_len if max_seq_len is not None else positions
    if seq_len is None:
        raise ConversionError("the source config has no max_position_embeddings: pass max_seq_len")
    window = _sliding_window(config)
    if window is not None and window < seq_len:
        switch = ", use_sliding_window=True" if hasattr(config, "use_sliding_window") else ""
        raise _feature_error(
            f"sliding-window attention{switch and ' (' + switch[2:] + ')'}",
            "sliding_window",
            window,
            f"AttnResLM attends to the whole context, which differs from the source beyond {window} tokens. "
            f"Convert with max_seq_len <= {window} (CLI: --max-seq-len {window}) so the converted model "
            "never sees a longer sequence; both attend identically within the window",
        )
    for flag in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(config, flag, None):
            raise _feature_error("logit soft-capping", flag, getattr(config, flag), "AttnResLM has none")

    # biases: AttnResLM's projections have none, so only all-zero biases can be dropped
    for name, t in tensors.items():
        if name.endswith(".bias") and bool(t.detach().ne(0).any()):
            module = name.rsplit(".", 2)[-2]
            if module in ("q_proj", "k_proj", "v_proj", "o_proj"):
                why = (
                    f"{name} is non-zero and AttnResLM's attention projections have no bias; only "
                    "all-zero biases can be dropped"
                )
                if not hasattr(config, "attention_bias"):  # Qwen2: q/k/v biases by design, no switch
                    raise ConversionError(
                        f"cannot convert: unsupported attention projection biases "
                        f"({model_type} always has q/k/v biases): {why}"
                    )
                raise _feature_error("attention projection biases", "attention_bias", config.attention_bias, why)
            if module in ("gate_proj", "up_proj", "down_proj"):
                raise _feature_error(
                    "MLP biases",
                    "mlp_bias",
                    getattr(config, "mlp_bias", True),
                    f"{name} is non-zero and AttnResLM's MLP has no bias",
                )
            raise ConversionError(f"cannot convert: unsupported bias {name} (non-zero; AttnResLM has no place for it)")
    return dict(
        vocab_size=config.vocab_size,
        d_model=d,
        n_layers=config.num_hidden_layers,
        n_heads=heads,
        n_kv_heads=kv_heads,
        d_ff=config.intermediate_size,
        max_seq_len=int(seq_len),
        rope_theta=theta,
        norm_eps=float(config.rms_norm_eps),
        init_std=float(getattr(config, "initializer_range", 0.02) or 0.02),
    )


def _map_weights(
    tensors: Mapping[str, torch.Tensor], n_layers: int, tie_config: bool
) -> tuple[dict[str, torch.Tensor], bool]:
    """Source state dict -> AttnResLM state dict (without the residual scheme); and whether to tie."""
    out: dict[str, torch.Tensor] = {}
    unused = []
    for name, t in tensors.items():
        if name.endswith((".bias", "rotary_emb.inv_freq")):
            continue  # biases checked to be zero; RoPE frequencies are recomputed
        if name == "model.embed_tokens.weight":
            out["embed.weight"] = t
        elif name == "model.norm.weight":
            out["norm.weight"] = t
        elif name == "lm_head.weight":
            out["lm_head.weight"] = t
        elif name.startswith("model.layers."):
            index, _, rest = name[len("model.layers.") :].partition(".")
            if rest in _LAYER_MAP and index.isdigit() and int(index) < n_layers:
                out[f"blocks.{index}.{_LAYER_MAP[rest]}"] = t
            else:
                unused.append(name)
        else:
            unused.append(name)
    if unused:
        raise ConversionError(
            "cannot convert: the source has tensors AttnResLM has no place for (an architecture feature it "
            f"lacks): {sorted(unused)[:8]}{' ...' if len(unused) > 8 else ''}"
        )
    if "embed.weight" not in out:
        raise ConversionError(
            "the source has no model.embed_tokens.weight: pass a causal LM (e.g. LlamaForCausalLM), not a bare decoder"
        )
    head = out.get("lm_head.weight")
    tie = head is None or (tie_config and (head is out["embed.weight"] or torch.equal(head, out["embed.weight"])))
    if head is None and not tie_config:
        raise ConversionError("the source has no lm_head.weight and does not tie its embeddings")
    if tie:
        out["lm_head.weight"] = out["embed.weight"]
    return out, tie


# ----------------------------------------------------------------------------- retrofitting


def convert_to_attnres(
    model_or_dir,
    residual: str = "block",
    attnres_blocks: int | None = None,
    *,
    attnres_block_size: int | None = None,
    max_seq_len: int | None = None,
    dtype: torch.dtype | None = None,
    copy_weights: bool = True,
    layout: str = "auto",
    **model_options,
):
    """Retrofit a pretrained causal LM into AttnRes, exact at init.

    ``layout``: "native" builds our own :class:`AttnResForCausalLM` (``AttnResLM`` inside: the trainer's
    format, ``to_native`` works) and takes LLaMA / Mistral / Qwen2 without what AttnResLM lacks (below);
    "wrapped" wraps the source's own layers (:func:`attnres.hf.retrofit.retrofit`: every family of
    ``attnres.hf.retrofit.FAMILIES``, biases, RoPE scaling, QK-norm, sliding windows and all);
    "auto" (default): wrapped, unless a native-only option is given (``max_seq_len``,
    ``attnres_scale_norm_eps=False``). The wrapped model generates exactly as the source does (past its
    context too); the native one sees the last ``max_seq_len`` tokens there. The rest of this docstring is
    the native layout.

    Native: retrofit a pretrained LLaMA / Mistral / Qwen2 causal LM into an :class:`AttnResForCausalLM`.

    ``model_or_dir``: a transformers model object or a local directory (config.json + weights).
    ``residual``: "block" (Block AttnRes, ``attnres_blocks`` = N or ``attnres_block_size`` = S;
    default: ModelConfig's rule, at most 8 blocks), "full", or "prenorm" (no AttnRes; a plain
    re-packaging). All AttnRes queries start at zero and each norm's eps is divided by the square
    of its source count (``attnres_scale_norm_eps``, on by default), so the logits equal the
    source's to rounding. ``max_seq_len``: the longest input
    (default: the source's ``max_position_embeddings``; must be <= the window of a
    sliding-window model). ``dtype``: cast the weights (default: keep the source's).
    ``copy_weights=False`` lets a model-object source share its tensors with the result.
    ``model_options``: other ModelConfig fields (``attnres_impl``, ``attnres_heads``, ...).
    Raises :class:`ConversionError` for architecture features AttnResLM lacks.
    """
    if residual not in EQUIVALENT_RESIDUALS:
        raise ConversionError(
            f"residual={residual!r}: conversion keeps the model's outputs only for "
            f"{EQUIVALENT_RESIDUALS} (the other schemes do not start as the PreNorm function)"
        )
    if residual in ("block", "full"):
        # exact, not merely up to eps: each norm's eps divided by the square of its source count
        model_options.setdefault("attnres_scale_norm_eps", True)
    fixed = sorted(set(model_options) & set(_FROM_SOURCE))
    if fixed:
        raise ConversionError(f"{fixed} come from the source model and cannot be set")
    if model_options.get("attnres_window") is not None:
        raise ConversionError(
            "attnres_window drops sources, so the converted model would not keep the "
            "source's outputs; convert without it"
        )
    if layout not in LAYOUTS:
        raise ConversionError(f"layout={layout!r}: choose one of {', '.join(LAYOUTS)}")
    if layout == "auto":
        # wrapped (exact, the source's own generation) unless a native-only option asks for our own model
        native_only = max_seq_len is not None or model_options.get("attnres_scale_norm_eps") is False
        if not native_only:
            source_config = (
                read_source_config(Path(model_or_dir), "a Hugging Face model directory (config.json + weights)")
                if isinstance(model_or_dir, (str, os.PathLike))
                else getattr(model_or_dir, "config", None)
            )
            if source_config is not None and getattr(source_config, "attnres_retrofit", None) is None:
                check_family(family_name(source_config))
                layout = "wrapped"
    if layout == "wrapped":
        return _wrapped(
            model_or_dir, residual, attnres_blocks, attnres_block_size, max_seq_len, dtype, copy_weights, model_options
        )
    config, tensors = _load_source(model_or_dir, copy_weights)
    if getattr(config, "attnres_retrofit", None) is not None:
        raise ConversionError(
            "the source is already retrofitted (model_type 'attnres_retrofit', the wrapped layout): "
            "load it with AutoModelForCausalLM and keep training it; it has no native layout"
        )
    try:
        fields = _check_source(config, tensors, max_seq_len)
    except ConversionError as e:
        wrappable = family_name(config) in FAMILIES
        if layout == "native" or max_seq_len is not None or not wrappable:
            hint = (
                " (layout='wrapped', attnres convert --to hf: wraps the model's own layers, exact)" if wrappable else ""
            )
            raise ConversionError(f"{e}{hint}") from None
        return _wrapped(
            model_or_dir, residual, attnres_blocks, attnres_block_size, None, dtype, copy_weights, model_options
        )
    weights, tie = _map_weights(tensors, fields["n_layers"], bool(getattr(config, "tie_word_embeddings", False)))
    options = dict(model_options)
    if attnres_blocks is not None:
        options["attnres_blocks"] = attnres_blocks
    if attnres_block_size is not None:
        options["attnres_block_size"] = attnres_block_size
    try:
        model_config = ModelConfig(**{**fields, **options, "residual": residual, "tie_embeddings": tie})
    except (TypeError, ValueError) as e:
        raise ConversionError(f"cannot build the AttnRes model: {e}") from e
    if weights["embed.weight"].shape != (model_config.vocab_size, model_config.d_model):
        raise ConversionError(
            f"model.embed_tokens.weight has shape {tuple(weights['embed.weight'].shape)}, "
            f"config says vocab_size={model_config.vocab_size}, hidden_size={model_config.d_model}"
        )
    dtype = dtype or weights["embed.weight"].dtype
    device = weights["embed.weight"].device

    with torch.device("meta"):
        lm = AttnResLM(model_config)
    state = {k: v.to(dtype=dtype) for k, v in weights.items()}
    with torch.device("cpu"):
        residual_params = build_residual(model_config).state_dict()  # zero queries, unit key norms
    state.update({f"residual.{k}": v.to(dtype=dtype, device=device) for k, v in residual_params.items()})
    check_state_fits(state, lm.state_dict(), "source")
    lm.load_state_dict(state, strict=True, assign=True)
    if tie:
        lm.lm_head.weight = lm.embed.weight
    cos, sin = rope_tables(model_config.head_dim, lm.rope_cos.shape[0], model_config.rope_theta)  # rows built so far
    lm.rope_cos, lm.rope_sin = cos.to(device), sin.to(device)
    special = {k: getattr(config, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    model = AttnResForCausalLM.from_attnres_lm(lm, **{k: v for k, v in special.items() if v is not None})
    model.generation_config = _source_generation_config(model_or_dir) or model.generation_config
    return model.eval()


def _wrapped(
    model_or_dir, residual, attnres_blocks, attnres_block_size, max_seq_len, dtype, copy_weights, model_options
):
    """``layout="wrapped"``: the source's own layers around the depth stream (attnres.hf.retrofit)."""
    if max_seq_len is not None:
        raise ConversionError(
            f"max_seq_len={max_seq_len} applies to the native layout only: the wrapped model "
            "keeps the source's own context handling (sliding windows included)"
        )
    options = dict(model_options)
    if options.pop("attnres_scale_norm_eps", True) is not True:
        raise ConversionError(
            "attnres_scale_norm_eps=False: the wrapped layout always scales the pre-norms' eps "
            "(that is what keeps it exact); use layout='native' to turn it off"
        )
    if isinstance(model_or_dir, (str, os.PathLike)):  # load it here: unreadable files get reading_model's error
        from transformers import AutoModelForCausalLM

        path = Path(model_or_dir)
        read_source_config(path, "a Hugging Face model directory (config.json + weights)")
        with reading_model(path):
            kw = {} if dtype is None else {"dtype": dtype}
            model_or_dir = AutoModelForCausalLM.from_pretrained(
                str(path), local_files_only=True, trust_remote_code=False, **kw
            )
        copy_weights = False
    return retrofit(
        model_or_dir,
        residual,
        attnres_blocks,
        attnres_block_size=attnres_block_size,
        copy_weights=copy_weights,
        dtype=dtype,
        **options,
    )


def _source_generation_config(model_or_dir):
    """The source's generation defaults (eos tokens, sampling settings), if it has any."""
    if isinstance(model_or_dir, (str, os.PathLike)):
        if not (Path(model_or_dir) / "generation_config.json").is_file():
            return None
        from transformers import GenerationConfig

        return GenerationConfig.from_pretrained(str(model_or_dir), local_files_only=True)
    config = getattr(model_or_dir, "generation_config", None)
    return copy.deepcopy(config) if config is not None else None


@torch.no_grad()
def conversion_error(
    source, converted: AttnResForCausalLM, input_ids: torch.Tensor | None = None, seed: int = 0
) -> float:
    """Max |logit difference| between a source causal LM and its conversion on ``input_ids``
    (default: 2 x 32 random tokens)."""
    if input_ids is None:
        gen = torch.Generator().manual_seed(seed)
        length = min(32, converted.config.max_seq_len)
        input_ids = torch.randint(0, converted.config.vocab_size, (2, length), generator=gen)
    device = next(converted.parameters()).device
    a = source(input_ids.to(device)).logits.double()
    b = converted(input_ids.to(device)).logits.double()
    return (a - b).abs().max().item()
