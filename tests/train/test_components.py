"""Tests for attnres.train: optimizer grouping, schedules, checkpoints, metrics.

The real model is tested elsewhere; here a tiny stand-in LM honours the same
contract (``config`` dataclass, ``param_kinds()``, ``model(ids) -> logits``).
"""

from __future__ import annotations

import copy
import csv
import dataclasses
import io
import json
import math
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from attnres.train import (
    CheckpointError,
    CombinedOptimizer,
    MetricsLogger,
    build_optimizer,
    cosine,
    latest_checkpoint,
    load_checkpoint,
    make_schedule,
    read_checkpoint_state,
    save_checkpoint,
    set_lr,
    wsd,
)
from attnres import checkpoint as ckpt_mod

REPO_ROOT = Path(__file__).resolve().parents[1]
TESTS_DIR = Path(__file__).resolve().parent


# --------------------------------------------------------------------------- stand-in model


@dataclasses.dataclass
class TinyConfig:
    vocab_size: int = 32
    d_model: int = 16
    n_layers: int = 2
    tie_embeddings: bool = False
    dims: tuple = (1, 2)  # a tuple: JSON turns it into a list; the config check must not care


class TinyBlock(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.RMSNorm(d)
        self.w_in = nn.Linear(d, 2 * d, bias=False)
        self.w_out = nn.Linear(2 * d, d, bias=False)
        self.pseudo_query = nn.Parameter(torch.zeros(d))
        self.gate = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return x + self.gate * self.w_out(torch.relu(self.w_in(self.norm(x) + self.pseudo_query)))


class TinyLM(nn.Module):
    def __init__(self, config: TinyConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(TinyBlock(config.d_model) for _ in range(config.n_layers))
        self.norm_f = nn.RMSNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.ones(1))

    def param_kinds(self) -> dict[str, str]:
        kinds = {}
        for name, p in self.named_parameters():
            if name.startswith("embed."):
                kinds[name] = "embedding"
            elif name.startswith("head."):
                kinds[name] = "head"
            elif p.ndim == 2:
                kinds[name] = "matrix"
            else:
                kinds[name] = "no_decay"
        return kinds

    def forward(self, ids):
        x = self.embed(ids) * self.scale
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm_f(x))


def make_model(seed: int = 0, **cfg) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(TinyConfig(**cfg))


def batch(step: int, vocab: int = 32, b: int = 4, t: int = 9) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, vocab, (b, t), generator=g)


def lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1))


