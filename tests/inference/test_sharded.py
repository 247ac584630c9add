"""Sequence-sharded prefill over 2 gloo processes equals one process, with a 1/P block cache."""

import json
import os

import pytest
import torch
import torch.distributed as dist
from distributed_workers import spawn
from reference import randomize

from attnres import AttnResLM, ModelConfig
from attnres.inference import sharded_prefill

CONFIGS = {
    "block": dict(residual="block", attnres_blocks=3),
    "full": dict(residual="full"),
    "mhc": dict(residual="mhc"),
}


def build(name):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=53, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, max_seq_len=32, **CONFIGS[name])
    model = AttnResLM(cfg).double().eval()
    randomize(model.residual, seed=1, scale=0.3)
    return model


def tokens():
    return torch.randint(0, 53, (2, 16), generator=torch.Generator().manual_seed(2))


def _worker(rank, world, out_dir, name):
    logits, state = sharded_prefill(build(name), tokens())
    parts = [torch.empty_like(logits) for _ in range(world)]
    dist.all_gather(parts, logits.contiguous())
    if rank == 0:
        torch.save(torch.cat(parts, dim=1), os.path.join(out_dir, "logits.pt"))
    with open(os.path.join(out_dir, f"state{rank}.json"), "w") as f:
        json.dump({"state_bytes": state}, f)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_two_rank_sharded_prefill_equals_single_process(tmp_path, name):
    world = 2
    spawn(_worker, world, str(tmp_path), name)
    model = build(name)
    with torch.no_grad():
        want = model(tokens())
    got = torch.load(tmp_path / "logits.pt", weights_only=True)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)

    # each rank holds its 1/P slice of the depth history
    stream = model.residual.begin(model.embed(tokens()))
    full_bytes = stream.state_bytes()
    for rank in range(world):
        per_rank = json.loads((tmp_path / f"state{rank}.json").read_text())["state_bytes"]
        assert per_rank * world == full_bytes > 0


def test_length_must_divide():
    spawn(_run_length_check, 2)


def _run_length_check(rank, world):
    try:
        sharded_prefill(build("block"), tokens()[:, :15])
    except ValueError as e:
        assert "not divisible by the 2 ranks" in str(e)
    else:
        raise AssertionError("expected a ValueError")
