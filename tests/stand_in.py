"""A tiny stand-in language model for the training-component tests.

It honours the contract the trainer's parts rely on (a ``config`` dataclass, ``param_kinds()``,
``model(ids) -> logits``) without the real model, so that optimizer, checkpoint and metrics tests
stay independent of it. Importable by spawned children too (``tests/`` is on the path).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from attnres.train import build_optimizer, save_checkpoint, set_lr


@dataclasses.dataclass
class TinyConfig:
    vocab_size: int = 32
    d_model: int = 16
    n_layers: int = 2
    tie_embeddings: bool = False
    dims: tuple = (1, 2)  # a tuple: JSON turns it into a list; the config check must not care


class TinyBlock(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.RMSNorm(d)
        self.w_in = nn.Linear(d, 2 * d, bias=False)
        self.w_out = nn.Linear(2 * d, d, bias=False)
        self.pseudo_query = nn.Parameter(torch.zeros(d))
        self.gate = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return x + self.gate * self.w_out(torch.relu(self.w_in(self.norm(x) + self.pseudo_query)))


class TinyLM(nn.Module):
    def __init__(self, config: TinyConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(TinyBlock(config.d_model) for _ in range(config.n_layers))
        self.norm_f = nn.RMSNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.ones(1))

    def param_kinds(self) -> dict[str, str]:
        kinds = {}
        for name, p in self.named_parameters():
            if name.startswith("embed."):
                kinds[name] = "embedding"
            elif name.startswith("head."):
                kinds[name] = "head"
            elif p.ndim == 2:
                kinds[name] = "matrix"
            else:
                kinds[name] = "no_decay"
        return kinds

    def forward(self, ids):
        x = self.embed(ids) * self.scale
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm_f(x))


def make_model(seed: int = 0, **cfg) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(TinyConfig(**cfg))


def batch(step: int, vocab: int = 32, b: int = 4, t: int = 9) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, vocab, (b, t), generator=g)


def lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1))


def train(model, opt, start: int, n: int, sched=None, fixed_batch: bool = False) -> list[float]:
    losses = []
    for step in range(start, start + n):
        if sched is not None:
            set_lr(opt, sched(step))
        loss = lm_loss(model, batch(0 if fixed_batch else step))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def params_equal(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def muon_opt(model, **kw):
    return build_optimizer(model, "muon", lr=1e-2, weight_decay=0.1, **kw)


def save(path, model, opt, step, **extra):
    return save_checkpoint(
        path,
        model=model,
        optimizer=opt,
        step=step,
        train_state={"tokens_seen": step * 100, "loader": {"epoch": 0, "pos": step}, **extra},
        model_config=dataclasses.asdict(model.config),
        train_config={"lr": 1e-2, "optimizer": "muon"},
    )
