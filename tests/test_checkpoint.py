"""attnres.checkpoint: round trips, atomic replacement, crash safety, corrupt files, config checks."""

from __future__ import annotations

import copy
import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from stand_in import make_model, muon_opt, params_equal, save, train

from attnres.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    read_checkpoint_state,
)
from attnres.checkpoint import save as ckpt_mod
from attnres.residual import BlockAttnRes, FullAttnRes, match_prenorm_eps

REPO_ROOT = Path(__file__).resolve().parents[1]
TESTS_DIR = Path(__file__).resolve().parent


def hidden_dirs(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


@pytest.mark.parametrize("tied", [False, True])
def test_checkpoint_round_trip(tmp_path, tied):
    model = make_model(tie_embeddings=tied)
    opt = muon_opt(model)
    train(model, opt, 0, 3)
    path = save(tmp_path / "run" / "ckpt", model, opt, 3)

    # RNG draws right after saving ...
    draws = (torch.rand(3), np.random.rand(3), random.random())
    train(model, opt, 3, 2)  # uninterrupted continuation
    state = read_checkpoint_state(path)
    assert state["step"] == 3 and state["format_version"] == ckpt_mod.FORMAT_VERSION
    assert set(state["files"]) == {"model.safetensors", "optimizer.pt", "rng.pt"}
    assert state["model_config"]["dims"] == [1, 2]

    torch.manual_seed(999), np.random.seed(999), random.seed(999)
    fresh = make_model(seed=7, tie_embeddings=tied)
    fresh_opt = muon_opt(fresh)
    info = load_checkpoint(path, model=fresh, optimizer=fresh_opt)
    # ... equal the draws right after loading
    assert torch.equal(torch.rand(3), draws[0])
    assert np.array_equal(np.random.rand(3), draws[1])
    assert random.random() == draws[2]
    assert info["step"] == 3 and info["train_state"]["loader"] == {"epoch": 0, "pos": 3}
    assert info["train_config"]["optimizer"] == "muon"

    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        aliases = json.loads(f.metadata()["attnres_aliases"])
    if tied:
        assert "head.weight" not in keys and aliases == {"head.weight": "embed.weight"}
        assert fresh.head.weight is fresh.embed.weight
    else:
        assert "head.weight" in keys and aliases == {}

    train(fresh, fresh_opt, 3, 2)
    assert params_equal(model, fresh), "resumed run diverged from the uninterrupted one"


def test_checkpoint_replace_and_latest(tmp_path):
    run = tmp_path / "run"
    model = make_model()
    opt = muon_opt(model)
    save(run / "ckpt_a", model, opt, 5)
    train(model, opt, 0, 1)
    save(run / "ckpt_b", model, opt, 9)
    save(run / "ckpt_a", model, opt, 7)  # replace an older checkpoint in place
    assert read_checkpoint_state(run / "ckpt_a")["step"] == 7
    assert latest_checkpoint(run) == run / "ckpt_b"
    assert latest_checkpoint(tmp_path / "nothing") is None
    assert hidden_dirs(run) == []
    (run / "notes").mkdir()
    (run / "notes" / "x.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        save(run / "notes", model, opt, 1)
    assert (run / "notes" / "x.txt").read_text() == "keep me"


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_every_checkpoint_file_follows_the_umask(tmp_path, umask):
    model = make_model()
    previous = os.umask(umask)
    try:
        save(tmp_path / "ckpt", model, muon_opt(model), 1)
    finally:
        os.umask(previous)
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in (tmp_path / "ckpt").iterdir()}
    assert modes == dict.fromkeys(modes, oct(0o666 & ~umask))  # model.safetensors was 0600


def test_crash_during_write_keeps_previous_checkpoint(tmp_path, monkeypatch):
    run = tmp_path / "run"
    model = make_model()
    opt = muon_opt(model)
    target = save(run / "ckpt", model, opt, 1)
    weights = copy.deepcopy(model.state_dict())
    train(model, opt, 1, 1)

    def disk_full(path, obj):
        raise OSError("simulated: disk full")

    monkeypatch.setattr(ckpt_mod, "_write_torch", disk_full)
    with pytest.raises(OSError, match="disk full"):
        save(target, model, opt, 2)
    monkeypatch.undo()
    assert hidden_dirs(run) == []
    assert latest_checkpoint(run) == target

    real_rename = ckpt_mod._rename
    calls = []

    def fail_second_rename(src, dst):
        calls.append(src)
        if len(calls) == 2:
            raise OSError("simulated: rename failed")
        real_rename(src, dst)

    monkeypatch.setattr(ckpt_mod, "_rename", fail_second_rename)
    with pytest.raises(OSError, match="rename failed"):
        save(target, model, opt, 2)
    monkeypatch.undo()
    assert hidden_dirs(run) == []  # old moved back, temp removed

    fresh = make_model(seed=5)
    assert load_checkpoint(target, model=fresh, optimizer=muon_opt(fresh))["step"] == 1
    assert all(torch.equal(weights[k], v) for k, v in fresh.state_dict().items())


_CRASH_SCRIPT = """
import os
from stand_in import make_model, muon_opt, save, train
from attnres.checkpoint import save as ckpt_mod
model = make_model()
opt = muon_opt(model)
train(model, opt, 0, 2)
mode = {mode!r}
if mode == "write":
    def die(path, obj):
        open(path, "wb").write(b"partial")
        os._exit(3)
    ckpt_mod._write_torch = die
else:
    real = ckpt_mod._rename
    def die_after_first(src, dst):
        real(src, dst)
        os._exit(3)
    ckpt_mod._rename = die_after_first
save({target!r}, model, opt, 2)
"""


@pytest.mark.parametrize("mode", ["write", "swap"])
def test_hard_crash_leaves_a_whole_checkpoint(tmp_path, mode):
    """Kill the process (no cleanup code runs) while writing files, or between the two renames."""
    run = tmp_path / "run"
    model = make_model()
    opt = muon_opt(model)
    target = save(run / "ckpt", model, opt, 1)
    weights = copy.deepcopy(model.state_dict())

    script = _CRASH_SCRIPT.format(mode=mode, target=str(target))
    path = [str(REPO_ROOT), str(TESTS_DIR), os.environ.get("PYTHONPATH", "")]  # the child imports stand_in
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=env, capture_output=True, text=True)
    assert proc.returncode == 3, proc.stderr

    leftovers = hidden_dirs(run)
    assert leftovers, "the simulated crash should leave a hidden dir behind"
    if mode == "swap":
        assert not target.exists()  # crashed between 'old away' and 'new in'
    # the leftovers are never mistaken for a checkpoint; the old one is found and loads
    assert latest_checkpoint(run) == target
    fresh = make_model(seed=11)
    info = load_checkpoint(target, model=fresh, optimizer=muon_opt(fresh))
    assert info["step"] == 1
    assert all(torch.equal(weights[k], v) for k, v in fresh.state_dict().items())

    # the next save repairs/cleans up and replaces it
    save(target, model, opt, 4)
    assert hidden_dirs(run) == []
    assert read_checkpoint_state(target)["step"] == 4


