"""Kimi Linear end to end: training (Muon, MoE balancing, checkpoints, resume), decoding through the
hybrid cache and Hugging Face generate(), and attnres convert on Kimi Linear directories."""

import json
import os
import signal
from pathlib import Path

import pytest
import torch

from attnres.cli import main
from attnres.inference.sampling import generate
from attnres.model import AttnResLM, ModelConfig
from attnres.train.config import build_configs
from attnres.train.trainer import Trainer, TrainingInterrupted

STEPS = dict(
    steps=4,
    warmup_steps=1,
    eval_every=4,
    eval_batches=1,
    checkpoint_every=2,
    batch_size=2,
    seq_len=16,
    progress=False,
    threads=1,
)


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNRES_CACHE", str(tmp_path / "cache"))


def rows(run_dir, kind="train"):
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def test_train_kimi_tiny_with_muon_logs_expert_load_and_resumes_bit_identically(tmp_path, monkeypatch):
    """The bundled corpus, Block AttnRes, Muon (experts orthogonalised per matrix), router-bias
    balancing; an interrupted and resumed run reproduces the uninterrupted one bit for bit."""
    full = tmp_path / "full"
    assert (
        main(
            [
                "train",
                "--preset",
                "kimi-tiny",
                "--residual",
                "block",
                "--out",
                str(full),
                "--no-progress",
                *[f"--set={k}={v}" for k, v in STEPS.items() if k != "progress"],
            ]
        )
        == 0
    )
    train = rows(full)
    assert len(train) == 4 and all(torch.isfinite(torch.tensor(r["loss"])) for r in train)
    for layer in (1, 2, 3):  # the dense first layer has no experts
        load = train[0][f"moe_load.{layer}"]
        assert len(load) == 4 and sum(load) == pytest.approx(1, abs=1e-4)
        assert train[0][f"moe_maxvio.{layer}"] >= 0
    assert "moe_load.0" not in train[0]

    model_cfg, train_cfg = build_configs("kimi-tiny", {"residual": "block", "out_dir": str(tmp_path / "part"), **STEPS})
    original = Trainer.train_step

    def interrupting(self):
        loss = original(self)
        if self.step == 3:
            os.kill(os.getpid(), signal.SIGINT)
        return loss

    monkeypatch.setattr(Trainer, "train_step", interrupting)
    with pytest.raises(TrainingInterrupted, match="step 3"):
        Trainer(model_cfg, train_cfg).run()
    monkeypatch.setattr(Trainer, "train_step", original)
    Trainer(model_cfg, train_cfg, resume=True).run()
    assert [r["loss"] for r in rows(tmp_path / "part")] == [r["loss"] for r in train]
    assert [r["moe_load.2"] for r in rows(tmp_path / "part")] == [r["moe_load.2"] for r in train]
    assert rows(tmp_path / "part", "eval")[-1]["val_loss"] == rows(full, "eval")[-1]["val_loss"]


def test_router_balancing_moves_the_bias_toward_the_mean_load():
    torch.manual_seed(0)
    model = AttnResLM(
        ModelConfig(
            backbone="kimi_linear",
            vocab_size=40,
            d_model=16,
            n_layers=2,
            n_heads=2,
            max_seq_len=16,
            kimi_layer_pattern="M",
            moe_experts=4,
            moe_dense_layers=1,
            moe_bias_update_rate=0.01,
        )
    )
    model.train()
    model(torch.randint(0, 40, (4, 16))).sum().backward()
    load = model.blocks[1].expert_load.clone()
    assert load.sum() == 4 * 16 * 2  # top-2 of 64 tokens
    report = model.end_step()
    bias = model.blocks[1].mlp.gate.e_score_correction_bias
    torch.testing.assert_close(bias, 0.01 * torch.sign(load.mean() - load), rtol=0, atol=0)
    assert report["moe_load.1"] == [round(x, 5) for x in (load / load.sum()).tolist()]
    assert model.blocks[1].expert_load is None and model.end_step() == {}  # counts consumed; nothing new
    with torch.no_grad():
        model(torch.randint(0, 40, (1, 4)))
    assert model.blocks[1].expert_load is None  # evaluation leaves the balancing alone


@pytest.mark.parametrize("residual", ["prenorm", "block"])
def test_cached_generation_equals_uncached_and_hf_generate(residual):
    """Greedy decoding through the hybrid cache (prefill, then single tokens, then the re-prefilled
    window past max_seq_len) picks the tokens the full forward picks; generate() of the Hugging Face
    wrapper does the same."""
    import attnres.hf  # noqa: F401
    from attnres.hf import AttnResForCausalLM

    torch.manual_seed(1)
    model = (
        AttnResLM(
            ModelConfig(
                backbone="kimi_linear",
                vocab_size=40,
                d_model=16,
                n_layers=4,
                n_heads=2,
                max_seq_len=12,
                moe_experts=4,
                residual=residual,
            )
        )
        .double()
        .eval()
    )
    prompt = torch.randint(0, 40, (1, 5))
    cached = list(generate(model, prompt, 10, temperature=0))
    assert cached == list(generate(model, prompt, 10, temperature=0, use_cache=False))
    hf = AttnResForCausalLM.from_attnres_lm(model).eval()
    out = hf.generate(prompt, max_new_tokens=10, do_sample=False)
    assert out[0, 5:].tolist() == cached


