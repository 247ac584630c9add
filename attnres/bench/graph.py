"""`attnres bench graph`: what torch.compile traces for each residual scheme, counted.

The compiled step time of a scheme follows from the graphs inductor receives: how many ops, how
many of them matrix products (calls into BLAS that inductor cannot fuse with the pointwise loops
around them), and whether the forward breaks into several graphs. This bench traces one training
forward + backward of each variant with dynamo and AOT autograd (no code generation, so it takes
seconds) and counts the ATen ops of the forward and backward graphs, their matrix products, the
copy/scatter ops that functionalization writes for in-place buffer updates, and dynamo's graph
breaks. The op counts depend on the number of Transformer blocks and the residual geometry, not
on widths or sequence length, so the default sequence is short; the width is `bench train`'s
(d 256), because per-token scalars (softmax statistics, depth weights) weigh more in d-vectors
the narrower the model.

The forward and backward are split by inductor's own partitioner (its joint-graph passes, then
the min-cut that decides what to recompute in backward), so the tensors the backward graph takes
from the forward are the ones a compiled training step keeps alive between the two: the
activation memory. We count them in d-vectors per token (float32 elements / (tokens * d)),
leaving out the parameters and anything not proportional to the token count.
"""

from __future__ import annotations

import collections
import operator
from collections import Counter
from dataclasses import dataclass, field

import torch

from attnres.bench.train import DEFAULT_VARIANTS, model_config
from attnres.model import AttnResLM
from attnres.train.progress import progress_bar

MATMULS = ("aten.mm.", "aten.bmm.", "aten.baddbmm.", "aten.addmm.", "aten.mv.", "aten.dot.", "aten.addbmm.")
COPIES = ("aten.copy.", "aten.copy_.", "aten.slice_scatter.", "aten.select_scatter.", "aten.index_put")


@dataclass
class GraphBenchConfig:
    # the model fields of ``train.BenchConfig``, so that ``train.model_config`` builds each variant
    d_model: int = 256
    n_layers: int = 12
    n_heads: int = 4
    seq_len: int = 16
    batch_size: int = 3  # unlike any width, so that activations are told from weights by their first dim
    vocab_size: int = 64
    blocks: int | None = 8  # Block AttnRes N (None: the model's default)
    variants: list[str] = field(default_factory=lambda: list(DEFAULT_VARIANTS))
    device: str = "cpu"

    @classmethod
    def quick(cls) -> GraphBenchConfig:
        return cls(n_layers=4, variants=["prenorm", "block", "full"])


def _count(ops: Counter, names) -> int:
    return sum(n for op, n in ops.items() if op.startswith(names))


def _base(node: torch.fx.Node) -> torch.fx.Node:
    """The node whose storage ``node`` shares: through views (and the items of a split)."""
    while node.op == "call_function":
        view = node.args[0] if node.target is operator.getitem else node  # the op an item came from
        if not isinstance(view, torch.fx.Node) or not (
            getattr(view.target, "is_view", False) or view.target is torch.ops.aten._unsafe_view.default
        ):
            break
        source = view.args[0]
        if not isinstance(source, torch.fx.Node):
            break
        node = source
    return node


def saved_elements(forward: torch.fx.GraphModule, backward: torch.fx.GraphModule, batch: int, tokens: int) -> int:
    """float32-equivalent elements of the activations a backward graph takes from its forward: its
    inputs other than the incoming gradients (``tangents_*``), each traced back through views to
    the forward tensor that holds the storage and counted once per storage. Storages of the
    forward's own inputs (parameters, buffers, token ids) are left out, and so are tensors that do
    not lead with the batch or the flattened tokens or whose size is not a multiple of the token
    count (positional tables, scalars)."""
    made = {node.name: node for node in forward.graph.nodes}
    bases = {}
    for node in backward.graph.nodes:
        if node.op != "placeholder" or node.name.startswith("tangents") or node.name not in made:
            continue
        base = _base(made[node.name])
        value = base.meta.get("val")
        if (
            base.op != "placeholder"
            and isinstance(value, torch.Tensor)
            and value.dim()
            and value.shape[0] in (batch, tokens)
            and value.numel() % tokens == 0
        ):
            bases[base.name] = value.numel() * value.element_size() // 4
    return sum(bases.values())


def trace(cfg: GraphBenchConfig, variant: str) -> dict:
    """The forward and backward graphs of one variant's training step as inductor receives them."""
    from torch._dynamo.utils import counters
    from torch._functorch.aot_autograd import aot_module_simplified, make_boxed_func
    from torch._inductor.compile_fx import partition_fn

    graphs: dict[str, list[Counter]] = {"forward": [], "backward": []}
    forwards: list[torch.fx.GraphModule] = []
    saved: list[int] = []

    def recorder(kind):
        def compiler(gm, _inputs):
            graphs[kind].append(
                collections.Counter(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
            )
            if kind == "forward":
                forwards.append(gm)
            else:  # backward graphs compile in reverse order of their forwards, at the first backward
                saved.append(
                    saved_elements(forwards[-1 - len(saved)], gm, cfg.batch_size, cfg.batch_size * cfg.seq_len)
                )
            return make_boxed_func(gm.forward)

        return compiler

    def backend(gm, inputs):
        return aot_module_simplified(
            gm, inputs, fw_compiler=recorder("forward"), bw_compiler=recorder("backward"), partition_fn=partition_fn
        )

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = AttnResLM(model_config(cfg, variant)).to(cfg.device)
    x = torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.seq_len), device=cfg.device)
    torch.compile(model, backend=backend)(x).float().square().mean().backward()
    row = {
        "graphs": len(graphs["forward"]),
        "graph_breaks": sum(counters["graph_break"].values()),
        "saved_per_token": sum(saved) / (cfg.batch_size * cfg.seq_len * cfg.d_model),
    }
    for kind, counts in graphs.items():
        ops = sum(counts, collections.Counter())
        row[f"{kind}_ops"] = sum(ops.values())
        row[f"{kind}_matmuls"] = _count(ops, MATMULS)
        row[f"{kind}_copies"] = _count(ops, COPIES)
    return row


def run(cfg: GraphBenchConfig) -> dict:
    rows = {v: trace(cfg, v) for v in progress_bar(cfg.variants, desc="bench graph", unit="variant")}
    return {"config": cfg.__dict__, "torch": torch.__version__, "rows": rows}


def format_table(result: dict) -> str:
    c = result["config"]
    lines = [
        f"bench graph: d={c['d_model']}, {c['n_layers']} blocks, block N={c['blocks']}, torch {result['torch']}; "
        "one training forward + backward traced by dynamo and AOT autograd, split by inductor's partitioner; "
        "ATen ops per graph kind",
        "",
        "| variant | graphs | graph breaks | forward ops | forward matmuls | forward copies | backward ops "
        "| backward matmuls | backward copies | saved for backward (d-vectors/token) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in result["rows"].items():
        lines.append(
            f"| {name} | {r['graphs']} | {r['graph_breaks']} | {r['forward_ops']:,} | {r['forward_matmuls']} | "
            f"{r['forward_copies']} | {r['backward_ops']:,} | {r['backward_matmuls']} | {r['backward_copies']} | "
            f"{r['saved_per_token']:.1f} |"
        )
    lines += [
        "",
        "matmuls: mm, bmm, baddbmm, addmm, mv, dot (BLAS calls inductor does not fuse); copies: copy, "
        "slice/select scatter, index_put (in-place updates after functionalization).",
    ]
    return "\n".join(lines)
