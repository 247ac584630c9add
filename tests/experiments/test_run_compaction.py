"""What keeps the committed outputs under the repository's size cap (tests/test_repo_size.py).

scripts/downsample_runs.py's float compaction of the committed runs: every float keeps its float32
value, a compacted file compacts to itself, and a run directory is compacted once. The reports'
figures (attnres/experiments/figures.py): deterministic palette PNGs, close to matplotlib's RGBA ones."""

import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "downsample_runs.py"


@pytest.fixture(scope="module")
def thin():
    spec = importlib.util.spec_from_file_location("downsample_runs", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _random_floats(n: int, seed: int) -> list[float]:
    """Signed floats over float32's whole normal range, plus float32 numbers (what probes hold)."""
    rng = np.random.default_rng(seed)
    wide = rng.standard_normal(n) * 10.0 ** rng.uniform(-37, 38, n)
    unit = rng.uniform(-2, 2, n)
    exact32 = rng.standard_normal(n).astype(np.float32).astype(np.float64)
    return [float(x) for x in np.concatenate([wide, unit, exact32])]


def test_float32_value_keeps_the_float32_and_is_idempotent(thin):
    xs = _random_floats(20_000, seed=0)
    ys = [thin.float32_value(x) for x in xs]
    assert all(np.float32(y) == np.float32(x) for x, y in zip(xs, ys, strict=True))
    assert all(abs(y - x) <= 2.0**-23 * abs(x) for x, y in zip(xs, ys, strict=True))
    assert [thin.float32_value(y) for y in ys] == ys
    normal = [y for y in ys if abs(y) >= np.finfo(np.float32).tiny]  # subnormals are kept as they are
    assert len(normal) > 0.9 * len(ys)
    assert all(len(repr(y).lstrip("-").replace(".", "").split("e")[0].strip("0")) <= 9 for y in normal)
    assert thin.float32_value(0.761886715888977) == 0.7618867


def test_values_outside_float32_stay_as_they_are(thin):
    for x in (0.0, -0.0, math.inf, -math.inf, 1e-40, -3e-39, 1e39, -1e300):
        assert repr(thin.float32_value(x)) == repr(x)
    assert math.isnan(thin.float32_value(math.nan))


def test_compact_probes_rounds_nested_floats_only_and_is_idempotent(thin):
    xs = _random_floats(200, seed=1)
    probes = {"b": [[xs[0], None, 3], {"x": xs[1:50]}], "a": True, "n": 2**40 + 1, "s": "0.123456789", "f": xs}
    once = thin.compact_probes(json.dumps(probes, indent=2))
    assert thin.compact_probes(once) == once
    assert once.endswith("\n") and once.count("\n") == 1 and ": " not in once
    back = json.loads(once)
    assert back["a"] is True and back["n"] == 2**40 + 1 and back["s"] == "0.123456789"
    assert back["b"][0][1:] == [None, 3] and isinstance(back["b"][0][2], int)
    assert np.array_equal(np.float32(back["f"]), np.float32(xs))
    assert list(back) == sorted(back)


def test_compact_metrics_keeps_rows_and_key_order(thin):
    rows = [{"step": s, "kind": "train", "loss": 5.0 / (s + 1), "lr": 0.003 * s / 7} for s in range(5)]
    rows.append({"kind": "eval", "step": 4, "val_loss": 4.123456789012, "val_bpb": 1.98765432101})
    text = "".join(json.dumps(r) + "\n" for r in rows)
    once = thin.compact_metrics(text)
    assert thin.compact_metrics(once) == once
    back = [json.loads(line) for line in once.splitlines()]
    assert [list(r) for r in back] == [list(r) for r in rows]
    for r, b in zip(rows, back, strict=True):
        assert all(np.float32(b[k]) == np.float32(v) if isinstance(v, float) else b[k] == v for k, v in r.items())


def test_a_run_directory_is_compacted_once(thin, tmp_path):
    run = tmp_path / "exp" / "0123abcd"
    run.mkdir(parents=True)
    train = [{"step": s, "loss": 6.0 - s / 100, "step_seconds": 0.1 + (s % 7) / 97} for s in range(1, 61)]
    evals = [{"kind": "eval", "step": s, "val_loss": 5.9 - s / 113} for s in (20, 40, 60)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train + evals))
    (run / "probes.json").write_text(json.dumps({"entropy": [0.1 + i / 3 for i in range(8)]}, indent=2))
    hashed = {"lr": 0.003, "norm_eps": 1e-06, "init_std": 0.02}  # compared float for float: never rounded
    (run / "run.json").write_text(json.dumps({"config_hash": "0123abcd", "hashed_config": hashed}, indent=2))
    (run / "summary.json").write_text(json.dumps({"config_hash": "0123abcd", "val_loss": 5.123456789}, indent=2))
    changed = thin.plan(tmp_path, 8)
    assert sorted(p.name for p, _, _ in changed) == ["metrics.jsonl", "probes.json", "run.json", "summary.json"]
    for path, _, new in changed:
        path.write_text(new)
    assert thin.plan(tmp_path, 8) == []
    assert json.loads((run / "run.json").read_text())["hashed_config"] == hashed
    assert json.loads((run / "summary.json").read_text())["val_loss"] == 5.123456789
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["kind"] == "downsampled" and rows[0]["train_rows"] == 60
    assert rows[0]["step_seconds_median"] == thin.float32_value(float(np.median([r["step_seconds"] for r in train])))
    assert [r["val_loss"] for r in rows if r.get("kind") == "eval"] == [
        thin.float32_value(r["val_loss"]) for r in evals
    ]


# --------------------------------------------------------------------------- the reports' PNG figures


def _heatmaps(seed: int):
    """A figure as the reports draw them at their hardest for a palette: viridis heatmaps, colour bars,
    text and antialiased lines."""
    from attnres.analysis.plots import pyplot

    rng = np.random.default_rng(seed)
    fig, axes = pyplot().subplots(1, 3, figsize=(11, 3.6))
    for i, ax in enumerate(axes[:2]):
        im = ax.imshow(np.tril(rng.random((24, 24))) * (i + 1), cmap="viridis")
        fig.colorbar(im, ax=ax)
        ax.set_title(f"random lower triangle {i}")
    for k in range(6):
        axes[2].plot(np.cumsum(rng.standard_normal(200)), label=f"walk {k}")
    axes[2].legend(fontsize=7)
    fig.suptitle("palette test")
    return fig


def test_saved_figures_are_deterministic_palette_pngs_close_to_matplotlibs(tmp_path):
    from PIL import Image

    from attnres.experiments import figures

    paths = [figures._save(_heatmaps(seed=3), str(tmp_path / f"f{i}.png")) for i in range(2)]
    assert Path(paths[0]).read_bytes() == Path(paths[1]).read_bytes()
    reference = _heatmaps(seed=3)
    reference.tight_layout()
    reference.savefig(tmp_path / "rgba.png", dpi=figures.PNG_DPI)
    with Image.open(paths[0]) as saved, Image.open(tmp_path / "rgba.png") as rgba:
        assert (saved.format, saved.mode) == ("PNG", "P")
        assert saved.size == rgba.size
        diff = np.abs(np.asarray(saved.convert("RGB"), dtype=int) - np.asarray(rgba.convert("RGB"), dtype=int))
    assert diff.mean() < 2.5 and diff.max() <= 24, (diff.mean(), diff.max())  # measured: 1.5 and 15
    assert Path(paths[0]).stat().st_size < 0.6 * (tmp_path / "rgba.png").stat().st_size