def train(model, opt, start: int, n: int, sched=None, fixed_batch: bool = False) -> list[float]:
    losses = []
    for step in range(start, start + n):
        if sched is not None:
            set_lr(opt, sched(step))
        loss = lm_loss(model, batch(0 if fixed_batch else step))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def params_equal(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def muon_opt(model, **kw):
    return build_optimizer(model, "muon", lr=1e-2, weight_decay=0.1, **kw)


# --------------------------------------------------------------------------- optimizer


@pytest.mark.parametrize("name", ["adamw", "muon"])
@pytest.mark.parametrize("tied", [False, True])
def test_param_grouping(name, tied):
    model = make_model(tie_embeddings=tied)
    kinds = model.param_kinds()
    opt = build_optimizer(model, name, lr=3e-3, weight_decay=0.1)
    assert isinstance(opt, CombinedOptimizer)

    seen = [id(p) for g in opt.param_groups for p in g["params"]]
    assert len(seen) == len(set(seen)), "a parameter sits in two groups"
    assert set(seen) == {id(p) for p in model.parameters()}
    by_id = {id(p): n for n, p in model.named_parameters()}

    for g in opt.param_groups:
        assert "initial_lr" in g and g["initial_lr"] == g["lr"]
        group_kinds = {kinds[by_id[id(p)]] for p in g["params"]}
        if "no_decay" in group_kinds:
            assert group_kinds == {"no_decay"} and g["weight_decay"] == 0.0
        else:
            assert g["weight_decay"] == 0.1

    matrices = {id(p) for n, p in model.named_parameters() if kinds[n] == "matrix"}
    if name == "muon":
        assert isinstance(opt.optimizers["muon"], torch.optim.Muon)
        muon_ids = {id(p) for g in opt.optimizers["muon"].param_groups for p in g["params"]}
        assert muon_ids == matrices
        adamw_ids = {id(p) for g in opt.optimizers["adamw"].param_groups for p in g["params"]}
        assert adamw_ids.isdisjoint(matrices)
        assert opt.optimizers["muon"].param_groups[0]["adjust_lr_fn"] == "match_rms_adamw"
    else:
        assert list(opt.optimizers) == ["adamw"]
    if tied:
        assert not any(k == "head" for k in kinds.values())


def test_build_optimizer_errors():
    model = make_model()
    with pytest.raises(ValueError, match=r"'sgd'.*adamw.*muon"):
        build_optimizer(model, "sgd", lr=1e-3, weight_decay=0.0)
    with pytest.raises(ValueError, match="muon_adjust_lr_fn"):
        build_optimizer(model, "muon", lr=1e-3, weight_decay=0.0, muon_adjust_lr_fn="magic")

    class Missing(TinyLM):
        def param_kinds(self):
            k = super().param_kinds()
            del k["norm_f.weight"]
            return k

    class Invented(TinyLM):
        def param_kinds(self):
            return {**super().param_kinds(), "ghost.weight": "matrix"}

    class TiedAlias(TinyLM):
        def param_kinds(self):
            return {**super().param_kinds(), "head.weight": "head"}

    class BadKind(TinyLM):
        def param_kinds(self):
            return {**super().param_kinds(), "norm_f.weight": "bias"}

    class NotMatrix(TinyLM):
        def param_kinds(self):
            return {**super().param_kinds(), "norm_f.weight": "matrix"}

    with pytest.raises(ValueError, match=r"missing.*norm_f\.weight"):
        build_optimizer(Missing(TinyConfig()), "adamw", lr=1e-3, weight_decay=0.1)
    with pytest.raises(ValueError, match=r"ghost\.weight"):
        build_optimizer(Invented(TinyConfig()), "adamw", lr=1e-3, weight_decay=0.1)
    with pytest.raises(ValueError, match=r"head\.weight \(tied to embed\.weight"):
        build_optimizer(TiedAlias(TinyConfig(tie_embeddings=True)), "adamw", lr=1e-3, weight_decay=0.1)
    with pytest.raises(ValueError, match=r"unknown kinds.*'bias'"):
        build_optimizer(BadKind(TinyConfig()), "adamw", lr=1e-3, weight_decay=0.1)
    with pytest.raises(ValueError, match=r"norm_f\.weight is marked 'matrix'"):
        build_optimizer(NotMatrix(TinyConfig()), "muon", lr=1e-3, weight_decay=0.1)


def test_muon_adamw_step_changes_params_and_lowers_loss():
    model = make_model()
    opt = muon_opt(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    losses = train(model, opt, 0, 1, fixed_batch=True)
    for n, p in model.named_parameters():
        assert not torch.equal(p, before[n]), f"{n} did not change after one step"
    losses += train(model, opt, 1, 40, fixed_batch=True)
    assert losses[-1] < 0.7 * losses[0], losses
    # Muon kept its own state for the matrices only
    assert all(p.ndim == 2 for p in opt.optimizers["muon"].state)
    assert len(opt.state) == sum(1 for _ in model.parameters())


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_optimizer_state_dict_round_trip_is_bitwise(name):
    sched = make_schedule("wsd", total_steps=12, warmup_steps=3, decay_fraction=0.5)

    model = make_model()
    opt = build_optimizer(model, name, lr=5e-3, weight_decay=0.1)
    train(model, opt, 0, 4, sched)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    train(model, opt, 4, 5, sched)  # uninterrupted run

    saved = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    fresh = make_model(seed=123)  # different init, overwritten by the load
    fresh.load_state_dict(saved["model"])
    fresh_opt = build_optimizer(fresh, name, lr=5e-3, weight_decay=0.1)
    fresh_opt.load_state_dict(saved["opt"])
    train(fresh, fresh_opt, 4, 5, sched)

    assert params_equal(model, fresh)
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in fresh_opt.param_groups]


def test_optimizer_load_mismatch_is_clear():
    model = make_model()
    adamw_state = build_optimizer(model, "adamw", lr=1e-3, weight_decay=0.1).state_dict()
    with pytest.raises(ValueError, match=r"\['adamw'\].*\['adamw', 'muon'\]"):
        muon_opt(model).load_state_dict(adamw_state)
    other = make_model(n_layers=3)
    with pytest.raises(ValueError, match="parameter"):
        build_optimizer(other, "adamw", lr=1e-3, weight_decay=0.1).load_state_dict(adamw_state)


def test_set_lr_scales_every_group():
    model = make_model()
    opt = muon_opt(model, muon_lr=0.02)
    assert set_lr(opt, 0.5) == pytest.approx(0.01)
    assert sorted({g["lr"] for g in opt.param_groups}) == pytest.approx([0.005, 0.01])
    set_lr(opt, 1.0)
    assert all(g["lr"] == g["initial_lr"] for g in opt.param_groups)
    with pytest.raises(ValueError):
        set_lr(opt, float("nan"))


# --------------------------------------------------------------------------- schedules


def test_wsd_key_steps_and_monotonic():
    f = make_schedule("wsd", total_steps=100, warmup_steps=10, decay_fraction=0.2)
    assert f(0) == pytest.approx(0.1)
    assert f(9) == 1.0 and f(10) == 1.0  # end of warmup
    assert f(79) == 1.0 and f(80) == 1.0  # start of decay
    assert f(90) == pytest.approx(0.5)
    assert f(100) == 0.0 and f(150) == 0.0  # end of decay and beyond
    values = [f(s) for s in range(0, 120)]
    assert all(a <= b for a, b in zip(values[:10], values[1:11]))
    assert all(a >= b for a, b in zip(values[10:], values[11:]))

    g = make_schedule("wsd", total_steps=100, warmup_steps=0, decay_fraction=0.2, final_lr_frac=0.1, decay_shape="1-sqrt")
    assert g(0) == 1.0
    assert g(85) == pytest.approx(0.1 + 0.9 * 0.5)
    assert g(100) == pytest.approx(0.1)
    assert wsd(50, 100, 10, decay_fraction=0.0) == 1.0


def test_cosine_key_steps_and_monotonic():
    f = make_schedule("cosine", total_steps=100, warmup_steps=10, final_lr_frac=0.1)
    assert f(0) == pytest.approx(0.1)
    assert f(9) == 1.0 and f(10) == 1.0
    assert f(55) == pytest.approx(0.55)
    assert f(100) == pytest.approx(0.1) and f(200) == pytest.approx(0.1)
    values = [f(s) for s in range(10, 110)]
    assert all(a >= b for a, b in zip(values, values[1:]))
    assert cosine(5, 5, 5) == pytest.approx(0.1)
    assert make_schedule("constant", total_steps=10, warmup_steps=4)(7) == 1.0


def test_schedule_errors():
    with pytest.raises(ValueError, match=r"unknown schedule 'linear'.*wsd"):
        make_schedule("linear", total_steps=10, warmup_steps=0)
    with pytest.raises(ValueError, match=r"warmup_steps \(20\).*total_steps \(10\)"):
        make_schedule("cosine", total_steps=10, warmup_steps=20)
    with pytest.raises(ValueError, match="overlap"):
        make_schedule("wsd", total_steps=10, warmup_steps=9, decay_fraction=0.5)
    with pytest.raises(ValueError, match="decay_shape"):
        make_schedule("wsd", total_steps=10, warmup_steps=1, decay_shape="exp")
    with pytest.raises(ValueError, match="final_lr_frac"):
        make_schedule("cosine", total_steps=10, warmup_steps=1, final_lr_frac=2.0)
    with pytest.raises(ValueError, match=r"unknown options \['decay_fraction'\]"):
        make_schedule("cosine", total_steps=10, warmup_steps=1, decay_fraction=0.2)
    with pytest.raises(ValueError, match="step"):
        wsd(-1, 10, 1)


# --------------------------------------------------------------------------- checkpoints


def save(path, model, opt, step, **extra):
    return save_checkpoint(
        path,
        model=model,
        optimizer=opt,
        step=step,
        train_state={"tokens_seen": step * 100, "loader": {"epoch": 0, "pos": step}, **extra},
        model_config=dataclasses.asdict(model.config),
        train_config={"lr": 1e-2, "optimizer": "muon"},
    )


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
import os, sys
sys.path.insert(0, {tests!r})
from test_components import make_model, muon_opt, save, train
from attnres import checkpoint as ckpt_mod
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

    script = _CRASH_SCRIPT.format(tests=str(TESTS_DIR), mode=mode, target=str(target))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
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


# --------------------------------------------------------------------------- metrics


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_metrics_logger_files_and_resume(tmp_path):
    run = tmp_path / "run"
    with MetricsLogger(run, tensorboard=False) as log:
        for step in range(1, 6):
            log.log({"loss": torch.tensor(5.0 - step), "lr": np.float32(0.5)}, step=step)
            if step % 2 == 0:
                extra = {"acc": 0.5} if step == 4 else {}
                log.log({"val_loss": 4.0 - step / 10, **extra}, step=step, kind="eval")
        log.log({"loss": float("nan")}, step=6)

    rows = read_jsonl(run / "metrics.jsonl")
    assert [(r["kind"], r["step"]) for r in rows][:3] == [("train", 1), ("train", 2), ("eval", 2)]
    assert rows[0]["loss"] == 4.0 and rows[0]["lr"] == 0.5
    assert rows[-1]["loss"] == "nan" and math.isnan(float(rows[-1]["loss"]))

    train_csv = read_csv(run / "metrics_train.csv")
    assert [int(r["step"]) for r in train_csv] == [1, 2, 3, 4, 5, 6]
    assert float(train_csv[2]["loss"]) == 2.0
    eval_csv = read_csv(run / "metrics_eval.csv")
    assert list(eval_csv[0]) == ["step", "time", "val_loss", "acc"]  # header widened at step 4
    assert eval_csv[0]["acc"] == "" and eval_csv[1]["acc"] == "0.5"

    # a crash mid-line, then resume from a checkpoint at step 3
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "st')
    with MetricsLogger(run, resume_step=3, tensorboard=False) as log:
        assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1, 2, 2, 3]
        assert [int(r["step"]) for r in read_csv(run / "metrics_train.csv")] == [1, 2, 3]
        assert [int(r["step"]) for r in read_csv(run / "metrics_eval.csv")] == [2]
        for step in range(4, 6):
            log.log({"loss": 1.0, "grad_norm": 0.1}, step=step)

    train_csv = read_csv(run / "metrics_train.csv")
    assert [int(r["step"]) for r in train_csv] == [1, 2, 3, 4, 5]
    assert train_csv[0]["grad_norm"] == "" and train_csv[-1]["grad_norm"] == "0.1"
    steps = [(r["kind"], r["step"]) for r in read_jsonl(run / "metrics.jsonl")]
    assert len(steps) == len(set(steps))

    # reopening without resume appends and cuts a torn tail
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"kind": "tr')
    with MetricsLogger(run, tensorboard=False) as log:
        log.log({"loss": 0.5}, step=6)
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl") if r["kind"] == "train"] == [1, 2, 3, 4, 5, 6]
    assert [int(r["step"]) for r in read_csv(run / "metrics_train.csv")] == [1, 2, 3, 4, 5, 6]

    with MetricsLogger(run, tensorboard=False) as log:
        with pytest.raises(ValueError, match="reserved"):
            log.log({"step": 1}, step=1)
        with pytest.raises(ValueError, match="kind"):
            log.log({"x": 1}, step=1, kind="../evil")
