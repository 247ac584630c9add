"""AttnResConfig: a Hugging Face config that carries every ModelConfig field under its own name."""

from __future__ import annotations

import dataclasses
from typing import Any

from transformers import PretrainedConfig

from attnres.model.config import ModelConfig

MODEL_FIELDS = tuple(f.name for f in dataclasses.fields(ModelConfig))
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ModelConfig)}

# the names the Hugging Face ecosystem looks for -> our field names
HF_ALIASES = {
    "hidden_size": "d_model",
    "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads",
    "num_key_value_heads": "n_kv_heads",
    "intermediate_size": "d_ff",
    "max_position_embeddings": "max_seq_len",
    "rms_norm_eps": "norm_eps",
    "tie_word_embeddings": "tie_embeddings",
    "initializer_range": "init_std",
}


class AttnResConfig(PretrainedConfig):
    """Configuration of :class:`attnres.hf.AttnResForCausalLM`.

    Holds every :class:`attnres.ModelConfig` field (``d_model``, ``n_layers``,
    ``residual``, ``attnres_blocks``, ...) with the same name, default and
    validation; the usual Hugging Face names (``hidden_size``,
    ``num_hidden_layers``, ``tie_word_embeddings``, ...) are aliases of them.
    Everything else (``bos_token_id``, ``eos_token_id``, ...) is handled by
    ``PretrainedConfig``.

        config = AttnResConfig(vocab_size=256, d_model=64, n_layers=4, residual="full")
        config.model_config()        # -> ModelConfig(vocab_size=256, d_model=64, ...)
        AttnResConfig.from_model_config(model_config, eos_token_id=0)
    """

    model_type = "attnres"
    attribute_map = dict(HF_ALIASES)

    def __init__(self, **kwargs: Any):
        fields: dict[str, Any] = {}
        for name in MODEL_FIELDS:
            if name in kwargs:
                fields[name] = kwargs.pop(name)
        for alias, name in HF_ALIASES.items():
            if alias not in kwargs:
                continue
            value = kwargs.pop(alias)
            if name in fields and fields[name] != value:
                raise ValueError(
                    f"AttnResConfig got {name}={fields[name]!r} and its alias {alias}={value!r}; give one of them"
                )
            fields[name] = value
        # validated and completed (n_kv_heads, d_ff defaults) by ModelConfig itself
        resolved = ModelConfig(**{**_DEFAULTS, **fields}).to_dict()
        # generate() decodes through attnres.inference.KVCache (see AttnResForCausalLM)
        use_cache = kwargs.pop("use_cache", True)
        super().__init__(**kwargs)
        self.use_cache = use_cache
        for name, value in resolved.items():
            setattr(self, name, value)

    # ------------------------------------------------------------------ ModelConfig bridge
    def model_config(self) -> ModelConfig:
        """The native :class:`ModelConfig` this config describes (a fresh, validated copy)."""
        return ModelConfig(**{name: getattr(self, name) for name in MODEL_FIELDS})

    @classmethod
    def from_model_config(cls, model_config: ModelConfig, **kwargs: Any) -> AttnResConfig:
        """An AttnResConfig with every field of ``model_config`` (plus HF-only options in kwargs)."""
        return cls(**model_config.to_dict(), **kwargs)

    def __eq__(self, other):
        return isinstance(other, AttnResConfig) and self.to_dict() == other.to_dict()

    __hash__ = None  # type: ignore[assignment]  # equal configs compare by value, so they are unhashable
