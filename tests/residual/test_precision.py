"""The depth stream's precision under autocast and in bfloat16 models, and its forward on the meta device.

Under autocast a sublayer hands back bfloat16 while the embedding stays float32, and PreNorm's stream
h + f is float32. The depth stream keeps float32 there too: its sources, partial sums, merges and Phase-1
statistics. In a bfloat16 model PreNorm's stream is bfloat16, and so are the depth stream's sources and
partial sums; its statistics and merges stay float32, so a read is its exact value rounded once.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from attnres import AttnResLM, ModelConfig
from attnres.ops import backends
from attnres.ops.depth_attention import depth_attention_reference
from attnres.residual import RESIDUALS, BlockAttnRes, FullAttnRes
from attnres.residual import depth_streams as forms

D, L = 64, 24
# every form of the depth stream: the impls, and the two-phase form torch.compile traces (forced here
# in eager mode), with Phase 1 as pointwise autograd and as the attnres::phase1 custom op
FORMS = ["two_phase", "fused", "reference", "compiled", "compiled_op"]
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")),
]


def scheme(kind: str, form: str, seed: int = 0):
    """Block or Full AttnRes with sharp depth weights: pseudo-queries ~ N(0, 0.5), logits of std ~4."""
    torch.manual_seed(seed)
    impl = "two_phase" if form.startswith("compiled") else form
    s = (
        FullAttnRes(D, L, attnres_impl=impl)
        if kind == "full"
        else BlockAttnRes(D, L, attnres_blocks=L // 2, attnres_impl=impl)
    )
    with torch.no_grad():
        s.queries.normal_(0, 0.5)
    return s


def use_form(form: str, monkeypatch) -> None:
    if form.startswith("compiled"):
        monkeypatch.setattr(forms, "compiled_form", lambda embedding: True)
    if form == "compiled_op":
        monkeypatch.setattr(backends, "POINTWISE_PAIRS", 0)
        monkeypatch.setattr(backends, "CUSTOM_OP_DEVICES", frozenset({"cpu", "cuda"}))


class RoundedSublayer(nn.Module):
    """A sublayer computed in float32 whose output is rounded to ``half`` (bfloat16 or float16), as a
    Linear's under autocast: handed back in that dtype under autocast and as float32 otherwise. Both runs
    then feed the stream the same values, and a difference between them is the stream's own arithmetic
    (for PreNorm: none)."""

    def __init__(self, half: torch.dtype = torch.bfloat16):
        super().__init__()
        self.half = half
        self.norm, self.up, self.down = nn.RMSNorm(D), nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, h):
        with torch.autocast(h.device.type, enabled=False):
            f = self.down(nn.functional.gelu(self.up(self.norm(h.float())))).to(self.half)
        return f if torch.is_autocast_enabled(h.device.type) else f.to(h.dtype)


def run(s, device: str, autocast: bool, half: torch.dtype = torch.bfloat16):
    """The stream over L rounded sublayers: (its output, the gradients of x and of every parameter)."""
    torch.manual_seed(1)
    sublayers = nn.ModuleList(RoundedSublayer(half) for _ in range(L)).to(device)
    head = nn.Linear(D, 5).to(device)
    s = s.to(device)
    x = torch.randn(2, 8, D, generator=torch.Generator().manual_seed(2)).to(device).requires_grad_()
    with torch.autocast(device, dtype=half, enabled=autocast):
        # as the model drives it: each Transformer block of two sublayers resumes the stream from a DepthState
        depth = s.start(x)
        for first in range(0, L, 2):
            stream = s.stream(depth)
            for sublayer in sublayers[first : first + 2]:
                stream.apply(sublayer)
            depth = stream.depth()
        y = s.finish(depth)
    head(nn.functional.rms_norm(y.float(), (D,))).pow(2).mean().backward()
    named = [("x", x), *(("scheme." + n, p) for n, p in s.named_parameters())]
    named += [("sublayers." + n, p) for n, p in sublayers.named_parameters()]
    return y.detach().float().cpu(), {n: p.grad.float().cpu() for n, p in named}


def cosine(a, b) -> float:
    return torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item()


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("kind", ["block", "full"])
def test_under_autocast_the_depth_stream_keeps_float32(kind, form, device, half, monkeypatch):
    """Given the same half-precision sublayer outputs (bfloat16 or float16), the stream under autocast
    computes what it computes in float32. Kept in bfloat16, Block's partial sums round at every write (at
    this size the gradient's cosine drops to 0.997, 0.992 for the worst tensor, reads are off by 1e-2) and
    each source's gradient is summed over its readers in bfloat16 (Full: entries off by 1 % of the largest)."""
    use_form(form, monkeypatch)
    y32, g32 = run(scheme(kind, form), device, autocast=False, half=half)
    y16, g16 = run(scheme(kind, form), device, autocast=True, half=half)
    torch.testing.assert_close(y16, y32, rtol=1e-5, atol=1e-6)
    flat16, flat32 = (torch.cat([g.flatten() for g in grads.values()]) for grads in (g16, g32))
    assert cosine(flat16, flat32) >= 0.999
    for name, want in g32.items():
        assert cosine(g16[name], want) >= 0.999, name
        torch.testing.assert_close(g16[name], want, rtol=1e-4, atol=1e-4 * want.abs().max().item(), msg=name)


