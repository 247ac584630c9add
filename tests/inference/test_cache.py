"""KV-cached decoding and chunked prefill equal the full forward pass, for every residual scheme."""

import pytest
import torch
from reference import randomize

from attnres import AttnResLM, ModelConfig
from attnres.inference import KVCache, StaticKVCache, chunked_prefill
from attnres.inference.sampling import generate
from attnres.residual import RESIDUALS

SCHEMES = sorted(RESIDUALS)


def model_for(residual, dtype, seed=0, **overrides):
    torch.manual_seed(seed)
    cfg = ModelConfig(
        **{
            "vocab_size": 61,
            "d_model": 32,
            "n_layers": 3,
            "n_heads": 4,
            "n_kv_heads": 2,
            "max_seq_len": 24,
            "residual": residual,
            **overrides,
        }
    )
    model = AttnResLM(cfg).to(dtype).eval()
    randomize(model.residual, seed=seed + 1, scale=0.3)
    return model


def tokens(t, seed=0):
    return torch.randint(0, 61, (2, t), generator=torch.Generator().manual_seed(seed))


# the static cache's arithmetic is the same in float32; float64 shows it exactly, so it is run there only
@pytest.mark.parametrize("residual", SCHEMES)
@pytest.mark.parametrize(
    "cache_class,dtype,tol",
    [(KVCache, torch.float64, 1e-10), (KVCache, torch.float32, 1e-5), (StaticKVCache, torch.float64, 1e-10)],
)
def test_prefill_then_decode_equals_full_forward(residual, dtype, tol, cache_class):
    model = model_for(residual, dtype)
    x = tokens(18)
    with torch.no_grad():
        full = model(x)
        cache = cache_class.for_model(model, batch_size=2)
        steps = [model(x[:, :6], cache=cache)]
        steps += [model(x[:, t : t + 1], cache=cache) for t in range(6, 18)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=tol, atol=tol)
    assert cache.length == 18


@pytest.mark.parametrize(
    "residual,overrides",
    [("block", {}), ("block", {"attnres_impl": "fused"}), ("full", {"attnres_group_size": 2}), ("prenorm", {})],
)
@pytest.mark.parametrize("chunk", [1, 4, 7])
def test_chunked_prefill_equals_full_forward(residual, overrides, chunk):
    model = model_for(residual, torch.float64, **overrides)
    x = tokens(17, seed=3)
    with torch.no_grad():
        full = model(x)
        out = chunked_prefill(model, x, KVCache.for_model(model, 2), chunk, all_logits=True)
        last = chunked_prefill(model, x, KVCache.for_model(model, 2), chunk)
    torch.testing.assert_close(out, full, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(last, full[:, -1], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("residual", ["prenorm", "block", "full"])
def test_cached_generation_equals_uncached_past_the_context_limit(residual):
    model = model_for(residual, torch.float64)
    prompt = tokens(5)[:1]
    n = 30  # runs past max_seq_len=24: both paths then slide the same window
    greedy = list(generate(model, prompt, n, temperature=0))
    assert greedy == list(generate(model, prompt, n, temperature=0, use_cache=False))
    sampled = list(generate(model, prompt, n, temperature=1.0, top_k=10, seed=7))
    assert sampled == list(generate(model, prompt, n, temperature=1.0, top_k=10, seed=7, use_cache=False))


def test_cache_overflow_is_a_clear_error():
    model = model_for("block", torch.float32)
    cache = KVCache.for_model(model, batch_size=2, max_len=8)
    with torch.no_grad():
        model(tokens(6), cache=cache)
        with pytest.raises(ValueError, match="KV cache holds 6 of 8 positions"):
            model(tokens(3), cache=cache)
    with pytest.raises(ValueError, match="max_seq_len=24"):
        model(tokens(25))


def test_cache_holds_keys_and_values_only():
    model = model_for("block", torch.float32)
    cache = KVCache.for_model(model, batch_size=2)
    c = model.config
    assert cache.nbytes() == 2 * c.n_layers * 2 * c.n_kv_heads * c.head_dim * c.max_seq_len * 4


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("residual", ["prenorm", "block", "full", "mudd"])
def test_padded_batch_prefill_and_decode_equal_each_prompt_alone(residual, side, pad):
    """Chunked prefill of a padded batch, then cached decoding with the mask grown by one column per
    step: each row's logits are those of its prompt and continuation run alone (float64, 1e-10)."""
    model = model_for(residual, torch.float64)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, 61, (n,), generator=g) for n in (6, 11, 3)]
    ids, mask = pad(prompts, pad_id=9, side=side)
    steps = torch.randint(1, 61, (3, 4), generator=g)  # the tokens each row decodes next
    cache = KVCache.for_model(model, batch_size=3)
    with torch.no_grad():
        prefill = chunked_prefill(model, ids, cache, 4, all_logits=True, attention_mask=mask)
        decoded = []
        for s in range(steps.shape[1]):
            mask = torch.cat([mask, torch.ones(3, 1, dtype=mask.dtype)], dim=1)
            decoded.append(model(steps[:, s : s + 1], cache=cache, attention_mask=mask)[:, 0])
        for row, p in enumerate(prompts):
            alone = model(torch.cat([p, steps[row]])[None])[0]
            real = mask[row, : ids.shape[1]].bool()
            torch.testing.assert_close(prefill[row][real], alone[: len(p)], rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(torch.stack([d[row] for d in decoded]), alone[len(p) :], rtol=1e-10, atol=1e-10)


def test_cache_reorders_rows_for_beam_search():
    model = model_for("block", torch.float64)
    x = tokens(8)
    cache = KVCache.for_model(model, batch_size=2)
    with torch.no_grad():
        model(x[:, :5], cache=cache)
        cache.reorder_cache(torch.tensor([1, 1]))  # both rows continue row 1
        out = model(x[1:, 5:].expand(2, -1), cache=cache)
        alone = model(x[1:])[:, 5:]
    torch.testing.assert_close(out, alone.expand(2, -1, -1), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("compiled", [False, True])
def test_generation_caches_the_positions_it_can_reach_not_max_seq_len(compiled, monkeypatch):
    """A long-context model (max_seq_len=10**9) decodes with a cache of prompt + new tokens: one of
    max_seq_len positions would be hundreds of gigabytes."""
    import attnres.inference.sampling as sampling

    sizes = []
    real_cache, real_decoder = sampling.make_cache, sampling.CompiledDecoder

    def make_cache(model, batch_size, max_len=None):
        sizes.append(max_len)
        assert max_len is not None and max_len <= 64, max_len  # refused before it is allocated
        return real_cache(model, batch_size, max_len)

    def decoder(model, batch_size, max_len=None, setting=True):
        sizes.append(max_len)
        assert max_len is not None and max_len <= 64, max_len
        return real_decoder(model, batch_size, max_len, setting="aot_eager")

    monkeypatch.setattr(sampling, "make_cache", make_cache)
    monkeypatch.setattr(sampling, "CompiledDecoder", decoder)
    big = model_for("block", torch.float32, max_seq_len=10**9)
    prompt = tokens(5)[:1]
    out = list(generate(big, prompt, 4, temperature=0, compile=compiled))
    assert sizes == [9] and len(out) == 4
    assert out == list(generate(big, prompt, 4, temperature=0, use_cache=False))
