"""attnres' torchtitan model spec on one CPU process: the --module/--config loading and validation
torchtitan runs, the model through torchtitan's interface (meta build, to_empty, init_weights,
forward, torchtitan's loss, backward) against a plain AttnResLM, and the optimizer's groups."""

import dataclasses
import importlib.util

import pytest
import torch

pytest.importorskip("torchtitan")

from reference import randomize

from attnres.model import AttnResLM, ModelConfig
from attnres.model.llama import lm_loss
from attnres.residual import RESIDUALS, build_residual

MODULE = "attnres.integrations.torchtitan"
# Kimi Linear's sublayers are transformers' (the hf extra)
NEEDS_TRANSFORMERS = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")


def parse(config_name: str, *args: str):
    from torchtitan.config.manager import ConfigManager

    return ConfigManager().parse_args(["--module", MODULE, "--config", config_name, *args])


def tiny(**fields) -> ModelConfig:
    return ModelConfig(
        **{
            **dict(vocab_size=64, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=16),
            **fields,
        }
    )


def built(config: ModelConfig):
    """What torchtitan's Trainer does to a model spec's model before training (less the parallelize
    function, which tests/integrations/test_titan_parallel.py runs on gloo ranks)."""
    from attnres.integrations.torchtitan import model_spec

    spec = model_spec(config)
    with torch.device("meta"):
        model = spec.model.build()
    model.verify_module_protocol()
    model.to_empty(device="cpu")
    model.init_weights(buffer_device=None)
    return model


def test_every_scheme_and_flavor_is_a_config_torchtitan_loads():
    from torchtitan.trainer import Trainer

    from attnres.integrations.torchtitan import FLAVORS, config_registry

    assert set(config_registry.CONFIGS) == {f"{s}_{f}" for s in RESIDUALS for f in FLAVORS}
    for scheme in RESIDUALS:
        config = parse(f"{scheme}_debugmodel", "--training.steps", "3", "--parallelism.tensor_parallel_degree", "2")
        assert isinstance(config, Trainer.Config)
        assert config.training.steps == 3 and config.parallelism.tensor_parallel_degree == 2
        assert config.model_spec.name == f"attnres_{scheme}" and config.model_spec.model.lm.residual == scheme
        with torch.device("meta"):
            model = config.model_spec.model.build()
        nparams, flops = config.model_spec.model.get_nparams_and_flops(model, config.training.seq_len)
        with torch.device("meta"):
            assert nparams == AttnResLM(config.model_spec.model.lm).num_params() and flops > 6 * nparams // 2


def test_update_from_config_extends_the_rotary_tables_and_refuses_what_it_cannot_run():
    config = parse("block_debugmodel", "--training.seq_len", "4096")
    config.model_spec.model.update_from_config(config=config)
    assert config.model_spec.model.lm.max_seq_len == 4096
    # tensor parallelism (the configs leave sequence parallelism off) is taken: test_titan_trainer.py trains it
    config = parse("block_debugmodel", "--parallelism.tensor_parallel_degree", "2")
    config.model_spec.model.update_from_config(config=config)
    refusals = [
        (
            ("--parallelism.tensor_parallel_degree", "2", "--parallelism.enable-sequence-parallel"),
            "enable_sequence_parallel=True is not supported",
        ),
        (("--parallelism.tensor_parallel_degree", "3"), "n_heads=16 is not divisible by"),
        (("--parallelism.context_parallel_degree", "2"), "context_parallel_degree=2"),
    ]
    for args, message in refusals:
        config = parse("block_debugmodel", *args)
        with pytest.raises(ValueError, match=message):
            config.model_spec.model.update_from_config(config=config)


def test_the_tensor_parallel_plan_refuses_what_it_cannot_shard():
    from attnres.integrations.torchtitan.parallelize import check_tensor_parallel

    refusals = [
        ("block_debugmodel", ("--parallelism.tensor_parallel_degree", "3"), "n_heads=16 is not divisible by"),
        ("block_debugmodel", ("--parallelism.enable-sequence-parallel",), "sequence_parallel"),
        ("block_debugmodel", ("--parallelism.spmd_backend", "spmd_types"), "spmd_backend"),
        ("block_kimi_debugmodel", (), "backbone='kimi_linear'"),
    ]
    for name, args, message in refusals:
        config = parse(name, "--parallelism.tensor_parallel_degree", "2", *args)
        with pytest.raises(ValueError, match=message):
            check_tensor_parallel(config.model_spec.model.lm, config.parallelism)


