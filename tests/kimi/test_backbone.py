"""The kimi_linear backbone: every residual scheme runs on it, presets, parameter counts, config errors,
and Muon on stacked expert matrices."""

import pytest
import torch

from attnres.model import AttnResLM, ModelConfig
from attnres.model.schemes_table import base_params, scheme_config
from attnres.residual import RESIDUALS
from attnres.train.config import build_configs, preset_model
from attnres.train.optim import StackedMuon

TINY = dict(backbone="kimi_linear", vocab_size=40, d_model=16, n_layers=4, n_heads=2, max_seq_len=16, moe_experts=4)
# the Table-4 variants of AttnRes (docs/method.md §5) beside every registered scheme
VARIANTS = [dict(residual=name) for name in RESIDUALS] + [
    dict(residual="full", attnres_weights="input_query"),
    dict(residual="full", attnres_weights="scalar"),
    dict(residual="full", attnres_kernel="sigmoid"),
    dict(residual="full", attnres_key_norm=False),
    dict(residual="full", attnres_heads=2),
    dict(residual="full", attnres_window=2),
    dict(residual="block", attnres_block_size=3),
]


@pytest.mark.parametrize("options", VARIANTS, ids=lambda o: ",".join(f"{v}" for v in o.values()))
def test_every_scheme_trains_on_kimi_linear(options):
    """One KDA and one MLA layer (a dense MLP, then the experts): every part of the backbone behind
    every scheme, at the cost of two layers (transformers' reference KDA pads to 64 positions)."""
    torch.manual_seed(0)
    model = AttnResLM(ModelConfig(**{**TINY, "n_layers": 2, "kimi_layer_pattern": "KM", **options}))
    ids = torch.randint(0, 40, (2, 8))
    logits = model(ids)
    assert logits.shape == (2, 8, 40) and torch.isfinite(logits).all()
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    if options["residual"] == "rezero":
        return  # zero gates at init: the sublayers do not reach the loss yet
    # the KDA, MLA and expert weights all learn (an expert may get no token in 16: take the stack)
    for part in (
        "blocks.0.attn.q_proj",
        "blocks.1.attn.kv_b_proj",
        "blocks.1.mlp.experts.gate_up_proj",
        "blocks.1.mlp.shared_experts.down_proj",
        "blocks.0.mlp.down_proj",
    ):
        assert any(n.startswith(part) and g.abs().sum() > 0 for n, g in grads.items()), part


def test_kimi_parameter_count_matches_the_modules():
    for options in (
        dict(),
        dict(moe_experts=0),
        dict(kimi_layer_pattern="KM", mla_q_rank=8, moe_shared_experts=2),
        dict(tie_embeddings=True, moe_dense_layers=0),
    ):
        config = ModelConfig(**{**TINY, **options})
        model = AttnResLM(scheme_config(config, "prenorm"))
        assert base_params(config) == sum(p.numel() for p in model.parameters()), options


@pytest.mark.parametrize("preset", ["kimi-tiny", "kimi-demo"])
def test_kimi_presets(preset):
    model_config, train_config = build_configs(preset, {"residual": "block"})
    assert model_config.backbone == "kimi_linear" and model_config.moe_experts > 0
    assert model_config.max_seq_len >= train_config.seq_len
    assert preset_model(preset).kimi_layer_pattern == "KKKM"
    if preset == "kimi-tiny":
        model = AttnResLM(model_config)
        kinds = [b.kind for b in model.blocks]
        assert kinds == ["K", "K", "K", "M"] and [b.is_moe for b in model.blocks] == [False, True, True, True]


@pytest.mark.parametrize(
    "options, match",
    [
        (dict(backbone="llama", kda_heads=2), r"kda_heads=2 .*backbone='kimi_linear' only"),
        (dict(kimi_layer_pattern="KXM"), r"kimi_layer_pattern='KXM'.*'K' \(KDA\) and 'M' \(MLA\)"),
        (dict(n_kv_heads=1), r"n_kv_heads=1.*must equal n_heads=2"),
        (dict(rope_theta=5e5), r"rope_theta=500000.0.*backbone='llama' only"),
        (dict(moe_experts=0, moe_top_k=3), r"moe_top_k=3.*mixture of experts only"),
        (dict(moe_experts=1), r"moe_experts=1.*at least 2"),
        (dict(moe_top_k=5), r"moe_top_k=5.*at most moe_experts=4"),
        (dict(backbone="mamba"), r"backbone='mamba'.*choose one of \['kimi_linear', 'llama'\]"),
    ],
)
def test_bad_kimi_options_are_one_line_errors(options, match):
    with pytest.raises(ValueError, match=match) as e:
        ModelConfig(**{**TINY, **options})
    assert "\n" not in str(e.value)


def test_stacked_muon_equals_torch_muon_on_each_matrix():
    """The fast path (one 3-D stack) against the plain one (torch's Muon on separate 2-D tensors)."""
    g = torch.Generator().manual_seed(0)
    stack = torch.nn.Parameter(torch.randn(3, 6, 4, generator=g, dtype=torch.float64))
    matrix = torch.nn.Parameter(torch.randn(5, 4, generator=g, dtype=torch.float64))
    separate = [torch.nn.Parameter(m.detach().clone()) for m in stack] + [torch.nn.Parameter(matrix.detach().clone())]
    kw = dict(lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    ours, theirs = StackedMuon([stack, matrix], **kw), torch.optim.Muon(separate, **kw)
    for _ in range(3):
        grads = [
            torch.randn(stack.shape, generator=g, dtype=torch.float64),
            torch.randn(matrix.shape, generator=g, dtype=torch.float64),
        ]
        stack.grad, matrix.grad = grads
        for p, grad in zip(separate, [*grads[0], grads[1]], strict=True):
            p.grad = grad.clone()
        ours.step()
        theirs.step()
    torch.testing.assert_close(stack.detach(), torch.stack([p.detach() for p in separate[:3]]), rtol=0, atol=0)
    torch.testing.assert_close(matrix.detach(), separate[3].detach(), rtol=0, atol=0)
    with pytest.raises(ValueError, match="matrices or stacks"):
        StackedMuon([torch.nn.Parameter(torch.zeros(2, 2, 2, 2))], lr=0.1)


def test_experts_are_muon_matrices_and_the_rest_is_sorted():
    model = AttnResLM(ModelConfig(**TINY, residual="block"))
    kinds = model.param_kinds()
    assert kinds["blocks.1.mlp.experts.gate_up_proj"] == "matrix"
    assert kinds["blocks.0.attn.forget_gate.A_log"] == "no_decay"
    assert kinds["blocks.0.attn.conv1d.weight"] == "no_decay"
    assert kinds["blocks.0.attn.q_proj.weight"] == "matrix"


def test_padded_batches_are_refused_by_name_and_full_masks_run():
    model = AttnResLM(ModelConfig(**{**TINY, "n_layers": 2, "kimi_layer_pattern": "KM"})).eval()
    ids = torch.randint(0, 40, (2, 6))
    with torch.no_grad():
        torch.testing.assert_close(model(ids, attention_mask=torch.ones(2, 6)), model(ids), rtol=0, atol=0)
        with pytest.raises(ValueError, match=r"backbone='kimi_linear' does not run padded batches") as e:
            model(ids, attention_mask=torch.tensor([[0, 1, 1, 1, 1, 1], [1] * 6]))
    assert "\n" not in str(e.value)