def test_corrupt_files_raise_checkpoint_error(tmp_path):
    model = make_model()
    opt = muon_opt(model)
    target = save(tmp_path / "ckpt", model, opt, 1)
    st = target / "model.safetensors"
    good = st.read_bytes()
    victim = make_model(seed=3)
    before = copy.deepcopy(victim.state_dict())

    st.write_bytes(good[: len(good) // 2])  # truncated
    with pytest.raises(CheckpointError, match=r"model\.safetensors is truncated"):
        load_checkpoint(target, model=victim)
    with pytest.raises(CheckpointError, match=r"model\.safetensors cannot be parsed"):
        load_checkpoint(target, model=victim, verify=False)

    flipped = bytearray(good)
    flipped[len(flipped) - 10] ^= 0xFF  # inside the tensor data
    st.write_bytes(bytes(flipped))
    with pytest.raises(CheckpointError, match=r"model\.safetensors is corrupt: sha256"):
        load_checkpoint(target, model=victim)
    assert params_equal(victim, _with_state(make_model(seed=3), before)), "a failed load modified the model"
    st.write_bytes(good)

    opt_file = target / "optimizer.pt"
    raw = bytearray(opt_file.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    opt_file.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r"optimizer\.pt is corrupt"):
        load_checkpoint(target, model=victim, optimizer=muon_opt(victim))
    assert params_equal(victim, _with_state(make_model(seed=3), before)), "weights were applied before the failure"

    (target / "rng.pt").unlink()
    with pytest.raises(CheckpointError, match=r"rng\.pt is missing"):
        load_checkpoint(target)
    load_checkpoint(target, restore_rng=False)  # state.json alone is fine

    (target / "state.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"state\.json is corrupt"):
        load_checkpoint(target)
    with pytest.warns(UserWarning, match="skipping"):
        assert latest_checkpoint(tmp_path) is None
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nope")
    assert issubclass(CheckpointError, ValueError)


def _with_state(model, state):
    model.load_state_dict(state)
    return model


def test_config_mismatch_names_fields(tmp_path):
    model = make_model()
    target = save(tmp_path / "ckpt", model, None, 0)
    other = make_model(n_layers=3, d_model=8)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(target, model=other)
    msg = str(err.value)
    assert "n_layers: checkpoint=2, model=3" in msg and "d_model: checkpoint=16, model=8" in msg
    assert "vocab_size" not in msg
    with pytest.raises(CheckpointError, match="saved without it"):
        load_checkpoint(target, model=make_model(), optimizer=muon_opt(make_model()))


class _OwnModel(torch.nn.Module):
    """A model of your own (no ``config``): pre-norms matched to its AttnRes scheme, tanh sublayers."""

    def __init__(self, scheme, eps: float = 1e-5, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.sublayers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(4))
        self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(16, eps=eps) for _ in range(5))
        self.residual = scheme
        match_prenorm_eps(self.norms, scheme)
        with torch.no_grad():
            for p in scheme.parameters():
                p.normal_()

    def forward(self, x):
        stream = self.residual.begin(x)
        for f, norm in zip(self.sublayers, self.norms, strict=False):
            stream.apply(lambda h, f=f, norm=norm: torch.tanh(f(norm(h))))
        return self.norms[-1](stream.end())


def _save_weights(path: Path, model) -> Path:
    return ckpt_mod.save_checkpoint(
        path, model=model, optimizer=None, step=0, train_state={}, model_config={}, train_config={}
    )


def _drop_records(target: Path) -> None:
    """Rewrite a checkpoint as attnres wrote it before schemes kept a record (and fix its state.json)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    file = target / "model.safetensors"
    with safe_open(str(file), framework="pt") as f:
        metadata = f.metadata()
    save_file({k: v for k, v in load_file(file).items() if not k.endswith("_extra_state")}, file, metadata=metadata)
    state = json.loads((target / "state.json").read_text())
    state["files"]["model.safetensors"] = {"sha256": ckpt_mod.sha256(file), "bytes": file.stat().st_size}
    (target / "state.json").write_text(json.dumps(state))


@pytest.mark.parametrize(
    "saved,into,names",
    [
        (lambda: BlockAttnRes(16, 4, attnres_blocks=2), lambda: FullAttnRes(16, 4), ["block (", "full ("]),
        (
            lambda: BlockAttnRes(16, 4, attnres_blocks=2),
            lambda: BlockAttnRes(16, 4, attnres_blocks=4),
            ["attnres_blocks=2"],
        ),
        (
            lambda: FullAttnRes(16, 4, attnres_heads=4),
            lambda: FullAttnRes(16, 4),
            ["attnres_heads=4", "attnres_heads=1"],
        ),
    ],
    ids=["block-to-full", "N2-to-N4", "heads4-to-1"],
)
def test_a_checkpoint_of_another_residual_scheme_is_refused_before_loading(tmp_path, saved, into, names):
    target = _save_weights(tmp_path / "ckpt", _OwnModel(saved()))
    model = _OwnModel(into(), seed=1)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(CheckpointError, match="residual scheme mismatch: the checkpoint has") as err:
        load_checkpoint(target, model=model, restore_rng=False)
    assert "\n" not in str(err.value) and all(name in str(err.value) for name in names)
    assert params_equal(model, _with_state(_OwnModel(into(), seed=1), before)), "weights were applied"


def test_a_checkpoint_restores_the_scheme_and_pre_norm_eps(tmp_path):
    """Same scheme, built with other eps: the checkpoint's key-norm eps and matched pre-norm eps come back."""
    source = _OwnModel(FullAttnRes(16, 4, norm_eps=1e-3), eps=1e-3).double()
    target = _save_weights(tmp_path / "ckpt", source)
    model = _OwnModel(FullAttnRes(16, 4), eps=1e-6, seed=1).double()
    load_checkpoint(target, model=model, restore_rng=False)
    assert model.residual.eps == 1e-3 and [n.eps for n in model.norms] == [n.eps for n in source.norms]
    x = torch.randn(2, 3, 16, dtype=torch.float64) * 0.01  # small reads: every eps shows
    assert torch.equal(model(x), source(x))


def test_a_checkpoint_from_before_the_scheme_record_still_loads(tmp_path):
    from attnres.checkpoint import load_model
    from attnres.model import AttnResLM, ModelConfig

    own = _OwnModel(BlockAttnRes(16, 4, attnres_blocks=2))
    target = _save_weights(tmp_path / "own", own)
    _drop_records(target)
    model = _OwnModel(BlockAttnRes(16, 4, attnres_blocks=2), seed=1)
    load_checkpoint(target, model=model, restore_rng=False)
    assert params_equal(model, own)

    torch.manual_seed(0)
    lm = AttnResLM(ModelConfig(vocab_size=40, d_model=16, n_layers=2, n_heads=2, max_seq_len=8, residual="full"))
    target = ckpt_mod.save_checkpoint(
        tmp_path / "lm",
        model=lm,
        optimizer=None,
        step=0,
        train_state={},
        model_config=lm.config.to_dict(),
        train_config={},
    )
    _drop_records(target)
    loaded, _, _ = load_model(target)
    x = torch.randint(0, 40, (2, 8))
    assert torch.equal(loaded(x), lm.eval()(x))
