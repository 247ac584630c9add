"""How each transformers decoder family's layer splits into sublayers (the retrofit's layer specs).

A layer spec names, for each sublayer of one decoder layer, the layer's own modules that compute it:
which norm reads the sublayer's input (its eps is scaled by c_l², docs/method.md §3), which module
runs (attention, called with the layer's own keyword arguments: masks, position embeddings, cache; or
the MLP / MoE block), and what the layer applies to the module's output before adding it to the
residual stream (a post-sublayer norm, a residual multiplier, dropout). A parallel-residual layer
(GPT-NeoX, GPT-J, Phi-2, Cohere, parallel StableLM) is one sublayer whose output is the sum of its
parts, both reading the same depth mixture: the PreNorm function adds both to one residual, so the
AttnRes model reads one mixture for both (docs/own_model.md: ``stream.apply(lambda h: attn(ln1(h)) +
mlp(ln2(h)))``).

Everything else (embeddings and their scale, rotary embeddings and their scaling, masks, sliding
windows, the KV cache, the final norm, the head and its soft-cap) is the source model's own code:
the retrofit only replaces the residual wiring between sublayers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Part:
    """One module of a sublayer: ``output = scale · dropout(post(module(norm(h), ...)))``."""

    module: str  # attribute of the decoder layer: "self_attn", "mlp", ...
    norm: str | None  # the layer's norm reading the sublayer input (None: the raw input)
    attention: bool = False  # called with the layer's keyword arguments; the output is [0]
    post: str | None = None  # a norm on the module's output (Gemma 2/3, OLMo-2, GLM-4)
    dropout: str | None = None  # a dropout on the output (identity in eval mode)
    scale: str | None = None  # a float attribute of the layer multiplying the output (Granite)


@dataclass(frozen=True)
class Sublayer:
    """One sublayer: the sum of its parts (two for a parallel-residual layer)."""

    parts: tuple[Part, ...]

    @property
    def norms(self) -> tuple[str | None, ...]:
        return tuple(dict.fromkeys(p.norm for p in self.parts))


@dataclass(frozen=True)
class Family:
    """A decoder family: where its layers and final norm live (relative to the base model, e.g.
    ``model``), and its layer spec as a function of the config."""

    name: str
    sublayers: Callable[[object], tuple[Sublayer, ...]]
    layers: str = "layers"
    final_norm: str = "norm"
    note: str = ""


def _attn(norm: str | None = "input_layernorm", module: str = "self_attn", **kw) -> Part:
    return Part(module, norm, attention=True, **kw)


def _sequential(attn: Part, mlp: Part) -> Callable[[object], tuple[Sublayer, ...]]:
    return lambda config: (Sublayer((attn,)), Sublayer((mlp,)))


def _parallel(*parts: Part) -> Callable[[object], tuple[Sublayer, ...]]:
    return lambda config: (Sublayer(parts),)


_LLAMA = _sequential(_attn(), Part("mlp", "post_attention_layernorm"))
_POST_NORMED = _sequential(
    _attn(post="post_attention_layernorm"), Part("mlp", "pre_feedforward_layernorm", post="post_feedforward_layernorm")
)


def _gpt_neox(config) -> tuple[Sublayer, ...]:
    attn = _attn(module="attention", dropout="post_attention_dropout")
    mlp = Part("mlp", "post_attention_layernorm", dropout="post_mlp_dropout")
    return (Sublayer((attn, mlp)),) if config.use_parallel_residual else (Sublayer((attn,)), Sublayer((mlp,)))


def _stablelm(config) -> tuple[Sublayer, ...]:
    if config.use_parallel_residual:
        return (Sublayer((_attn(), Part("mlp", "input_layernorm", dropout="dropout"))),)
    return Sublayer((_attn(),)), Sublayer((Part("mlp", "post_attention_layernorm", dropout="dropout"),))


_LLAMA_LIKE = (
    "llama",
    "mistral",
    "ministral",
    "qwen2",
    "qwen3",
    "qwen2_moe",
    "qwen3_moe",
    "mixtral",
    "deepseek_v3",
    "gpt_oss",
    "smollm3",
    "helium",
    "ernie4_5",
    "seed_oss",
    "arcee",
    "gemma",
    "starcoder2",
    "olmo",
)

FAMILIES: dict[str, Family] = {name: Family(name, _LLAMA) for name in _LLAMA_LIKE}
FAMILIES.update(
    {
        "gemma2": Family("gemma2", _POST_NORMED),
        "gemma3_text": Family("gemma3_text", _POST_NORMED),
        "glm4": Family(
            "glm4",
            _sequential(
                _attn(post="post_self_attn_layernorm"),
                Part("mlp", "post_attention_layernorm", post="post_mlp_layernorm"),
            ),
        ),
        "olmo2": Family(
            "olmo2",
            _sequential(
                _attn(None, post="post_attention_layernorm"), Part("mlp", None, post="post_feedforward_layernorm")
            ),
        ),
        "phi3": Family(
            "phi3",
            _sequential(
                _attn(dropout="resid_attn_dropout"),
                Part("mlp", "post_attention_layernorm", dropout="resid_mlp_dropout"),
            ),
        ),
        "granite": Family(
            "granite",
            _sequential(
                _attn(scale="residual_multiplier"), Part("mlp", "post_attention_layernorm", scale="residual_multiplier")
            ),
        ),
        "gpt_neox": Family("gpt_neox", _gpt_neox, final_norm="final_layer_norm"),
        "stablelm": Family("stablelm", _stablelm),
        "phi": Family(
            "phi",
            _parallel(_attn(dropout="resid_dropout"), Part("mlp", "input_layernorm", dropout="resid_dropout")),
            final_norm="final_layernorm",
        ),
        "cohere": Family("cohere", _parallel(_attn(), Part("mlp", "input_layernorm"))),
        "gptj": Family("gptj", _parallel(_attn("ln_1", "attn"), Part("mlp", "ln_1")), layers="h", final_norm="ln_f"),
        "gpt2": Family("gpt2", _sequential(_attn("ln_1", "attn"), Part("mlp", "ln_2")), layers="h", final_norm="ln_f"),
    }
)

# families whose sublayers read the residual stream without a norm in front: zero-init AttnRes reads
# c·S there, and attention / MLP are not scale invariant, so the exact alternative rescales those reads
UNNORMALISED = {
    "olmo2": "OLMo-2's attention and MLP read the residual stream un-normalised (its norms come after "
    "each sublayer), and they are not scale invariant",
    "olmo": "OLMo's LayerNorms have a fixed eps (1e-5, not an attribute), so the c_l² eps scaling cannot be applied",
}

# what the retrofit refuses, by model_type, and why (everything else not in FAMILIES: "not wrapped yet")
REFUSED: dict[str, str] = {
    "kimi_linear": "Kimi Linear has its own retrofit (attnres.hf.kimi: convert_kimi_linear, `attnres convert`)",
    "attnres": "already an AttnRes model",
    "attnres_retrofit": "already retrofitted",
}


def family_name(config) -> str:
    """The family key of a transformers config: its ``model_type`` (a multimodal Gemma 3 config's text
    model is ``gemma3_text``)."""
    return getattr(config, "model_type", None) or type(config).__name__
