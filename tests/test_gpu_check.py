"""scripts/gpu_check.sh --dry-run: every step of the GPU check on the CPU at a tiny config, end to end, and a
second run resumes (skips what is done). On a CUDA machine the same script runs at a GPU-sized config. The
dry run's tests step only collects the kernel tests (the suite runs them in Triton's interpreter)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.sh"


def test_dry_run_runs_every_step_and_resumes(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable}
    run = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run", "--out", str(tmp_path)], env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for name in ("env.json", "tests.xml", "op.json", "train.json", "decode.json"):
        assert (tmp_path / name).stat().st_size > 0, name
    assert json.loads((tmp_path / "env.json").read_text())["device"] == "cpu"
    assert "tests collected" in run.stdout, run.stdout[-3000:]  # every kernel test file found and imported
    rows = json.loads((tmp_path / "train.json").read_text())["rows"]
    assert {"prenorm", "block", "full"} <= set(rows)
    again = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run", "--out", str(tmp_path)], env=env, capture_output=True, text=True, timeout=120
    )
    assert again.returncode == 0 and again.stdout.count("done before") == 5, again.stdout


def test_refuses_unknown_arguments():
    run = subprocess.run(["bash", str(SCRIPT), "--frobnicate"], capture_output=True, text=True, timeout=30)
    assert run.returncode == 2 and "unknown argument '--frobnicate'" in run.stderr


def test_help_prints_the_whole_comment_block():
    run = subprocess.run(["bash", str(SCRIPT), "--help"], capture_output=True, text=True, timeout=30)
    header = SCRIPT.read_text().splitlines()[1:]
    block = header[: next(i for i, line in enumerate(header) if not line.startswith("#"))]
    assert run.returncode == 0 and run.stdout.splitlines() == block
    assert "the files of the steps before it stay" in run.stdout
