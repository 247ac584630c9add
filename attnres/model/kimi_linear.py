"""Kimi Linear blocks: transformers' KDA, MLA, MoE and MLP sublayers, driven by our residual stream.

Kimi Linear, the backbone of the paper's models and of Kimi K3, interleaves Kimi Delta Attention
(KDA: gated delta-rule linear attention with a short causal convolution and a recurrent state) with
multi-head latent attention (MLA: keys and values expanded from a low-rank latent, no positional
encoding), 3 KDA : 1 MLA by default, and replaces the MLP of all but the first layers with a mixture
of experts (sigmoid top-k router with a balancing bias, plus shared experts).

The sublayers and their RMSNorms are transformers' own modules (``transformers.models.kimi_linear``),
used unchanged unless one of Kimi K3's options is set (``attnres.model.k3_blocks`` switches those in);
this file builds them from a ``ModelConfig``, reads and writes the residual stream
around them exactly like ``attnres.model.llama.TransformerBlock`` (so every residual scheme runs on
them), and adds what training with them needs: their initialisation, and the aux-loss-free
balancing of the routers (the per-expert routing bias that transformers' router reads, updated after
each step from the expert loads). Read top to bottom: the transformers config, the block, the
initialisation, the MoE step.

Module names follow transformers' decoder layer (``attn`` = ``self_attn``, ``mlp`` = ``mlp``,
``attn_norm`` = ``input_layernorm``, ``mlp_norm`` = ``post_attention_layernorm``), so weights map
one to one (``attnres.hf.kimi``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

try:
    from transformers import KimiLinearConfig
    from transformers.models.kimi_linear import modeling_kimi_linear as kimi
except ImportError as e:  # the optional extra is missing

    class MissingExtra(ImportError, ValueError):
        """Still an ImportError, and a ValueError so that the CLI prints it as one line."""

    raise MissingExtra(
        "backbone='kimi_linear' uses transformers' Kimi Linear modules (the hf extra, transformers>=5): "
        f"pip install -e '.[hf]' in a clone of attnres, pip install 'attnres[hf]' from PyPI ({e})"
    ) from e

from attnres.model import k3_blocks as k3
from attnres.model.kimi_layout import KDA, kimi_sizes, layer_kinds, moe_layers

# ----------------------------------------------------------------------------- transformers' config


def kimi_linear_config(config, **extra) -> KimiLinearConfig:
    """The ``KimiLinearConfig`` describing the same sublayers as ``config`` (a ModelConfig with
    backbone="kimi_linear"). Attention runs through PyTorch's SDPA and the experts through
    transformers' reference loop ("eager"): both run in any dtype, float64 included."""
    s = kimi_sizes(config)
    kinds, sparse = layer_kinds(config), moe_layers(config)
    extra = {"tie_word_embeddings": config.tie_embeddings, **extra}
    hf = KimiLinearConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.d_model,
        intermediate_size=config.d_ff,
        num_hidden_layers=config.n_layers,
        num_attention_heads=config.n_heads,
        num_key_value_heads=config.n_heads,
        rms_norm_eps=config.norm_eps,
        hidden_act="silu",
        max_position_embeddings=config.max_seq_len,
        initializer_range=config.init_std,
        layer_types=["linear_attention" if k == KDA else "full_attention" for k in kinds],
        mlp_layer_types=["sparse" if m else "dense" for m in sparse],
        linear_num_heads=s["kda_heads"],
        linear_head_dim=s["kda_head_dim"],
        linear_conv_kernel_dim=config.kda_conv_kernel,
        kv_lora_rank=s["mla_kv_rank"],
        q_lora_rank=config.mla_q_rank,
        qk_nope_head_dim=s["mla_qk_nope_dim"],
        qk_rope_head_dim=s["mla_qk_rope_dim"],
        v_head_dim=s["mla_v_dim"],
        num_local_experts=max(config.moe_experts, 2),
        num_experts_per_tok=config.moe_top_k,
        n_shared_experts=config.moe_shared_experts,
        moe_intermediate_size=s["moe_d_ff"],
        routed_scaling_factor=float(config.moe_routed_scale),
        norm_topk_prob=config.moe_renormalize,
        n_group=config.moe_groups,
        topk_group=config.moe_topk_groups,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
        **extra,
    )
    hf._attn_implementation = "sdpa"
    hf._experts_implementation = "eager"
    return hf


def final_norm(config) -> nn.Module:
    return kimi.KimiLinearRMSNorm(config.d_model, eps=config.norm_eps)


# ----------------------------------------------------------------------------- the block


