"""Every residual-scheme option has one name, declared once, and every interface spells it that way:
ModelConfig and ResidualConfig fields, the registry's checks, FullAttnRes / BlockAttnRes /
residual_scheme keywords, ``--set NAME=VALUE`` and docs/options.md."""

from __future__ import annotations

import ast
import dataclasses
import functools
import typing
import warnings
from pathlib import Path

import pytest

import attnres.residual.modules as modules
from attnres.cli.options import parse_set
from attnres.model.backbone_args import BACKBONE_RULES, KimiLinearArgs
from attnres.model.backbones import BACKBONES
from attnres.model.config import ModelConfig
from attnres.residual import (
    RESIDUALS,
    BlockAttnRes,
    FullAttnRes,
    ResidualConfig,
    residual_scheme,
)
from attnres.residual.args import FAMILIES, SCHEME_RULES, AttnResArgs
from attnres.train.config import build_configs

ROOT = Path(__file__).resolve().parents[1]
D, N_LAYERS = 32, 2  # L = 4 sublayers
L = 2 * N_LAYERS

# a valid value other than the default for every scheme option, with what it needs beside it
SAMPLES: dict[str, tuple[object, dict]] = {
    "attnres_blocks": (2, {}),
    "attnres_block_size": (2, {}),
    "attnres_block_sizes": ([1, 3], {}),
    "attnres_weights": ("input_query", {}),
    "attnres_kernel": ("sigmoid", {}),
    "attnres_key_norm": (False, {}),
    "attnres_heads": (2, {}),
    "attnres_window": (2, {}),
    "attnres_group_size": (2, {}),
    "attnres_scale_norm_eps": (True, {}),
    "attnres_impl": ("reference", {}),
    "attnres_sources": ("states", {}),
    "attnres_query_rank": (2, {"attnres_weights": "low_rank_query"}),
    "attnres_values": ("normalized", {}),
    "attnres_score_scale": (0.5, {}),
    "attnres_read_queries": ([1, 1, 1, 1, 2], {}),
    "attnres_routing": ("additive", {}),
    "attnres_gain": ("scalar", {"attnres_routing": "additive"}),
    "attnres_gain_init": (0.5, {"attnres_routing": "additive"}),
    "attnres_gain_lr": (2.0, {"attnres_routing": "additive"}),
    "layerscale_init": (0.1, {}),
    "highway_rank": (4, {}),
    "denseformer_dilation": (2, {}),
    "denseformer_period": (2, {}),
    "hyper_streams": (2, {}),
    "hyper_dynamic": (False, {}),
    "mhc_streams": (2, {}),
    "mhc_sinkhorn_iters": (5, {}),
    "gated_heads": (2, {}),
}
SCHEME_OPTIONS = [f.name for family in FAMILIES for f in dataclasses.fields(family)]
KIMI_OPTIONS = [f.name for f in dataclasses.fields(KimiLinearArgs)]


def reader(name: str) -> str:
    """A scheme that reads option ``name`` (Block AttnRes where both AttnRes schemes do)."""
    schemes = [scheme for scheme, rules in SCHEME_RULES.items() if name in rules.options]
    return "block" if "block" in schemes else schemes[0]


