"""Measurements of a trained model, taken once at the end of every experiment run.

They go to ``probes.json`` so that reports never need a checkpoint:

- ``output_rms[l]`` / ``input_rms[l]``: RMS of sublayer l's output f_l and of its
  input h_l (from the model's DepthRecord), on a validation batch;
- ``block_grad_norm[i]``: L2 norm of the loss gradient over the parameters of
  Transformer block i (one backward pass on the same batch);
- ``output_grad_rms[l]``: RMS of the loss gradient with respect to f_l;
- ``depth_weights`` / ``depth_sources``: the mean depth-weight matrix (AttnRes
  schemes; None otherwise), rows = consumers (sublayers, then the final
  aggregation), columns = sources;
- ``routing``: how sharply each consumer routes over depth
  (``attnres.analysis.depth.routing_sharpness``: per consumer the mean over tokens
  (and heads) of the largest depth weight and of the weights' entropy, and the
  number of sources K_l); None for schemes without depth weights. Runs finished
  before this probe existed have no such key;
- ``mixing``: the depth mixing matrix M of *any* scheme (paper Figure 9), defined
  as the per-token least-squares coefficients expressing each sublayer input h_l
  (and the input of the final norm, last row) as a combination of the sources
  v_0 (embedding) and v_{i+1} = f_i for i < l, averaged over tokens. For schemes
  whose inputs are scalar-weighted sums of the sources (prenorm, ReZero, the
  AttnRes family, DenseFormer, MUDD, Hyper-Connections, mHC) the fit is exact
  and ``mixing_r2`` is 1; for per-channel schemes (LayerScale, Highway) M is the
  best scalar description and ``mixing_r2`` < 1 says how much it leaves out.
  M[l, i] for prenorm is 1 for every i <= l; AttnRes rows sum to 1.
- ``routing_gain``: additive routing's learned gain g at the end of training
  (``gain_rms``, ``gain_shift_rms``: RMS of g and of g minus its initial value, ``gain_init``, and
  ``per_read_rms``: the RMS over channels of each read's g_l), so a report can say whether the gain
  moved; None without a learned gain. Runs finished before this probe existed have no such key.
"""

from __future__ import annotations

import math

import numpy as np
import torch

PROBE_BATCH = 4
MIXING_TOKENS = 256


def _rms(t: torch.Tensor) -> float:
    return t.detach().double().pow(2).mean().sqrt().item()


def _nan_to_none(matrix) -> list | None:
    if matrix is None:
        return None
    return [
        [None if (v is None or (isinstance(v, float) and math.isnan(v))) else float(v) for v in row]
        for row in np.asarray(matrix, dtype=float).tolist()
    ]


def _sublayer_output(output) -> torch.Tensor:
    """What a sublayer hands the stream: transformers' attention modules (Kimi Linear's MLA) return
    (output, attention weights)."""
    return output[0] if isinstance(output, tuple) else output


def gradient_probe(model, x: torch.Tensor, y: torch.Tensor) -> dict:
    """One forward (with the depth record) and backward pass: magnitudes per depth."""
    from attnres.model.llama import lm_loss

    grads: list[float | None] = [None] * (2 * len(model.blocks))
    handles = []

    def keep_grad(index):
        def hook(module, inputs, output):
            output = _sublayer_output(output)
            if output.requires_grad:
                output.register_hook(lambda g: grads.__setitem__(index, _rms(g)))

        return hook

    for i, block in enumerate(model.blocks):
        handles.append(block.attn.register_forward_hook(keep_grad(2 * i)))
        handles.append(block.mlp.register_forward_hook(keep_grad(2 * i + 1)))
    model.zero_grad(set_to_none=True)
    try:
        out = model(x, return_record=True)
        loss = lm_loss(out.logits, y)
        loss.backward()
    finally:
        for h in handles:
            h.remove()
    block_norms = []
    for block in model.blocks:
        sq = sum(p.grad.double().pow(2).sum().item() for p in block.parameters() if p.grad is not None)
        block_norms.append(math.sqrt(sq))
    model.zero_grad(set_to_none=True)
    return {"record": out.record, "loss": loss.item(), "block_grad_norm": block_norms, "output_grad_rms": grads}


