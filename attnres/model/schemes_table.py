"""The residual arena as a markdown table: every registered scheme on one model size.

``schemes_table(config)`` lists, for each scheme in ``RESIDUALS``: its Table-5
classification (weight type, source), the parameters it adds to a PreNorm
model of the given size (from its ``extra_params`` formula, checked against
real models in the tests) and the depth state it keeps per token, in units of
d floats (a single running state counts 0; see ``SchemeInfo``).

Each scheme is evaluated on the given config with its own options kept and
every other scheme's options reset to their defaults, so one config serves
all rows (``hyper_streams=8`` changes only the ``hyper`` row).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from attnres.model.backbones import BACKBONES
from attnres.model.config import ModelConfig
from attnres.residual import RESIDUALS

# the demo preset's model (attnres.train.config.PRESETS["demo"]): d = 128, 8 Transformer blocks
DEMO_MODEL: dict[str, Any] = dict(vocab_size=4096, d_model=128, n_layers=8, n_heads=4, max_seq_len=128)


def scheme_config(config: ModelConfig, name: str) -> ModelConfig:
    """``config`` with ``residual=name``, keeping that scheme's options and resetting the others'."""
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    own = set(RESIDUALS[name].options)
    values = config.to_dict()
    for info in RESIDUALS.values():
        for option in info.options:
            if option not in own:
                values[option] = defaults[option]
    values["residual"] = name
    return ModelConfig(**values)


def base_params(config: ModelConfig) -> int:
    """Parameters of the PreNorm model (``AttnResLM`` with ``residual='prenorm'``), as its backbone
    counts them (``attnres.model.backbones``)."""
    return BACKBONES[config.backbone].params(config)


def schemes_table(config: ModelConfig | None = None) -> str:
    """Markdown table of every registered residual scheme for ``config`` (default: the demo model)."""
    if config is None:
        config = ModelConfig(**DEMO_MODEL)
    base = base_params(config)
    L = config.n_sublayers
    lines = [
        f"Residual schemes for the {config.backbone} backbone, d_model={config.d_model}, {config.n_layers} "
        "Transformer blocks "
        f"(L={L} sublayers), vocabulary {config.vocab_size}: PreNorm model {base:,} parameters.",
        "",
        "| scheme | weight type | source | params added | % of model | depth state (d floats/token) | description |",
        "|---|---|---|---:|---:|---:|---|",
    ]
    for name, info in RESIDUALS.items():
        cfg = scheme_config(config, name)
        extra = info.extra_params(cfg)
        lines.append(
            f"| {name} | {info.weight_type_of(cfg)} | {info.source} | {extra:,} | {100 * extra / base:.2f}% "
            f"| {info.depth_state(cfg)} | {info.description} |"
        )
    full_additive = dataclasses.replace(scheme_config(config, "full"), attnres_routing="additive")
    additive = RESIDUALS["full"].extra_params(full_additive)
    lines += [
        "",
        f"Full and Block AttnRes with additive routing (attnres_routing=additive: the PreNorm stream plus "
        f"a zero-initialised per-channel gain times the depth mixture) add d parameters per read, the gain: "
        f"full then adds {additive:,}.",
        "",
        "Depth state: d-vectors per token the residual keeps alive between sublayers, beyond the "
        "single running hidden state every scheme has (counted 0); multi-stream schemes count "
        "their n streams, cross-layer schemes every stored source or block output.",
    ]
    return "\n".join(lines)
