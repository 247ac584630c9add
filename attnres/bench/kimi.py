"""`attnres bench kimi`: how exactly our ``kimi_linear`` backbone reproduces transformers' Kimi Linear.

For each tiny config (KDA:MLA 3:1 and 1:1, MoE on and off, and MLA only) one random float64
``KimiLinearForCausalLM`` is built from transformers' own config and modules, its weights moved away
from their initialisation, and converted (``attnres.hf.convert_kimi_linear``) into our model with
prenorm, Block and Full AttnRes (zero queries, ``attnres_scale_norm_eps``). The table gives the
largest |logit difference| from transformers' model on random tokens, and for each of our three
models the largest |logit difference| between cached decoding (prefill half the tokens, then one
token per step through ``HybridCache``) and the full forward.

What bounds the figures (docs/method.md §3): prenorm runs transformers' very operations, so its
difference is 0. Block and Full feed each pre-norm the mean of K_l sources with eps / K_l^2 instead
of their sum with eps: equal in exact arithmetic, but transformers' ``KimiLinearRMSNorm`` normalises
in float32 whatever the dtype, so the float64 models differ by float32 rounding, KDA layers or not.
Cached decoding runs KDA's recurrent kernel (float32) instead of its chunked one, and MLA over the
cached latents: float32 rounding again where KDA layers are involved.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from attnres.inference import make_cache

CASES: dict[str, dict] = {
    "3:1, MoE": dict(kimi_layer_pattern="KKKM", moe_experts=4),
    "3:1, dense": dict(kimi_layer_pattern="KKKM", moe_experts=0),
    "1:1, MoE": dict(kimi_layer_pattern="KM", moe_experts=4),
    "1:1, dense": dict(kimi_layer_pattern="KM", moe_experts=0),
    "MLA only, MoE": dict(kimi_layer_pattern="M", moe_experts=4),
}
SCHEMES = ("prenorm", "block", "full")


@dataclass
class KimiBenchConfig:
    d_model: int = 32
    n_layers: int = 4
    n_heads: int = 2
    vocab_size: int = 128
    batch_size: int = 2
    seq_len: int = 16
    weight_noise: float = 0.05  # added to every weight (and router bias) so no part sits at its init
    seed: int = 0
    device: str = "cpu"
    cases: list[str] = field(default_factory=lambda: list(CASES))

    @classmethod
    def quick(cls) -> KimiBenchConfig:
        return cls(seq_len=8)


def reference_model(cfg: KimiBenchConfig, case: str):
    """A random float64 ``KimiLinearForCausalLM`` of the case (transformers' config and modules)."""
    from transformers import KimiLinearForCausalLM

    from attnres.model import ModelConfig
    from attnres.model.kimi_linear import kimi_linear_config

    if case not in CASES:
        raise ValueError(f"--set cases: unknown case {case!r}; choose from {sorted(CASES)}")
    model_config = ModelConfig(
        backbone="kimi_linear",
        vocab_size=cfg.vocab_size,
        d_model=cfg.d_model,
        n_layers=cfg.n_layers,
        n_heads=cfg.n_heads,
        max_seq_len=cfg.seq_len,
        residual="prenorm",
        **CASES[case],
    )
    torch.manual_seed(cfg.seed)
    model = KimiLinearForCausalLM(kimi_linear_config(model_config, tie_word_embeddings=False)).double()
    g = torch.Generator().manual_seed(cfg.seed + 1)
    with torch.no_grad():
        for t in list(model.parameters()) + [b for n, b in model.named_buffers() if "correction_bias" in n]:
            t.add_(torch.randn(t.shape, generator=g, dtype=t.dtype) * cfg.weight_noise)
    # transformers wraps PreTrainedModel.to in functools.wraps, which hides the bound signature from mypy
    return model.to(cfg.device).eval()  # type: ignore[arg-type]


@torch.no_grad()
def cached_decoding_error(model, input_ids: torch.Tensor) -> float:
    """Max |logit difference| between the full forward and prefill (first half) + one-token steps."""
    lm = model.model
    full = lm(input_ids).double()
    cache = make_cache(lm, input_ids.shape[0])
    half = input_ids.shape[1] // 2
    pieces = [lm(input_ids[:, :half], cache=cache)]
    for t in range(half, input_ids.shape[1]):
        pieces.append(lm(input_ids[:, t : t + 1], cache=cache))
    return (torch.cat(pieces, dim=1).double() - full).abs().max().item()


@torch.no_grad()
def run(cfg: KimiBenchConfig) -> dict:
    from attnres.hf.kimi import convert_kimi_linear

    rows = {}
    for case in cfg.cases:
        reference = reference_model(cfg, case)
        g = torch.Generator().manual_seed(cfg.seed + 2)
        ids = torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.seq_len), generator=g).to(cfg.device)
        expected = reference(ids).logits.double()
        row = {
            "pattern": CASES[case]["kimi_layer_pattern"],
            "experts": CASES[case]["moe_experts"],
            "max_abs_logit": expected.abs().max().item(),
        }
        for scheme in SCHEMES:
            ours = convert_kimi_linear(reference, scheme, max_seq_len=cfg.seq_len)
            row[scheme] = (ours(ids).logits.double() - expected).abs().max().item()
            row[f"{scheme}_cached"] = cached_decoding_error(ours, ids)
        rows[case] = row
    return {
        "config": cfg.__dict__,
        "rows": rows,
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
    }


def format_table(result: dict) -> str:
    c = result["config"]
    lines = [
        f"bench kimi: float64, d={c['d_model']}, {c['n_layers']} layers, {c['n_heads']} heads, batch "
        f"{c['batch_size']} x {c['seq_len']} random tokens, seed {c['seed']}, device={c['device']}; torch "
        f"{result['torch']}, transformers {result['transformers']}",
        "",
        "| config | layers | experts | max abs logit | prenorm vs transformers | Block vs transformers | "
        "Full vs transformers | cached decoding vs full forward (prenorm / Block / Full) |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for case, r in result["rows"].items():
        pattern = "".join(r["pattern"][i % len(r["pattern"])] for i in range(c["n_layers"]))
        cached = " / ".join(f"{r[f'{s}_cached']:.1e}" for s in SCHEMES)
        lines.append(
            f"| {case} | {pattern} | {r['experts'] or '-'} | {r['max_abs_logit']:.2f} | "
            f"{r['prenorm']:.1e} | {r['block']:.1e} | {r['full']:.1e} | {cached} |"
        )
    lines += [
        "",
        "max |Δ logit|. K = Kimi Delta Attention, M = multi-head latent attention. Block and Full "
        "start from zero queries with attnres_scale_norm_eps (equal to prenorm in exact arithmetic); "
        "transformers' RMSNorm and KDA compute in float32, which bounds the float64 differences "
        "(attnres/bench/kimi.py).",
    ]
    return "\n".join(lines)