@torch.no_grad()
def mixing_matrix(model, x: torch.Tensor, max_tokens: int = MIXING_TOKENS) -> dict:
    """M (see the module docstring) with its per-row R^2, from hooks on the sublayers."""
    inputs: dict[int, torch.Tensor] = {}  # sublayer -> the input of its pre-norm (h_l)
    outputs: dict[int, torch.Tensor] = {}  # sublayer -> its output (f_l)
    emb, final = [], []
    handles = [
        model.embed.register_forward_hook(lambda m, i, o: emb.append(o)),
        model.norm.register_forward_pre_hook(lambda m, i: final.append(i[0])),
    ]
    for i, block in enumerate(model.blocks):
        for j, norm, sub in ((2 * i, block.attn_norm, block.attn), (2 * i + 1, block.mlp_norm, block.mlp)):
            handles.append(norm.register_forward_pre_hook(lambda m, a, j=j: inputs.__setitem__(j, a[0])))
            handles.append(sub.register_forward_hook(lambda m, a, o, j=j: outputs.__setitem__(j, _sublayer_output(o))))
    try:
        model(x)
    finally:
        for h in handles:
            h.remove()
    L = 2 * len(model.blocks)
    flat = lambda t: t.detach().double().reshape(-1, t.shape[-1])[:max_tokens]  # noqa: E731
    sources = torch.stack([flat(emb[0])] + [flat(outputs[j]) for j in range(L)], dim=-1)  # [N, d, L+1]
    targets = [flat(inputs[j]) for j in range(L)] + [flat(final[-1])]
    d = sources.shape[1]
    M = np.full((L + 1, L + 1), np.nan)
    r2 = []
    for j, h in enumerate(targets):
        A = sources[..., : j + 1]
        coef = torch.linalg.lstsq(A, h.unsqueeze(-1)).solution  # [N, j+1, 1]
        resid = h - (A @ coef).squeeze(-1)
        denom = h.pow(2).sum().item()
        r2.append(1.0 - resid.pow(2).sum().item() / denom if denom > 0 else float("nan"))
        M[j, : j + 1] = coef.squeeze(-1).mean(0).numpy()
    return {
        "mixing": M,
        "mixing_r2": r2,
        "mixing_tokens": int(sources.shape[0]),
        "mixing_underdetermined": bool(d < L + 1),
    }


@torch.no_grad()
def gain_probe(model) -> dict | None:
    """``routing_gain`` (see the module docstring)."""
    from attnres.residual.attnres import DepthAttentionResidual
    from attnres.residual.variants import AdditiveRouting

    scheme = next((m for m in model.modules() if isinstance(m, DepthAttentionResidual)), None)
    stats = scheme.gain_stats() if scheme is not None else {}
    if not stats:
        return None
    assert scheme is not None and isinstance(scheme.routing, AdditiveRouting)  # a learned gain is additive routing's
    g = scheme.routing_gain.detach().double()
    return {**stats, "gain_init": scheme.routing.init, "per_read_rms": g.pow(2).mean(-1).sqrt().tolist()}


def run_probes(model, val, *, seq_len: int) -> dict:
    """All probes on the first validation window(s); the model is left in eval mode."""
    from attnres.analysis.depth import (
        depth_weight_matrix,
        routing_sharpness,
        source_labels,
    )
    from attnres.data import eval_batches

    device = next(model.parameters()).device
    x, y = next(iter(eval_batches(val.tokens, PROBE_BATCH, seq_len, max_batches=1)))
    x, y = x.to(device), y.to(device)
    model.eval()
    g = gradient_probe(model, x, y)
    record = g.pop("record")
    weights = depth_weight_matrix(record)
    mix = mixing_matrix(model, x)
    return {
        "probe_tokens": int(x.numel()),
        "probe_loss": g["loss"],
        "n_layers": len(model.blocks),
        "n_sublayers": 2 * len(model.blocks),
        "input_rms": list(record.input_rms),
        "output_rms": list(record.output_rms),
        "block_grad_norm": g["block_grad_norm"],
        "output_grad_rms": g["output_grad_rms"],
        "depth_weights": _nan_to_none(weights),
        "depth_sources": source_labels(record) if weights is not None else None,
        "routing": routing_sharpness(record),
        "mixing": _nan_to_none(mix["mixing"]),
        "mixing_r2": mix["mixing_r2"],
        "mixing_tokens": mix["mixing_tokens"],
        "mixing_underdetermined": mix["mixing_underdetermined"],
        "routing_gain": gain_probe(model),
    }
