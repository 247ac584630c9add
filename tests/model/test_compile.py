"""torch.compile: the forward traces without graph breaks, compiled equals eager, checkpoints keep
eager names, and compiled decoding compiles once.

Trace tests use the "aot_eager" backend (dynamo and AOT autograd, no code generation: seconds);
one test runs inductor for real (marked compile_heavy: `pytest -m compile_heavy`). All models are
tiny: compilation cost grows with the graph.
"""

import pytest
import torch
from reference import randomize
from torch._dynamo.utils import counters

from attnres import AttnResLM, ModelConfig
from attnres.inference import CompiledDecoder, KVCache
from attnres.inference.sampling import generate
from attnres.model.compile import check_compile_setting, compile_model
from attnres.residual.depth_streams import CompiledTwoPhaseStream, TwoPhaseStream


def tiny(residual, impl="two_phase", dtype=torch.float32, **extra):
    torch.manual_seed(0)
    sizes = {"vocab_size": 61, "d_model": 32, "n_layers": 2, "n_heads": 2, "max_seq_len": 72, **extra}
    cfg = ModelConfig(residual=residual, attnres_impl=impl, **sizes)
    model = AttnResLM(cfg).to(dtype)
    randomize(model.residual, seed=1, scale=0.5)  # non-zero queries: the depth weights are not uniform
    return model


def tokens(b, t, seed=0):
    return torch.randint(0, 61, (b, t), generator=torch.Generator().manual_seed(seed))


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    "residual,impl", [("prenorm", "two_phase"), ("block", "two_phase"), ("full", "two_phase"), ("block", "fused")]
)
def test_forward_and_backward_compile_without_graph_breaks(residual, impl):
    torch._dynamo.reset()
    model = tiny(residual, impl)
    x = tokens(2, 12)
    model(x).square().mean().backward()
    eager_out, eager_grads = model(x).detach(), grads(model)
    model.zero_grad()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)  # a graph break raises here
    out = compiled(x)
    out.square().mean().backward()
    torch.testing.assert_close(out.detach(), eager_out, rtol=1e-5, atol=1e-6)
    for name, g in grads(model).items():
        torch.testing.assert_close(g, eager_grads[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.compile_heavy
def test_inductor_compiles_block_attnres_training_step_equal_to_eager():
    torch._dynamo.reset()
    model = tiny("block", n_layers=1)  # one Transformer block: inductor's compile time grows with the graph
    x = tokens(2, 12)
    model(x).square().mean().backward()
    eager_grads = grads(model)
    model.zero_grad()
    compile_model(model, True)  # inductor, in place
    model(x).square().mean().backward()
    for name, g in grads(model).items():
        torch.testing.assert_close(g, eager_grads[name], rtol=1e-4, atol=1e-5, msg=name)


def test_compiling_in_place_keeps_state_dict_names():
    model = tiny("block")
    names = list(model.state_dict())
    compile_model(model, "aot_eager")
    assert list(model.state_dict()) == names
    eager = tiny("block")
    eager.load_state_dict(model.state_dict())  # strict: the same keys both ways
    compile_model(model, "aot_eager", granularity="sublayer")
    assert list(model.state_dict()) == names


@pytest.mark.parametrize("residual", ["prenorm", "block", "full"])
def test_sublayer_granularity_compiles_each_sublayer_kind_once_for_every_block(residual):
    """Regional compilation: four blocks, yet one attention graph and one MLP graph, whatever the scheme
    (the depth attention stays eager), so an AttnRes model's first compile is PreNorm's; and the compiled
    model's logits and gradients are the eager ones."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    model = tiny(residual, n_layers=4)
    x = tokens(2, 12)
    model(x).square().mean().backward()
    eager_out, eager_grads = model(x).detach(), grads(model)
    model.zero_grad()
    counter = CompileCounter()
    compile_model(model, counter, granularity="sublayer")
    for _ in range(2):  # a second step must not recompile either
        model.zero_grad()
        out = model(x)
        out.square().mean().backward()
    assert counter.frame_count == 2, f"{counter.frame_count} graphs for 4 blocks' attention and MLP sublayers"
    torch.testing.assert_close(out.detach(), eager_out, rtol=1e-5, atol=1e-6)
    for name, g in grads(model).items():
        torch.testing.assert_close(g, eager_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_compile_granularity_is_checked_and_reaches_the_run_layout():
    from attnres.train.config import TrainConfig

    with pytest.raises(ValueError, match=r"compile_granularity.*'block'.*model.*sublayer"):
        TrainConfig(compile=True, compile_granularity="block")
    assert TrainConfig(compile=True, compile_granularity="sublayer").compile_granularity == "sublayer"


def test_compile_setting_errors_name_the_field_and_the_choices():
    with pytest.raises(ValueError, match=r"TrainConfig.compile='nope' is not a torch.compile backend.*aot_eager"):
        check_compile_setting("nope")
    with pytest.raises(ValueError, match=r"TrainConfig.compile=3 is invalid"):
        check_compile_setting(3)


@pytest.mark.parametrize("residual", ["block", "full"])
def test_compiled_decoding_compiles_once_and_equals_eager_tokens(residual):
    model = tiny(residual).eval()
    prompt = tokens(1, 8, seed=3)
    eager = list(generate(model, prompt, 50, temperature=0))
    torch._dynamo.reset()
    decoder = CompiledDecoder(model, 1, setting="aot_eager")
    with torch.no_grad():
        ids = decoder(prompt).argmax(-1)[:, -1:]  # warm-up: the prompt's shape, then one token
        compiled = [int(ids)]
        ids = decoder(ids).argmax(-1)[:, -1:]
        compiled.append(int(ids))
        counters.clear()
        for _ in range(48):
            ids = decoder(ids).argmax(-1)[:, -1:]
            compiled.append(int(ids))
    assert counters["stats"]["unique_graphs"] == 0, dict(counters["stats"])  # no recompilation
    assert compiled == eager
    # and the sampling loop's compiled path gives the same tokens
    assert list(generate(model, prompt, 50, temperature=0, compile="aot_eager")) == eager


def test_compiled_decoding_logits_equal_the_kv_cache_in_float64():
    model = tiny("block", dtype=torch.float64).eval()
    x = tokens(2, 20, seed=5)
    torch._dynamo.reset()
    decoder = CompiledDecoder(model, 2, setting="aot_eager")
    cache = KVCache.for_model(model, 2)
    with torch.no_grad():
        want = [model(x[:, :12], cache=cache)] + [model(x[:, t : t + 1], cache=cache) for t in range(12, 20)]
        got = [decoder(x[:, :12])] + [decoder(x[:, t : t + 1]) for t in range(12, 20)]
        full = model(x)
    torch.testing.assert_close(torch.cat(got, 1), torch.cat(want, 1), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(torch.cat(got, 1), full, rtol=1e-10, atol=1e-10)
    assert decoder.cache.length == 20 and decoder.room() == 72 - 20
    with pytest.raises(ValueError, match="static KV cache has room for 52"):
        decoder(tokens(2, 53))


@pytest.mark.parametrize("residual", ["block", "full"])
def test_the_forms_compiled_streams_trace_equal_the_eager_ones_in_float64(monkeypatch, residual):
    """Under torch.compile the streams run Phase 1 over the sources as separate tensors, recomputing
    it in backward; that form, run eagerly through whole models in float64, gives the
    eager path's logits and gradients."""
    model = tiny(residual, dtype=torch.float64, n_layers=3, attnres_key_norm=True)
    x = tokens(2, 12)
    results = []
    for compiling in (False, True):
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda compiling=compiling: compiling)
        model.zero_grad()
        out = model(x)
        out.sin().sum().backward()
        results.append((out.detach(), grads(model)))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-12, atol=1e-12)
    for name, g in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], g, rtol=1e-10, atol=1e-12, msg=name)


