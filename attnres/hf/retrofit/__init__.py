"""Retrofitting any supported transformers decoder into AttnRes by wrapping its own layers.

- :func:`retrofit`: a causal LM (object or directory) -> the same model with AttnRes residual wiring
  (exact at init); ``save_pretrained`` keeps its modules' weight names, ``AutoModelForCausalLM``
  loads it back after ``import attnres.hf``;
- :data:`FAMILIES`: the families wrapped and how each layer splits into sublayers (``families``).

Modules import one way: ``model`` -> ``families``.
"""

from attnres.hf.retrofit.families import (
    FAMILIES,
    REFUSED,
    UNNORMALISED,
    Family,
    Part,
    Sublayer,
    family_name,
)
from attnres.hf.retrofit.model import (
    MODEL_TYPE,
    RetrofitConfig,
    check_family,
    family_of,
    max_logit_difference,
    register,
    retrofit,
    retrofit_classes,
)

__all__ = [
    "FAMILIES",
    "MODEL_TYPE",
    "REFUSED",
    "UNNORMALISED",
    "Family",
    "Part",
    "RetrofitConfig",
    "Sublayer",
    "check_family",
    "family_name",
    "family_of",
    "max_logit_difference",
    "register",
    "retrofit",
    "retrofit_classes",
]