class KimiLinearBlock(nn.Module):
    """One Kimi Linear decoder layer: KDA or MLA, then a dense or MoE MLP, each behind its pre-norm.
    The residual arithmetic lives in the stream (``TransformerBlock`` in ``attnres.model.llama``).

    ``expert_load``: in an MoE layer, how many tokens the router sent to each expert during the
    current training step (counted in training forwards with gradients on; ``end_step`` consumes it).
    """

    def __init__(self, config, index: int):
        super().__init__()
        hf = kimi_linear_config(config)
        self.kind = layer_kinds(config)[index]
        self.attn_norm = kimi.KimiLinearRMSNorm(config.d_model, eps=config.norm_eps)
        self.attn = (
            k3.delta_attention(hf, index, config) if self.kind == KDA else k3.latent_attention(hf, index, config)
        )
        self.mlp_norm = kimi.KimiLinearRMSNorm(config.d_model, eps=config.norm_eps)
        self.is_moe = moe_layers(config)[index]
        self.mlp = k3.mixture_of_experts(hf, config) if self.is_moe else k3.dense_mlp(hf, config)
        self.expert_load: Tensor | None = None
        if isinstance(self.mlp, kimi.KimiLinearMoE):
            self.mlp.gate.register_forward_hook(self._count_routed_tokens)

    def forward(self, depth, residual, index: int, cos: Tensor, sin: Tensor, cache=None):
        """Block ``index`` runs its two sublayers on the depth state (``attnres.residual.DepthState``)
        and returns the new one; ``cos``/``sin`` are empty (no rotary positions in Kimi Linear).
        ``cache``: a ``HybridCache``."""
        stream = residual.stream(depth)
        stream.apply(lambda h: self._attention(self.attn_norm(h), cache))
        stream.apply(lambda h: self.mlp(self.mlp_norm(h)))
        return stream.depth()

    def _attention(self, x: Tensor, cache) -> Tensor:
        layers = cache.layer_cache(x.shape[1]) if cache is not None else None
        if self.kind == KDA:
            return self.attn(x, cache=layers)
        mask = cache.attention_mask(x.shape[1], x.device) if cache is not None else None
        return self.attn(x, attention_mask=mask, cache=layers)[0]

    def _count_routed_tokens(self, router: kimi.KimiLinearTopkRouter, inputs, outputs) -> None:
        if not (self.training and torch.is_grad_enabled()):
            return  # evaluation and shape probes leave the balancing alone
        with torch.no_grad():
            counts = torch.bincount(outputs[2].flatten(), minlength=router.num_experts).float()
            self.expert_load = counts if self.expert_load is None else self.expert_load + counts


# ----------------------------------------------------------------------------- initialisation


@torch.no_grad()
def init_kimi_weights(model) -> None:
    """What ``AttnResLM.reset_parameters`` leaves to the backbone (it has drawn every Linear and the
    embedding from N(0, init_std), output projections scaled by 1/sqrt(2 n_layers)): norm weights
    one; expert weights like the Linears they stack (down projections scaled); router N(0, init_std)
    with a zero balancing bias; the short convolutions PyTorch's default; the KDA decay as in Mamba:
    A uniform in [1, 16] (stored as log A), and dt = softplus(dt_bias) log-uniform in [1e-3, 1e-1]."""
    std = model.config.init_std
    out_scale = 1.0 / math.sqrt(2 * model.config.n_layers)
    for module in model.modules():
        if isinstance(module, (kimi.KimiLinearRMSNorm, kimi.KimiLinearRMSNormGated)):
            nn.init.ones_(module.weight)
        elif isinstance(module, kimi.KimiLinearExperts):
            nn.init.normal_(module.gate_up_proj, mean=0.0, std=std)
            nn.init.normal_(module.down_proj, mean=0.0, std=std * out_scale)
        elif isinstance(module, kimi.KimiLinearTopkRouter):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            module.e_score_correction_bias.zero_()
        elif isinstance(module, nn.Conv1d):
            module.reset_parameters()
        elif isinstance(module, kimi.KimiLinearForgetGate):
            module.A_log.copy_(torch.empty_like(module.A_log).uniform_(1.0, 16.0).log())
            dt = torch.empty_like(module.dt_bias).uniform_(math.log(1e-3), math.log(1e-1)).exp().clamp_min(1e-4)
            module.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus(dt_bias) = dt
    k3.init_k3_weights(model)


def matrix_stacks(model) -> list[str]:
    """Expert weights [experts, rows, cols]: one matrix per expert (Muon orthogonalises each)."""
    return [
        f"{name}.{p}"
        for name, module in model.named_modules()
        if isinstance(module, kimi.KimiLinearExperts)
        for p, _ in module.named_parameters(recurse=False)
    ]


# ----------------------------------------------------------------------------- the MoE step


def _moe_blocks(model):
    return [(i, block) for i, block in enumerate(model.blocks) if block is not None and block.is_moe]


def expert_load_counters(model) -> list[Tensor]:
    """Each MoE layer's per-expert token counts of the current step (zeros where none were routed)."""
    counters = []
    for _, block in _moe_blocks(model):
        if block.expert_load is None:
            weight = block.mlp.gate.weight
            block.expert_load = torch.zeros(block.mlp.gate.num_experts, device=weight.device)
        counters.append(block.expert_load)
    return counters


@torch.no_grad()
def end_step(model) -> dict[str, object]:
    """Aux-loss-free balancing (DeepSeek-V3, as Kimi Linear's router bias is meant to be trained):
    after each step, every expert's routing bias moves by ``moe_bias_update_rate`` up if the expert
    received fewer tokens than the mean, down if more; the bias only steers the top-k choice, never
    the mixing weights. Reports per MoE layer i (of the layers this process holds) ``moe_load.i``
    (each expert's share of the routed tokens) and ``moe_maxvio.i`` (max load / mean load - 1, 0 when
    balanced); then resets the counts."""
    rate = model.config.moe_bias_update_rate
    report: dict[str, object] = {}
    for i, block in _moe_blocks(model):
        load, block.expert_load = block.expert_load, None
        if load is None or not load.sum() > 0:
            continue
        mean = load.mean()
        if rate > 0:
            bias = block.mlp.gate.e_score_correction_bias
            bias += (rate * torch.sign(mean - load)).to(bias)
        report[f"moe_load.{i}"] = [round(x, 5) for x in (load / load.sum()).tolist()]
        report[f"moe_maxvio.{i}"] = float(load.max() / mean - 1)
    return report