def test_compiled_multi_token_streams_keep_no_buffer_and_decoding_streams_do(monkeypatch):
    """Traced for training or prefill, a two-phase stream reads its sources as separate tensors (no
    buffer to functionalize into copies); traced for a one-token step without gradients (decoding)
    it keeps the buffer, and so does every eager stream."""
    model = tiny("block", attnres_key_norm=True)
    x, token = torch.randn(2, 5, 32), torch.randn(2, 1, 32)
    assert isinstance(model.residual.begin(x), TwoPhaseStream)  # eager: the buffered form
    assert model.residual.begin(x).buffer is not None
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    stream = model.residual.begin(x)
    assert isinstance(stream, CompiledTwoPhaseStream) and stream.buffer is None
    assert len(stream.source_inv_rms) == 1
    assert isinstance(model.residual.begin(token), CompiledTwoPhaseStream)  # a training step may be one token long
    with torch.no_grad():
        assert isinstance(model.residual.begin(x), CompiledTwoPhaseStream)  # prefill
        stream = model.residual.begin(token)
    assert not isinstance(stream, CompiledTwoPhaseStream) and stream.buffer is not None
    # traced for training, Phase 1 is recomputed in backward, Block's and the grouped Full's alike
    assert model.residual.begin(x).recompute_phase1
    assert tiny("full", n_layers=3).residual.begin(x).recompute_phase1
    with torch.no_grad():
        assert not model.residual.begin(x).recompute_phase1  # prefill: no backward


def test_kimi_linear_compiles_past_the_kernels_hub_wrapper():
    """transformers wraps KDA's forward for the `kernels` hub (installed with it); dynamo could not trace
    that wrapper at the second KDA layer after an MoE layer's graph break (an internal NameError). The
    model's KDA calls the forward it wraps: compiled equals eager, and the module is still transformers'
    KDA, computing what it computes."""
    pytest.importorskip("transformers")
    from transformers.models.kimi_linear import modeling_kimi_linear as kimi

    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = ModelConfig(
        backbone="kimi_linear", vocab_size=61, d_model=32, n_layers=2, n_heads=2, max_seq_len=16, moe_experts=4
    )  # the MoE layer's graph break is what made dynamo resume at the second KDA layer and fail there
    model = AttnResLM(cfg)
    attn = model.blocks[0].attn
    assert isinstance(attn, kimi.KimiLinearDeltaAttention) and model.blocks[1].kind == "K"
    x = tokens(2, 8)
    h = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # the same function as transformers' own (wrapped) forward
        torch.testing.assert_close(attn(h), kimi.KimiLinearDeltaAttention.forward(attn, h), rtol=0, atol=0)
    model(x).square().mean().backward()
    eager_out, eager_grads = model(x).detach(), grads(model)
    model.zero_grad()
    compile_model(model, "aot_eager")
    out = model(x)
    out.square().mean().backward()
    torch.testing.assert_close(out.detach(), eager_out, rtol=1e-5, atol=1e-6)
    for name, g in grads(model).items():
        torch.testing.assert_close(g, eager_grads[name], rtol=1e-4, atol=1e-6, msg=name)
