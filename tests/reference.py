"""Float64 references written loop by loop from docs/method.md, shared by the tests."""

import torch


def loop_reference(sources, query, key_weight, eps, kernel, normalize_keys):
    """Per token, per head: logits, weights, output. sources [K, B, T, D] (float64)."""
    K, B, T, D = sources.shape
    H = 1 if query.dim() in (1, 3) else query.shape[-2]
    dh = D // H
    h = torch.zeros(B, T, D, dtype=torch.float64)
    alpha = torch.zeros(K, B, T, H, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            q = query if query.dim() <= 2 else query[b, t]
            q = q.reshape(D)
            for head in range(H):
                ch = slice(head * dh, (head + 1) * dh)
                logits = []
                for i in range(K):
                    v = sources[i, b, t]
                    key = v
                    if normalize_keys:
                        key = v / torch.sqrt((v * v).mean() + eps) * key_weight
                    logits.append((q[ch] * key[ch]).sum())
                z = torch.stack(logits)
                a = torch.softmax(z, 0) if kernel == "softmax" else torch.sigmoid(z)
                alpha[:, b, t, head] = a
                for i in range(K):
                    h[b, t, ch] += a[i] * sources[i, b, t, ch]
    return h, (alpha.squeeze(-1) if H == 1 else alpha)


def logits(sources, query, key_weight, eps, normalize_keys=True):
    """The logits of docs/method.md §3 for one static query, vectorised: [K, B, T, H] (float64)."""
    keys = sources
    if normalize_keys:
        keys = sources * torch.rsqrt(sources.pow(2).mean(-1, keepdim=True) + eps) * key_weight
    heads = 1 if query.dim() == 1 else query.shape[0]
    return (keys * query.reshape(-1)).unflatten(-1, (heads, -1)).sum(-1)


def reference_stream_inputs(residual, embedding, outputs):
    """Recompute every sublayer input h_l and the final aggregation from docs/method.md §3-4.

    ``residual`` is the model's DepthAttentionResidual (for its parameters and
    options); ``embedding`` [B, T, D] and ``outputs`` (the L sublayer outputs f_l)
    were captured from the model. Everything is float64.
    Rules encoded here: depth block n starts with no partial sum (its first
    sublayer reads only completed blocks); b_n^i = b_n^{i-1} + f; a block
    closes after S sublayers or at the last one; the final aggregation reads
    every completed block.
    """
    L, S, window = residual.n_sublayers, residual.block_size, residual.window
    blocks, partial, inputs = [embedding], None, []
    for l in range(L + 1):
        done = blocks if window is None or len(blocks) - 1 <= window else [blocks[0]] + blocks[-window:]
        srcs = done + ([partial] if partial is not None else [])
        stacked = torch.stack(srcs)
        kw = residual.key_norm_weight[l].detach().double() if residual.key_norm else None
        if residual.query_form.name == "scalar":
            logits = residual.mix_logits[l].detach().double()
            a = torch.softmax(logits, 0) if residual.kernel == "softmax" else torch.sigmoid(logits)
            h = (a[:, None, None, None] * stacked).sum(0)
        else:
            if residual.query_form.name == "pseudo_query":
                q = residual.queries[l].detach().double()
            else:
                recent = partial if partial is not None else blocks[-1]
                q = recent @ residual.query_proj[l].detach().double().t()
            if residual.heads > 1:
                q = q.unflatten(-1, (residual.heads, -1))
            h, _ = loop_reference(stacked, q, kw, residual.eps, residual.kernel, residual.key_norm)
        inputs.append(h)
        if l == L:
            break
        partial = outputs[l] if partial is None else partial + outputs[l]
        if (l + 1) % S == 0 or l == L - 1:
            blocks.append(partial)
            partial = None
    return inputs


def randomize(module, seed=1, scale=0.5):
    """Move every parameter of ``module`` away from its initialisation (kept as the centre), so that
    zero-initialised depth parameters are tested for real."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=p.dtype) * scale
            if "query_proj" in name:  # d x d input-dependent queries: keep the logits O(scale)
                noise = noise / p.shape[-1] ** 0.5
            p.add_(noise)
    return module


def two_phase_inputs(n=5, S=3, B=2, T=3, D=8, heads=1, seed=0):
    """Random float64 inputs of the two-phase ops: n sources [n, B, T, D], S queries ([S, D] or
    [S, H, D/H]), key weights [S, D] away from zero, a partial sum [B, T, D]."""
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(n, B, T, D, generator=g, dtype=torch.float64) * 1.5 + 0.2
    qshape = (S, D) if heads == 1 else (S, heads, D // heads)
    q = torch.randn(qshape, generator=g, dtype=torch.float64)
    kw = torch.rand(S, D, generator=g, dtype=torch.float64) + 0.5
    p = torch.randn(B, T, D, generator=g, dtype=torch.float64)
    return v, q, kw, p