@pytest.mark.parametrize("residual", ["block", "full", "prenorm", "mhc"])
def test_init_weights_gives_the_schemes_own_initialisation(residual):
    model = built(tiny(residual=residual))
    fresh = build_residual(model.config)
    for name, p in fresh.state_dict().items():
        torch.testing.assert_close(model.residual.state_dict()[name], p, rtol=0, atol=0, msg=name)
    plain = AttnResLM(model.config)
    torch.testing.assert_close(model.rope_cos, plain.rope_cos, rtol=0, atol=0)
    torch.testing.assert_close(model.rope_sin, plain.rope_sin, rtol=0, atol=0)
    for name, p in model.named_parameters():  # the LM's rule: N(0, init_std) matrices, unit norms
        assert torch.isfinite(p).all(), name
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
        elif name.endswith("q_proj.weight"):
            assert 0.5 * model.config.init_std < p.std() < 1.5 * model.config.init_std, name


@pytest.mark.parametrize(
    "config",
    [
        tiny(residual="block", attnres_block_size=4),
        tiny(residual="hyper"),
        pytest.param(tiny(backbone="kimi_linear", n_heads=2), marks=NEEDS_TRANSFORMERS),
    ],
    ids=["llama-block", "llama-hyper", "kimi_linear-block"],
)
def test_forward_backward_through_torchtitans_interface_equals_attnres(config):
    from torchtitan.components.loss import CrossEntropyLoss

    config = dataclasses.replace(config, vocab_size=64)
    model = built(config).double()
    torch.manual_seed(0)
    plain = randomize(AttnResLM(model.config).double(), seed=3)
    model.load_state_dict(plain.state_dict())
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 64, (2, 12), generator=g), torch.randint(0, 64, (2, 12), generator=g)
    loss_fn = CrossEntropyLoss(CrossEntropyLoss.Config())
    loss, _ = loss_fn(model(x), y, torch.tensor(y.numel()))  # torchtitan's: token sum / global tokens
    loss.backward()
    # torchtitan's loss casts the logits to float32: so does the reference
    want = lm_loss(plain(x).float(), y)
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-6)
    grads = dict(plain.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-5, atol=1e-6, msg=name)
    # torchtitan's text loaders' per-document positions are accepted and change nothing (the window
    # is one sequence to attnres); document masks are refused
    with torch.no_grad():
        torch.testing.assert_close(model(x, positions=torch.arange(12).remainder(5)), plain(x), rtol=0, atol=0)
    with pytest.raises(ValueError, match="attention_masks"):
        model(x, attention_masks=torch.ones(12, 12))


def test_optimizer_keeps_attnres_parameters_out_of_weight_decay():
    config = parse("block_debugmodel", "--optimizer.implementation", "for-loop")
    model = built(config.model_spec.model.lm)
    optimizers = config.optimizer.build(model_parts=[model])
    decay = {}
    names = {id(p): n for n, p in model.named_parameters()}
    for optimizer in optimizers:
        assert isinstance(optimizer, torch.optim.AdamW)
        for group in optimizer.param_groups:
            for p in group["params"]:
                assert names[id(p)] not in decay  # every parameter in one group
                decay[names[id(p)]] = group["weight_decay"]
    kinds = model.param_kinds()
    assert decay.keys() == kinds.keys()
    assert any(n.startswith("residual.") for n in decay)
    for name, kind in kinds.items():
        assert decay[name] == (0.0 if kind == "no_decay" else 0.1), name
        if name.startswith("residual."):
            assert decay[name] == 0.0, name


@NEEDS_TRANSFORMERS
def test_kimi_linears_router_bias_balances_after_each_optimizer_step():
    from torchtitan.components.optimizer import OptimizersContainer
    from torchtitan.distributed import ParallelDims

    from attnres.integrations.torchtitan import adamw_param_groups, model_spec

    config = tiny(backbone="kimi_linear", n_heads=2, moe_experts=4, moe_top_k=2, moe_dense_layers=1)
    spec = model_spec(config)
    model = built(config)
    groups = adamw_param_groups(model.config, lr=1e-3, weight_decay=0.1)
    optimizers = OptimizersContainer.Config(param_groups=groups, implementation="for-loop").build(model_parts=[model])
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=1)
    spec.post_optimizer_build_fn(optimizers, [model], dims)
    biases = {n: b.clone() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")}
    assert biases  # MoE layers after the dense one
    x = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    lm_loss(model(x), x).backward()
    loads = [c.clone() for c in model.step_counters()]
    assert all(load.sum() > 0 for load in loads)
    optimizers.step()
    rate = config.moe_bias_update_rate
    for (name, before), load in zip(biases.items(), loads, strict=True):
        moved = dict(model.named_buffers())[name] - before
        torch.testing.assert_close(moved, rate * torch.sign(load.mean() - load), msg=name)
    assert all(c.sum() == 0 for c in model.step_counters())  # the counts start again
