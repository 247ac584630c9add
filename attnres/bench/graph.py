"""`attnres bench graph`: what torch.compile traces for each residual scheme, counted.

The compiled step time of a scheme follows from the graphs inductor receives: how many ops, how
many of them matrix products (calls into BLAS that inductor cannot fuse with the pointwise loops
around them), and whether the forward breaks into several graphs. This bench traces one training
forward + backward of each variant with dynamo and AOT autograd (no code generation, so it takes
seconds) and counts the ATen ops of the forward and backward graphs, their matrix products, the
copy/scatter ops that functionalization writes for in-place buffer updates, and dynamo's graph
breaks. The counts depend on the number of Transformer blocks and the residual geometry, not on
widths or sequence length, which is why the default model is narrow.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Counter, Dict, List, Optional

import torch

from attnres.bench.train import DEFAULT_VARIANTS, model_config
from attnres.model import AttnResLM
from attnres.train.progress import progress_bar

MATMULS = ("aten.mm.", "aten.bmm.", "aten.baddbmm.", "aten.addmm.", "aten.mv.", "aten.dot.", "aten.addbmm.")
COPIES = ("aten.copy.", "aten.copy_.", "aten.slice_scatter.", "aten.select_scatter.", "aten.index_put")


@dataclass
class GraphBenchConfig:
    # the model fields of ``train.BenchConfig``, so that ``train.model_config`` builds each variant
    d_model: int = 32
    n_layers: int = 12
    n_heads: int = 2
    seq_len: int = 16
    batch_size: int = 2
    vocab_size: int = 64
    blocks: Optional[int] = 8  # Block AttnRes N (None: the model's default)
    variants: List[str] = field(default_factory=lambda: list(DEFAULT_VARIANTS))
    device: str = "cpu"

    @classmethod
    def quick(cls) -> "GraphBenchConfig":
        return cls(n_layers=4, variants=["prenorm", "block", "full"])


def _count(ops: Counter, names) -> int:
    return sum(n for op, n in ops.items() if op.startswith(names))


def trace(cfg: GraphBenchConfig, variant: str) -> dict:
    """The forward and backward graphs of one variant's training step as AOT autograd sees them."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.utils import counters
    from torch._functorch.aot_autograd import aot_module_simplified

    graphs: Dict[str, List[Counter]] = {"forward": [], "backward": []}

    def recorder(kind):
        def compiler(gm, _inputs):
            graphs[kind].append(collections.Counter(
                str(node.target) for node in gm.graph.nodes if node.op == "call_function"))
            return make_boxed_func(gm.forward)
        return compiler

    def backend(gm, inputs):
        return aot_module_simplified(gm, inputs, fw_compiler=recorder("forward"), bw_compiler=recorder("backward"))

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = AttnResLM(model_config(cfg, variant)).to(cfg.device)
    x = torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.seq_len), device=cfg.device)
    torch.compile(model, backend=backend)(x).float().square().mean().backward()
    row = {"graphs": len(graphs["forward"]), "graph_breaks": sum(counters["graph_break"].values())}
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
        "one training forward + backward traced by dynamo and AOT autograd; ATen ops per graph kind",
        "",
        "| variant | graphs | graph breaks | forward ops | forward matmuls | forward copies | backward ops "
        "| backward matmuls | backward copies |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in result["rows"].items():
        lines.append(f"| {name} | {r['graphs']} | {r['graph_breaks']} | {r['forward_ops']:,} | {r['forward_matmuls']} | "
                     f"{r['forward_copies']} | {r['backward_ops']:,} | {r['backward_matmuls']} | {r['backward_copies']} |")
    lines += ["", "matmuls: mm, bmm, baddbmm, addmm, mv, dot (BLAS calls inductor does not fuse); copies: copy, "
              "slice/select scatter, index_put (in-place updates after functionalization)."]
    return "\n".join(lines)
