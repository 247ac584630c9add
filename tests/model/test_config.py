"""ModelConfig validation: every bad field is a ValueError naming the field, the value and the fix."""

import pytest

from attnres import AttnResLM, ModelConfig

BAD = [
    ({"d_model": 30, "n_heads": 4}, "n_heads", "divide d_model"),
    ({"n_heads": 4, "n_kv_heads": 3}, "n_kv_heads", "divide n_heads"),
    ({"d_model": 24, "n_heads": 8}, "n_heads", "even head dimension"),
    ({"residual": "resnet"}, "residual", "choose one of"),
    ({"attnres_weights": "learned"}, "attnres_weights", "choose one of"),
    ({"attnres_kernel": "relu"}, "attnres_kernel", "choose one of"),
    ({"attnres_impl": "cuda"}, "attnres_impl", "choose one of"),
    ({"attnres_blocks": 17}, "attnres_blocks", "exceeds the number of sublayers"),
    ({"attnres_blocks": 0}, "attnres_blocks", "positive integer"),
    ({"n_layers": 5, "attnres_blocks": 6}, "attnres_blocks", "attnres_block_size instead"),
    ({"attnres_block_size": 0}, "attnres_block_size", ">= 1"),
    ({"attnres_block_size": 17}, "attnres_block_size", "exceeds"),
    ({"attnres_blocks": 4, "attnres_block_size": 4}, "attnres_blocks", "not both"),
    ({"residual": "full", "attnres_blocks": 4}, "attnres_blocks", "residual='block' only"),
    ({"attnres_window": 4}, "attnres_window", "residual='full' only"),
    ({"residual": "full", "attnres_window": 0}, "attnres_window", "positive integer"),
    ({"attnres_heads": 3}, "attnres_heads", "divide d_model"),
    ({"attnres_group_size": 2}, "attnres_group_size", "residual='full' only"),
    ({"residual": "full", "attnres_group_size": 0}, "attnres_group_size", "positive integer"),
    ({"attnres_heads": 2, "attnres_weights": "scalar"}, "attnres_heads", "scalar mixing"),
    ({"attnres_key_norm": "yes"}, "attnres_key_norm", "True or False"),
    ({"vocab_size": 0}, "vocab_size", "positive integer"),
    ({"n_layers": 2.5}, "n_layers", "positive integer"),
    ({"max_seq_len": -1}, "max_seq_len", "positive integer"),
    ({"norm_eps": 0}, "norm_eps", "positive number"),
    ({"rope_theta": -1.0}, "rope_theta", "positive number"),
    ({"d_ff": 0}, "d_ff", "positive integer"),
    ({"tie_embeddings": 1}, "tie_embeddings", "True or False"),
]


@pytest.mark.parametrize("overrides,field,fix", BAD, ids=[b[1] + "-" + str(i) for i, b in enumerate(BAD)])
def test_invalid_field_raises_naming_field_value_and_fix(overrides, field, fix):
    base = {"d_model": 32, "n_layers": 8, "n_heads": 4}
    with pytest.raises(ValueError) as err:
        ModelConfig(**{**base, **overrides})
    msg = str(err.value)
    assert f"ModelConfig.{field}=" in msg
    assert repr(overrides.get(field, None)) in msg or field in ("n_heads", "residual")
    assert fix in msg


def test_block_size_and_count():
    assert ModelConfig(n_layers=8, residual="block").block_size == 2  # 16 sublayers -> 8 blocks
    assert ModelConfig(n_layers=12, residual="block").block_size == 4  # 24 -> 6 blocks, even S
    cfg = ModelConfig(n_layers=12, residual="block", attnres_blocks=8)
    assert (cfg.block_size, cfg.num_blocks) == (3, 8)
    cfg = ModelConfig(n_layers=5, residual="block", attnres_blocks=4)
    assert (cfg.block_size, cfg.num_blocks) == (3, 4)  # 3 + 3 + 3 + 1
    assert ModelConfig(residual="full").num_blocks == 16


def test_round_trip_and_unknown_fields():
    cfg = ModelConfig(residual="full", attnres_weights="input_query")
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown ModelConfig fields \\['depth'\\]"):
        ModelConfig.from_dict({**cfg.to_dict(), "depth": 3})


def test_model_validates_a_mutated_config():
    cfg = ModelConfig()
    cfg.residual = "nope"
    with pytest.raises(ValueError, match="ModelConfig.residual='nope'"):
        AttnResLM(cfg)


def test_scheme_options_are_config_fields_and_the_config_names_no_scheme():
    """The registry defines a scheme's options; ModelConfig only asks it (no scheme names in config.py)."""
    import ast
    import dataclasses
    import inspect

    import attnres.model.config as config_module
    from attnres.residual import RESIDUALS, scheme_options

    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    assert set(scheme_options()) <= fields
    functions = [
        node for node in ast.walk(ast.parse(inspect.getsource(config_module))) if isinstance(node, ast.FunctionDef)
    ]
    literals = {
        node.value
        for f in functions
        for node in ast.walk(f)
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    }
    assert not literals & set(RESIDUALS), "ModelConfig's code names a scheme: ask the registry instead"


def test_an_option_shared_by_two_schemes_names_both():
    with pytest.raises(ValueError, match="applies to residual='full' or 'block' only"):
        ModelConfig(residual="prenorm", attnres_scale_norm_eps=True)
    # the shared behaviour options are ignored (not rejected) by other schemes, but still checked
    assert ModelConfig(residual="prenorm", attnres_kernel="sigmoid").attnres_kernel == "sigmoid"
    with pytest.raises(ValueError, match="ModelConfig.attnres_kernel='relu'"):
        ModelConfig(residual="prenorm", attnres_kernel="relu")