@functools.cache
def _field_declarations() -> dict[str, list[str]]:
    """Every field a class in the package declares (``name: type`` in a class body): name -> where. The
    package is parsed once, not once per option (that cost 38 s of the suite)."""
    found: dict[str, list[str]] = {}
    for path in sorted((ROOT / "attnres").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        found.setdefault(item.target.id, []).append(f"{path.relative_to(ROOT)}:{node.name}")
    return found


def field_declarations(name: str) -> list[str]:
    """Where in the package a class declares a field ``name``."""
    return _field_declarations().get(name, [])


def test_every_option_is_declared_once_and_has_a_sample():
    assert set(SAMPLES) == set(SCHEME_OPTIONS), "give each scheme option a sample value here"
    assert len(SCHEME_OPTIONS) == len(set(SCHEME_OPTIONS)), "two families declare one option"
    for name in SCHEME_OPTIONS + KIMI_OPTIONS:
        assert len(field_declarations(name)) == 1, (name, field_declarations(name))


def test_the_configs_inherit_the_options_with_one_type_and_default():
    model = {f.name: f for f in dataclasses.fields(ModelConfig)}
    own = {f.name: f for f in dataclasses.fields(ResidualConfig)}
    model_types, own_types = typing.get_type_hints(ModelConfig), typing.get_type_hints(ResidualConfig)
    for name in SCHEME_OPTIONS:
        assert model[name].default == own[name].default and model_types[name] == own_types[name], name
    assert set(KIMI_OPTIONS) <= set(model) and not set(KIMI_OPTIONS) & set(own)


def test_the_registries_check_options_by_their_declared_names():
    assert set(SCHEME_RULES) == set(RESIDUALS) and set(BACKBONE_RULES) == set(BACKBONES)
    read_by_schemes = {name for rules in SCHEME_RULES.values() for name in rules.options}
    assert read_by_schemes == set(SCHEME_OPTIONS), "an option no scheme reads, or a check for an undeclared one"
    assert {name for rules in BACKBONE_RULES.values() for name in rules.options} == set(KIMI_OPTIONS)


@pytest.mark.parametrize("name", SCHEME_OPTIONS)
def test_the_schemes_take_each_option_by_its_name(name, monkeypatch):
    value, needs = SAMPLES[name]
    built: list[ResidualConfig] = []
    make_config = modules.residual_config
    monkeypatch.setattr(modules, "residual_config", lambda *a, **k: built.append(make_config(*a, **k)) or built[-1])
    scheme = reader(name)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        residual_scheme(scheme, D, L, **needs, **{name: value})
        for cls, kind in ((FullAttnRes, "full"), (BlockAttnRes, "block")):
            if name in SCHEME_RULES[kind].options:
                cls(d_model=D, n_sublayers=L, **needs, **{name: value})
    assert built and all(getattr(config, name) == value for config in built)


def test_the_module_classes_take_exactly_the_attnres_options():
    names = {f.name for f in dataclasses.fields(AttnResArgs)}
    assert set(modules.FULL_ARGS) == set(SCHEME_RULES["full"].options)
    assert set(modules.BLOCK_ARGS) == set(SCHEME_RULES["block"].options)
    assert set(modules.FULL_ARGS) | set(modules.BLOCK_ARGS) == names
    with pytest.raises(TypeError, match=r"unknown option 'blocks'; its options are \['attnres_block_size'"):
        BlockAttnRes(D, L, blocks=2)
    with pytest.raises(TypeError, match="unknown option 'attnres_blocks'"):
        FullAttnRes(D, L, attnres_blocks=2)


@pytest.mark.parametrize(
    ("cls", "old", "new", "value"),
    [
        (BlockAttnRes, "num_blocks", "attnres_blocks", 2),
        (BlockAttnRes, "block_size", "attnres_block_size", 2),
        (BlockAttnRes, "block_sizes", "attnres_block_sizes", (1, 3)),
        (BlockAttnRes, "kernel", "attnres_kernel", "sigmoid"),
        (FullAttnRes, "window", "attnres_window", 2),
        (FullAttnRes, "heads", "attnres_heads", 2),
    ],
)
def test_the_old_short_names_still_work_with_a_deprecation_warning(cls, old, new, value):
    with pytest.warns(DeprecationWarning, match=rf"{cls.__name__}\({old}=.*\) is deprecated: write {new}="):
        got = cls(D, L, **{old: value})
    want = cls(D, L, **{new: value})
    assert got.settings() == want.settings()
    with pytest.raises(TypeError, match="twice"), pytest.warns(DeprecationWarning):
        cls(D, L, **{old: value, new: value})


def test_every_old_short_name_maps_to_an_option():
    for cls, allowed in ((FullAttnRes, modules.FULL_ARGS), (BlockAttnRes, modules.BLOCK_ARGS)):
        for name in allowed:
            old = modules._old_name(name)
            assert old != name and not old.startswith("attnres_")
            value, needs = SAMPLES[name]
            with pytest.warns(DeprecationWarning, match=f"write {name}="):
                cls(D, L, **needs, **{old: value})


@pytest.mark.parametrize("name", SCHEME_OPTIONS)
def test_set_on_the_command_line_reaches_the_model_config(name):
    value, needs = SAMPLES[name]
    items = [f"residual={reader(name)}", f"d_model={D}", f"n_layers={N_LAYERS}", "n_heads=2"]
    items += [f"{k}={v}" for k, v in needs.items()] + [f"{name.replace('_', '-')}={value}"]
    model, _ = build_configs(None, parse_set(items))
    assert getattr(model, name) == value


def test_docs_options_md_lists_every_option_under_its_name():
    doc = (ROOT / "docs" / "options.md").read_text()
    for name in SCHEME_OPTIONS + KIMI_OPTIONS:
        assert doc.count(f"| `{name}` |") == 1, name
