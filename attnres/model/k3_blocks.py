"""Kimi K3's sublayers: transformers' Kimi Linear modules with K3's additions switched in by
``ModelConfig`` options (each off by default, and then the module is transformers' own, unchanged; KDA's
forward is called past the ``kernels`` hub's routing, which dynamo cannot trace: ``DeltaAttention``).

- ``situ_beta`` / ``situ_linear_beta``: SiTU (``attnres.model.k3.situ``) instead of SwiGLU in the dense
  MLPs, the routed experts and the shared experts. The KDA short convolution keeps its SiLU (K3's too).
- ``kda_full_rank_gate``: KDA's output gate is one d_model -> heads·head_dim projection. It is held as
  ``g_b_proj`` behind an identity ``g_a_proj`` (transformers' forward computes g_b_proj(g_a_proj(x)));
  K3 checkpoints call it ``g_proj`` (``attnres.hf.kimi.k3_layout`` renames).
- ``kda_gate_lower_bound``: KDA's decay in the bounded form (``attnres.model.k3.bounded_log_decay``).
- ``mla_output_gate``: MLA's per-head output times sigmoid(``g_proj``(x)) before ``o_proj``.
- ``moe_latent_dim`` / ``moe_latent_norm``: the routed experts run at a latent width, between
  ``routed_expert_down_proj`` and ``routed_expert_up_proj`` (an RMSNorm on the weighted sum between
  them when asked); the router and the shared experts stay at d_model.
- ``moe_groups`` / ``moe_topk_groups``: grouped top-k routing, transformers' router's own (a token's
  experts come from the ``moe_topk_groups`` groups whose two best biased scores sum highest).
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn
from transformers.models.kimi_linear import modeling_kimi_linear as kimi

from attnres.model.k3 import bounded_log_decay, situ


class SiTUMLP(kimi.KimiLinearMLP):
    """A dense SiTU MLP (the same three projections as transformers' SwiGLU MLP)."""

    def __init__(self, hf, beta: float, linear_beta: float | None, intermediate_size: int | None = None):
        super().__init__(hf, intermediate_size)
        self.beta, self.linear_beta = beta, linear_beta

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(situ(self.up_proj(x), self.gate_proj(x), self.beta, self.linear_beta))


class SiTUExperts(kimi.KimiLinearExperts):
    """Routed experts with SiTU: transformers' reference loop over the experts a batch uses."""

    def __init__(self, hf, beta: float, linear_beta: float | None):
        super().__init__(hf)
        self.beta, self.linear_beta = beta, linear_beta

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        out = torch.zeros_like(hidden_states)
        for expert in top_k_index.unique().tolist():
            token, slot = torch.where(top_k_index == expert)
            gate, up = nn.functional.linear(hidden_states[token], self.gate_up_proj[expert]).chunk(2, dim=-1)
            y = nn.functional.linear(situ(up, gate, self.beta, self.linear_beta), self.down_proj[expert])
            out.index_add_(0, token, (y * top_k_weights[token, slot, None]).to(out.dtype))
        return out


def _without_hub_routing(forward):
    """``forward`` without the wrapper that the ``kernels`` package (installed with transformers) puts
    around a module that lists hub kernel functions (``use_kernelized_func``: KDA's). Per call it routes
    them through a context variable keyed by the ``id`` of each item of a closure tuple, which dynamo
    cannot resolve once it traces a second such layer (torch 2.13: "NameError: name
    '___tuple_iterator_getitem' is not defined", and ``--compile`` dies). The routing matters only for a
    module passed to ``kernels.kernelize``, which attnres never does: unkernelized, every routed call
    falls through to the plain function, which the forward it wraps calls directly."""
    code = getattr(forward, "__code__", None)
    wrapped = getattr(forward, "__wrapped__", None)
    if code is None or wrapped is None or code.co_name != "new_forward" or "kernels" not in code.co_filename:
        return forward  # no hub wrapper: transformers without the kernels package, or another version of it
    return wrapped


class DeltaAttention(kimi.KimiLinearDeltaAttention):
    """transformers' KDA, its forward called without the kernels hub's routing (see ``_without_hub_routing``)."""

    forward = _without_hub_routing(kimi.KimiLinearDeltaAttention.forward)


class BoundedForgetGate(kimi.KimiLinearForgetGate):
    """KDA's forget gate with K3's lower bound: log decay in (lower_bound, 0)."""

    def __init__(self, hf, lower_bound: float):
        super().__init__(hf)
        self.lower_bound = lower_bound

    def forward(self, hidden_states: Tensor) -> Tensor:
        f = self.f_b_proj(self.f_a_proj(hidden_states)).view(*hidden_states.shape[:2], -1, self.head_dim)
        dt_bias = self.dt_bias.view(-1, self.head_dim)
        return bounded_log_decay(f, self.A_log, dt_bias, self.lower_bound)


def delta_attention(hf, index: int, config) -> nn.Module:
    """Layer ``index``'s KDA: transformers' module, with K3's full-rank gate and bounded decay if set."""
    attn = DeltaAttention(hf, index)
    if config.kda_full_rank_gate:
        attn.g_a_proj = nn.Identity()  # type: ignore[assignment]  # the full-rank gate is g_b_proj alone
        attn.g_b_proj = nn.Linear(hf.hidden_size, attn.qkv_dim, bias=False)
    if config.kda_gate_lower_bound is not None:
        attn.forget_gate = BoundedForgetGate(hf, float(config.kda_gate_lower_bound))
    return attn


class _GatedProjection(nn.Linear):
    """MLA's ``o_proj`` with K3's output gate: multiplies its input by the gate its attention module
    computed from the layer input for this call (``GatedLatentAttention.forward`` sets and clears it)."""

    gate: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        if self.gate is None:
            raise RuntimeError("the MLA output gate is computed by GatedLatentAttention.forward; call that")
        return super().forward(x * self.gate.to(x.dtype))


class GatedLatentAttention(kimi.KimiLinearAttention):
    """MLA with K3's output gate: the heads' output times sigmoid(g_proj(x)), then ``o_proj``."""

    def __init__(self, hf, index: int):
        super().__init__(hf, index)
        width = self.num_heads * hf.v_head_dim
        self.g_proj = nn.Linear(hf.hidden_size, width, bias=False)
        self.o_proj = _GatedProjection(width, hf.hidden_size, bias=False)

    def forward(self, hidden_states: Tensor, attention_mask: Tensor | None, cache=None, **kwargs):
        assert isinstance(self.o_proj, _GatedProjection)
        self.o_proj.gate = torch.sigmoid(self.g_proj(hidden_states))
        try:
            return super().forward(hidden_states, attention_mask, cache=cache, **kwargs)
        finally:
            self.o_proj.gate = None


def latent_attention(hf, index: int, config) -> nn.Module:
    """Layer ``index``'s MLA: transformers' module, or K3's gated one."""
    return GatedLatentAttention(hf, index) if config.mla_output_gate else kimi.KimiLinearAttention(hf, index)


def dense_mlp(hf, config, intermediate_size: int | None = None) -> kimi.KimiLinearMLP:
    """A dense MLP: transformers' SwiGLU, or SiTU when ``situ_beta`` is set."""
    if config.situ_beta is None:
        return kimi.KimiLinearMLP(hf, intermediate_size)
    return SiTUMLP(hf, float(config.situ_beta), _float_or_none(config.situ_linear_beta), intermediate_size)


def _float_or_none(x) -> float | None:
    return None if x is None else float(x)


class K3MoE(kimi.KimiLinearMoE):
    """The mixture of experts with K3's options: SiTU experts and the latent MoE. The router
    (``gate``) reads the layer input at d_model; the routed experts' weighted sum goes through
    ``routed_expert_norm`` (if any) and ``routed_expert_up_proj``; the shared experts are added last."""

    def __init__(self, hf, config):
        nn.Module.__init__(self)
        self.config = hf
        latent = config.moe_latent_dim
        expert_hf = copy.copy(hf)
        if latent is not None:
            expert_hf.hidden_size = latent
        if config.situ_beta is None:
            self.experts = kimi.KimiLinearExperts(expert_hf)
        else:
            self.experts = SiTUExperts(expert_hf, float(config.situ_beta), _float_or_none(config.situ_linear_beta))
        self.gate = kimi.KimiLinearTopkRouter(hf)
        self.shared_experts = dense_mlp(hf, config, hf.moe_intermediate_size * hf.n_shared_experts)
        self.routed_expert_down_proj = None if latent is None else nn.Linear(hf.hidden_size, latent, bias=False)
        self.routed_expert_up_proj = None if latent is None else nn.Linear(latent, hf.hidden_size, bias=False)
        self.routed_expert_norm = (
            kimi.KimiLinearRMSNorm(latent, eps=hf.rms_norm_eps) if config.moe_latent_norm else None
        )

    def forward(self, hidden_states: Tensor) -> Tensor:
        shape = hidden_states.shape
        _, weights, indices = self.gate(hidden_states)
        x = hidden_states.view(-1, shape[-1])
        if self.routed_expert_down_proj is not None:
            x = self.routed_expert_down_proj(x)
        y = self.experts(x, indices, weights)
        if self.routed_expert_norm is not None:
            y = self.routed_expert_norm(y)
        if self.routed_expert_up_proj is not None:
            y = self.routed_expert_up_proj(y)
        return y.view(shape) + self.shared_experts(hidden_states)


def mixture_of_experts(hf, config) -> nn.Module:
    """An MoE MLP: transformers' module, or :class:`K3MoE` when SiTU or the latent MoE is set."""
    if config.situ_beta is None and config.moe_latent_dim is None:
        return kimi.KimiLinearMoE(hf)
    return K3MoE(hf, config)


@torch.no_grad()
def init_k3_weights(model) -> None:
    """The latent MoE's projections: ``routed_expert_up_proj`` writes into the stream (scaled by
    1/sqrt(2 n_layers) like the other output projections), ``routed_expert_down_proj`` reads it
    (plain N(0, init_std); the generic rule scales it by its name)."""
    std, n_layers = model.config.init_std, model.config.n_layers
    for module in model.modules():
        if isinstance(module, K3MoE) and module.routed_expert_down_proj is not None:
            assert module.routed_expert_up_proj is not None
            nn.init.normal_(module.routed_expert_down_proj.weight, mean=0.0, std=std)
            nn.init.normal_(module.routed_expert_up_proj.weight, mean=0.0, std=std / (2 * n_layers) ** 0.5)