def test_convert_kimi_linear_directories(tmp_path):
    """attnres convert: a plain Kimi Linear checkpoint (saved by transformers) -> AttnRes Hugging Face
    directory (logits checked) and -> the §10 layout, which AutoModelForCausalLM loads as ours."""
    from transformers import AutoModelForCausalLM, KimiLinearForCausalLM

    from attnres.bench.kimi import KimiBenchConfig, reference_model

    source = reference_model(KimiBenchConfig(), "1:1, MoE").float()
    source.save_pretrained(str(tmp_path / "kimi"))
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    expected = source(ids).logits
    assert main(["convert", str(tmp_path / "kimi"), str(tmp_path / "hf"), "--residual", "full"]) == 0
    ours = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    assert type(ours).__name__ == "AttnResForCausalLM" and ours.config.residual == "full"
    assert (ours(ids).logits - expected).abs().max() < 1e-5
    # the released layout has no eps compensation (docs/method.md §10): asked for, and without it refused
    assert (
        main(
            [
                "convert",
                str(tmp_path / "kimi"),
                str(tmp_path / "k3"),
                "--to",
                "kimi_linear",
                "--attnres-block-size",
                "2",
            ]
        )
        == 2
    )
    assert (
        main(
            [
                "convert",
                str(tmp_path / "kimi"),
                str(tmp_path / "k3"),
                "--to",
                "kimi_linear",
                "--attnres-block-size",
                "2",
                "--set",
                "attnres_scale_norm_eps=false",
                "--force",
            ]
        )
        == 0
    )
    assert json.loads((tmp_path / "k3" / "config.json").read_text())["attn_res_block_size"] == 1
    released = AutoModelForCausalLM.from_pretrained(str(tmp_path / "k3"))
    assert type(released).__name__ == "AttnResForCausalLM"
    # zero queries: the source's function up to the eps term, (K^2 - 1) eps against the mean square of
    # small embeddings (the convert log reports 1.6e-3 here)
    assert (released(ids).logits - expected).abs().max() < 1e-2
    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "plain"), "--to", "kimi_linear"]) == 2  # Full
    # prenorm written back is a plain checkpoint transformers loads as its own
    assert (
        main(
            [
                "convert",
                str(tmp_path / "kimi"),
                str(tmp_path / "pre"),
                "--to",
                "kimi_linear",
                "--residual",
                "prenorm",
                "--no-verify",
            ]
        )
        == 0
    )
    plain = KimiLinearForCausalLM.from_pretrained(str(tmp_path / "pre"))
    plain.config._experts_implementation = "eager"  # the source's expert loop (grouped_mm sums in another order)
    assert torch.equal(plain(ids).logits, expected)


def test_beam_search_reorders_the_hybrid_cache():
    """Beam search re-ranks beams after every step and reorders the cache: MLA latents and KDA states
    of the kept rows. With length_penalty 0 a beam's score is the sum of its tokens' log-probabilities,
    which the full forward (no cache) recomputes."""
    import attnres.hf  # noqa: F401
    from attnres.hf import AttnResForCausalLM
    from attnres.inference.hybrid_cache import HybridCache

    torch.manual_seed(2)
    model = (
        AttnResLM(
            ModelConfig(
                backbone="kimi_linear",
                vocab_size=40,
                d_model=16,
                n_layers=4,
                n_heads=2,
                max_seq_len=16,
                moe_experts=4,
                residual="block",
            )
        )
        .double()
        .eval()
    )
    prompts = torch.randint(0, 40, (2, 5))
    with torch.no_grad():
        cache = HybridCache.for_model(model, 2)
        model(prompts, cache=cache)
        cache.reorder_cache(torch.tensor([1, 1]))  # both rows continue row 1
        nxt = torch.tensor([[7], [7]])
        logits = model(nxt, cache=cache)[:, -1]
        alone = model(torch.cat([prompts[1:], nxt[1:]], dim=1))[:, -1]
    torch.testing.assert_close(logits, alone.expand(2, -1), rtol=0, atol=1e-6)  # KDA runs in float32

    hf = AttnResForCausalLM.from_attnres_lm(model).eval()
    out = hf.generate(
        prompts[:1],
        max_new_tokens=6,
        do_sample=False,
        num_beams=3,
        num_return_sequences=3,
        length_penalty=0.0,
        early_stopping=True,
        output_scores=True,
        return_dict_in_generate=True,
    )
    with torch.no_grad():
        logp = torch.log_softmax(model(out.sequences)[:, 4:-1], dim=-1)
    total = logp.gather(-1, out.sequences[:, 5:, None]).squeeze(-1).sum(-1)
    torch.testing.assert_close(out.sequences_scores.double(), total, rtol=0, atol=1e-5)


def test_compiled_decoding_is_refused_by_name():
    """The static KV cache holds no KDA state: compiled decoding says so before compiling anything."""
    import attnres.hf  # noqa: F401
    from attnres.hf import AttnResForCausalLM
    from attnres.inference import CompiledDecoder

    model = AttnResLM(
        ModelConfig(
            backbone="kimi_linear", vocab_size=40, d_model=16, n_layers=2, n_heads=2, max_seq_len=12, moe_experts=0
        )
    ).eval()
    for refuse in (
        lambda: CompiledDecoder(model, 1, setting="aot_eager"),
        lambda: AttnResForCausalLM.from_attnres_lm(model).compile_decoding("aot_eager"),
    ):
        with pytest.raises(ValueError, match=r"backbone='kimi_linear' keeps recurrent state .*\(compile off\)"):
            refuse()