@pytest.mark.parametrize(
    "residual,options",
    [(r, {"attnres_impl": i}) for r in ("block", "full") for i in ("two_phase", "fused", "reference")]
    + [(r, {}) for r in RESIDUALS if r not in ("block", "full")],
    ids=lambda v: v if isinstance(v, str) else v.get("attnres_impl", ""),
)
def test_a_model_under_autocast_keeps_its_depth_state_in_float32(residual, options):
    """The whole model under CPU bf16 autocast, every registered scheme: every sublayer reads float32
    (PreNorm's stream's dtype) and every tensor of the depth state handed between Transformer blocks is
    float32."""
    model = AttnResLM(
        ModelConfig(vocab_size=64, d_model=16, n_layers=3, n_heads=2, max_seq_len=8, residual=residual, **options)
    )
    seen: list[tuple[str, torch.dtype]] = []
    for i, block in enumerate(model.blocks):
        for norm in (block.attn_norm, block.mlp_norm):
            norm.register_forward_pre_hook(lambda m, args, i=i: seen.append((f"read in block {i}", args[0].dtype)))
        block.register_forward_hook(
            lambda m, args, depth, i=i: seen.extend(
                (f"{part} after block {i}", t.dtype)
                for part in ("history", "state", "cache")
                for t in getattr(depth, part)
            )
        )
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randint(0, 64, (2, 8))).float().sum().backward()
    assert [what for what, dtype in seen if dtype != torch.float32] == []


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("kind", ["block", "full"])
def test_a_bfloat16_stream_rounds_each_read_once(kind, form, monkeypatch):
    """A bfloat16 model: sources and partial sums are bfloat16, as PreNorm's stream is; Phase-1 statistics
    and merges are float32, so every read is the exact depth attention over the stream's own sources,
    rounded once to bfloat16 (within its unit roundoff 2^-8)."""
    use_form(form, monkeypatch)
    s = scheme(kind, form).to(torch.bfloat16)
    sublayers = [RoundedSublayer() for _ in range(L)]
    x = torch.randn(2, 8, D, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    stream = s.begin(x)
    for l in range(L + 1):
        producers = stream._producers(l)
        assert all(p.dtype == torch.bfloat16 for p in producers)
        h = stream.read(l) if l < L else stream.end()
        want = depth_attention_reference(
            torch.stack(producers).double(), s.queries[l].double(), s.key_norm_weight[l].double(), eps=s.eps
        ).h
        assert h.dtype == torch.bfloat16
        assert ((h.double() - want).abs() <= 2**-8 * want.abs() + 1e-6).all(), f"read {l}"
        if form == "two_phase" and stream._phase1 is not None:
            _, h1, lse, _ = stream._phase1
            assert lse.dtype == torch.float32 and all(t.dtype == torch.float32 for t in h1)
        if l < L:
            stream.write(l, sublayers[l](h))


@pytest.mark.parametrize("kind", ["block", "full"])
def test_float32_outputs_enter_the_stream_uncopied(kind):
    """Float32 in, nothing cast: a Full source / a Block partial sum is the sublayer's output itself."""
    s = scheme(kind, "reference")
    stream = s.begin(torch.randn(2, 3, D))
    stream.read(0)
    f = torch.randn(2, 3, D)
    stream.write(0, f)
    assert (stream.sources[-1] if kind == "full" else stream.partial) is f


RIVALS = [name for name in RESIDUALS if name not in ("block", "full")]  # every other registered scheme


@pytest.mark.parametrize(
    "residual,options",
    [(r, {}) for r in RIVALS]
    + [(r, {"attnres_impl": i}) for r in ("block", "full") for i in ("two_phase", "fused", "reference")],
    ids=list(RIVALS) + [f"{r}-{i}" for r in ("block", "full") for i in ("two_phase", "fused", "reference")],
)
def test_a_forward_on_the_meta_device_infers_shapes(residual, options):
    """A model built on the meta device runs forward and backward there (no autocast exists on it)."""
    with torch.device("meta"):
        model = AttnResLM(
            ModelConfig(vocab_size=64, d_model=16, n_layers=2, n_heads=2, max_seq_len=8, residual=residual, **options)
        )
    logits = model(torch.zeros(2, 8, dtype=torch.long, device="meta"))
    assert logits.device.type == "meta" and tuple(logits.shape) == (2, 8, 64)
    logits.sum().backward()
    assert all(p.grad is not None and p.grad.device.type == "meta" for p in model.parameters())
