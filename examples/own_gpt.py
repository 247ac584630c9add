"""Attention Residuals in a GPT of your own: a nanoGPT-style model (LayerNorm, learned positions, GELU MLP,
deliberately not attnres' LLaMA) that gets AttnRes in a handful of lines, trained on the bundled corpus.

    python examples/own_gpt.py --residual block --steps 300     # about 1 s a step on 2 shared CPU cores
    python examples/own_gpt.py --residual prenorm                # the same GPT with its usual residuals

The lines that make it AttnRes are marked ``# AttnRes``: the scheme is built once for the model
(``attnres.residual_scheme``), each block resumes the depth stream from the state it receives and
returns the new state (tensors only, so ``fully_shard``, ``checkpoint_wrapper`` and ``torch.compile``
wrap a block like any other), and the model starts the state at the embedding and finishes it before
the final norm. tests/examples/test_own_gpt.py checks it against a plain PreNorm GPT at init, under
per-block FSDP2, per-block activation checkpointing, torch.compile and tensor parallelism.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import attnres


@dataclass
class GPTConfig:
    vocab_size: int = 256  # bytes
    block_size: int = 128  # context length
    n_layer: int = 6
    n_head: int = 4
    n_embd: int = 128
    residual: str = "block"  # "prenorm": the usual GPT; "block", "full", or any of `attnres schemes`
    residual_options: dict = field(default_factory=dict)  # e.g. {"attnres_blocks": 4}; `attnres options`


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.head_dim = config.n_embd // config.n_head
        # separate projections, so that tensor parallelism can split each by heads
        self.q_proj = nn.Linear(config.n_embd, config.n_embd)
        self.k_proj = nn.Linear(config.n_embd, config.n_embd)
        self.v_proj = nn.Linear(config.n_embd, config.n_embd)
        self.o_proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        # -1 heads: all of them, or this rank's share under tensor parallelism
        q, k, v = (
            proj(x).view(b, t, -1, self.head_dim).transpose(1, 2) for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, depth: attnres.DepthState, residual: attnres.ResidualScheme) -> attnres.DepthState:
        stream = residual.stream(depth)  # AttnRes: x = x + f(ln(x)) becomes
        stream.apply(lambda h: self.attn(self.ln_1(h)))  # AttnRes: h = a depth mixture, then f(ln(h))
        stream.apply(lambda h: self.mlp(self.ln_2(h)))
        return stream.depth()  # AttnRes: the state, as tensors


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        self.residual = attnres.residual_scheme(  # AttnRes: attention, MLP, attention, ... and the final read
            config.residual, config.n_embd, 2 * config.n_layer, norm_eps=1e-5, **config.residual_options
        )
        self._init_weights()
        # AttnRes: at init every depth weight is uniform, so a sublayer reads its sources' mean, 1/K of
        # the usual residual sum; scaling each pre-norm's eps by 1/K^2 makes the model the PreNorm GPT
        attnres.match_prenorm_eps(
            [n for block in self.h for n in (block.ln_1, block.ln_2)] + [self.ln_f], self.residual
        )

    def _init_weights(self) -> None:
        for name, p in self.named_parameters():
            if name.startswith("residual."):
                continue  # the scheme's own initialisation (zero queries, unit key norms)
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() == 2:  # GPT-2's: N(0, 0.02), the projections into the residual scaled by depth
                std = (
                    0.02 / math.sqrt(2 * self.config.n_layer)
                    if name.endswith(("o_proj.weight", "proj.weight"))
                    else 0.02
                )
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> Tensor:
        """idx [B, T] -> logits [B, T, V], or the mean cross-entropy with ``targets``."""
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        depth = self.residual.start(x)  # AttnRes: the embedding is source 0
        for block in self.h:
            depth = block(depth, self.residual)
        logits = self.lm_head(self.ln_f(self.residual.finish(depth)))  # AttnRes: the final depth read
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def bundled_bytes() -> tuple[Tensor, Tensor]:
    """The bundled Shakespeare corpus as byte ids, split 90 / 10 by document."""
    from attnres.data import load_bundled_corpus

    docs = load_bundled_corpus()
    cut = int(0.9 * len(docs))
    as_ids = [
        torch.tensor(list("\n\n".join(d.text for d in part).encode()), dtype=torch.long)
        for part in (docs[:cut], docs[cut:])
    ]
    return as_ids[0], as_ids[1]


def batch(data: Tensor, batch_size: int, block_size: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    starts = torch.randint(0, len(data) - block_size - 1, (batch_size,), generator=generator)
    x = torch.stack([data[s : s + block_size] for s in starts.tolist()])
    y = torch.stack([data[s + 1 : s + block_size + 1] for s in starts.tolist()])
    return x, y


def train(config: GPTConfig, steps: int, batch_size: int = 16, lr: float = 3e-3, seed: int = 0) -> dict:
    """AdamW on the bundled corpus with attnres' parameter groups; returns the final losses."""
    torch.manual_seed(seed)
    model = GPT(config)
    groups = attnres.param_groups(model, weight_decay=0.1)  # AttnRes parameters: AdamW, no decay
    optimizer = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))
    train_ids, val_ids = bundled_bytes()
    g = torch.Generator().manual_seed(seed)
    start = time.perf_counter()
    for step in range(steps):
        lr_now = lr * min(1.0, (step + 1) / 20) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps)))
        for group in optimizer.param_groups:
            group["lr"] = lr_now
        loss = model(*batch(train_ids, batch_size, config.block_size, g))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 50 == 0 or step == steps - 1:
            print(f"step {step:4d}  loss {loss.item():.4f}  {time.perf_counter() - start:.0f} s", flush=True)
    model.eval()
    val_g = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        val = sum(model(*batch(val_ids, batch_size, config.block_size, val_g)).item() for _ in range(8)) / 8
    return {"train_loss": loss.item(), "val_loss": val, "seconds": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--residual", default="block", help="prenorm, block, full, or any `attnres schemes`")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    result = train(GPTConfig(n_layer=args.layers, residual=args.residual), args.steps, seed=args.seed)
    print(
        f"{args.residual}: train loss {result['train_loss']:.4f}, val loss {result['val_loss']:.4f} "
        f"({result['seconds']:.0f} s)"
    )


if __name__ == "__main__":
    main()
