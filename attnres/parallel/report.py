"""Pipeline traffic: bytes counted on the wire, next to what the layout and docs/method.md §7 predict."""

from __future__ import annotations

import torch.distributed as dist

from attnres.parallel.pipeline import Pipeline, PipelineLayout, spec_block_traffic

Counts = dict[tuple[int, str], int]  # (transition, "forward" | "backward") -> bytes


def gather_traffic(pipeline: Pipeline) -> Counts:
    """Every rank's send counts, summed (collective over the pipeline group)."""
    pieces: list[Counts | None] = [None] * dist.get_world_size(pipeline.group)
    dist.all_gather_object(pieces, pipeline.bytes_sent(), group=pipeline.group)
    total: Counts = {}
    for piece in pieces:
        assert piece is not None  # all_gather_object filled every rank's slot
        for k, v in piece.items():
            total[k] = total.get(k, 0) + v
    return total


def blocks_per_chunk(layout: PipelineLayout) -> int | None:
    """N_p: block representations each chunk adds to the history (the embedding not counted), or None
    when chunks differ (docs/method.md §7's closed forms assume one N_p)."""
    counts, before = [], 1  # history entry 0 is the embedding
    for c in range(layout.n_chunks - 1):
        n = len(layout.history[c])
        counts.append(n - before)
        before = n
    if not layout.history or not layout.history[0]:
        return 0
    return counts[0] if len(set(counts)) == 1 else None


def expected(layout: PipelineLayout) -> dict[str, int]:
    """Per microbatch and direction: bytes the layout sends, split by kind (from the layout itself)."""
    rows = layout.traffic()
    return {
        "embedding": sum(r["embedding_bytes"] for r in rows),
        "blocks": sum(r["block_bytes"] for r in rows),
        "state": sum(r["state_bytes"] for r in rows),
        "total": sum(r["bytes"] for r in rows),
    }


def formula(layout: PipelineLayout) -> dict[str, int] | None:
    """docs/method.md §7 for the block representations, plus the embedding (sent C-1 times naive, P cached) and
    the running state (every transition), per microbatch and direction; None without a uniform N_p."""
    n_p = blocks_per_chunk(layout)
    if n_p is None:
        return None
    naive, cached = spec_block_traffic(layout.pp, layout.vpp, n_p)
    c = layout.n_chunks
    entry = layout.history[0][0].bytes if layout.history[0] else 0
    block = layout.history[-2][-1].bytes if n_p else 0  # a block representation (may be half precision)
    blocks = (cached if layout.cache else naive) * block
    embedding = (min(layout.pp, c - 1) if layout.cache else c - 1) * entry
    state = sum(s.bytes for s in layout.state[0]) * (c - 1)
    return {
        "embedding": int(embedding),
        "blocks": int(blocks),
        "state": int(state),
        "total": int(embedding + blocks + state),
    }


def traffic_table(
    layouts: dict[str, PipelineLayout], measured: dict[str, Counts], *, steps: int, microbatches: int
) -> str:
    """Markdown: per mode, per-transition bytes (forward / backward) per step, and totals beside the
    layout's prediction and docs/method.md §7's formula."""
    lines = []
    for mode, layout in layouts.items():
        counts = measured[mode]
        per_step = {k: v / steps for k, v in counts.items()}
        n_p = blocks_per_chunk(layout)
        lines.append(
            f"**{mode}** (P={layout.pp}, V={layout.vpp}, C={layout.n_chunks}, "
            f"N_p={n_p if n_p is not None else 'varies'}; bytes per step, {microbatches} microbatches)"
        )
        lines.append("")
        lines.append("| transition | ranks | embedding | blocks | state | forward bytes | backward bytes |")
        lines.append("|---|---|---:|---:|---:|---:|---:|")
        for row in layout.traffic():
            t = row["transition"]
            lines.append(
                f"| {t}->{t + 1} | {row['src_rank']}->{row['dst_rank']} | {row['embedding']} | "
                f"{row['blocks']} | {row['state']} | {per_step.get((t, 'forward'), 0):,.0f} | "
                f"{per_step.get((t, 'backward'), 0):,.0f} |"
            )
        fwd = sum(v for (t, d), v in per_step.items() if d == "forward")
        bwd = sum(v for (t, d), v in per_step.items() if d == "backward")
        exp = {k: v * microbatches for k, v in expected(layout).items()}
        spec = formula(layout)
        lines.append("")
        lines.append(
            f"measured: forward {fwd:,.0f} B, backward {bwd:,.0f} B; layout predicts {exp['total']:,} B "
            f"each way (blocks {exp['blocks']:,}, embedding {exp['embedding']:,}, state {exp['state']:,})"
        )
        if spec is not None:
            spec = {k: v * microbatches for k, v in spec.items()}
            lines.append(
                f"method.md §7 formula: blocks {spec['blocks']:,} B + embedding {spec['embedding']:,} B + "
                f"state {spec['state']:,} B = {spec['total']:,} B each way; "
                f"{'agrees' if spec['total'] == fwd == bwd else 'DIFFERS'}"
            )
        peak = max(r["bytes"] for r in layout.traffic()) if layout.traffic() else 0
        peak_blocks = max(r["blocks"] for r in layout.traffic()) if layout.traffic() else 0
        lines.append(f"peak transition: {peak * microbatches:,} B ({peak_blocks} block representations at most)")
        lines.append("")
    return "\n".join(lines)
