"""The up-front memory estimate: a batch that clearly cannot fit is refused with what fits."""

import pytest
import torch

from attnres.train.config import build_configs
from attnres.train.memory import check_memory, estimate_step_memory


def test_a_batch_that_cannot_fit_is_refused_with_what_fits():
    model, train_cfg = build_configs("tiny", {"batch_size": 100_000_000})
    with pytest.raises(ValueError, match=r"batch_size=100000000 needs about [\d,.]+ GiB .* batch_size <= \d+ fits"):
        check_memory(model, train_cfg, torch.device("cpu"), available=8 << 30)
    fits = estimate_step_memory(model, 4, 32)
    check_memory(model, build_configs("tiny")[1], torch.device("cpu"), available=fits)  # the tiny preset fits
    with pytest.raises(ValueError, match="not even batch_size=1 fits"):
        check_memory(model, build_configs("tiny")[1], torch.device("cpu"), available=1000)


def test_the_estimate_grows_with_the_batch_and_skips_pipelines():
    model, train_cfg = build_configs("tiny")
    assert estimate_step_memory(model, 8, 32) > estimate_step_memory(model, 4, 32) > 0
    _, piped = build_configs("tiny", {"pp": 2})
    check_memory(model, piped, torch.device("cpu"), available=1)  # pipeline stages split the model: not checked
    _, split = build_configs("tiny", {"tp": 2})
    check_memory(model, split, torch.device("cpu"), available=1)  # so does tensor parallelism


def test_checkpointing_lowers_the_estimate_and_is_offered_when_it_would_fit():
    model, _ = build_configs("tiny", {"n_layers": 12})
    per_mode = {mode: estimate_step_memory(model, 8, 32, mode) for mode in ("none", "block", "sublayer")}
    assert per_mode["none"] > per_mode["block"] and per_mode["none"] > per_mode["sublayer"]
    # a batch between what fits without and what fits with "block" checkpointing
    available = (estimate_step_memory(model, 64, 32, "none") + estimate_step_memory(model, 64, 32, "block")) // 2
    _, plain = build_configs("tiny", {"n_layers": 12, "batch_size": 64, "seq_len": 32})
    with pytest.raises(
        ValueError,
        match=r"batch_size <= \d+ fits .*activation_checkpointing='block' fits "
        r"batch_size <= \d+",
    ):
        check_memory(model, plain, torch.device("cpu"), available=available)
    _, checkpointed = build_configs(
        "tiny", {"n_layers": 12, "batch_size": 64, "seq_len": 32, "activation_checkpointing": "block"}
    )
    check_memory(model, checkpointed, torch.device("cpu"), available=available)  # fits with checkpointing


def test_the_estimate_stays_below_measured_step_peaks():
    """The estimate must err low: below the step peaks `attnres bench train` measured (committed
    JSON, d = 128, T = 256, batch 8, Block N = 4), with and without block checkpointing."""
    import json
    from pathlib import Path

    from attnres.model import ModelConfig

    reports = Path(__file__).resolve().parents[2] / "reports" / "bench"
    for layers in (12, 24, 48):
        for mode in ("none", "block"):
            result = json.loads((reports / f"checkpointing_N4_L{layers}_{mode}.json").read_text())
            c = result["config"]
            model = ModelConfig(
                vocab_size=c["vocab_size"],
                d_model=c["d_model"],
                n_layers=layers,
                n_heads=c["n_heads"],
                residual="block",
                attnres_blocks=c["blocks"],
            )
            estimate = estimate_step_memory(model, c["batch_size"], c["seq_len"], mode)
            measured = result["rows"]["block"]["step_peak_mib"] * 2**20
            assert 0.4 * measured < estimate < measured, (layers, mode, estimate / measured)
