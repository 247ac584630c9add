"""attnres doctor: the machine, and the table's choice for every op and phase, as text and as --json."""

import json

import pytest
import torch

from attnres.cli import main
from attnres.ops import backends
from attnres.ops.two_phase import cpu


def doctor_json(capsys, *flags: str) -> dict:
    assert main(["doctor", "--json", *flags]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_text_names_the_machine_and_every_op_and_phase(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    for word in (torch.__version__, "C++", "CPU kernel", "Triton", "CUDA", "env"):
        assert word in out, word
    rows = [line.split() for line in out.splitlines() if line.startswith("  ") and len(line.split()) > 4]
    for op in backends.OPS:
        for phase in backends.PHASES:
            assert any(r[:2] == [op, phase] for r in rows), (op, phase)
    want = backends.choose("phase1", "forward", backends.Case())
    assert ["phase1", "forward", "cpu", "float32", want.backend] in [r[:5] for r in rows]


def test_json_holds_the_machine_and_the_table_s_choices(capsys):
    found = doctor_json(capsys, "--width", "64", "--heads", "2", "--queries", "2", "--sources", "3")
    machine = found["machine"]
    assert machine["torch"] == torch.__version__
    assert machine["cuda"]["available"] == torch.cuda.is_available()
    assert set(machine["env"]) == set(backends.ENV_VARIABLES)
    assert machine["cpu_kernel"]["available"] == (cpu.kernel() is not None)
    assert set(found["backends"]) == set(backends.BACKENDS)
    assert found["shape"] == {"width": 64, "heads": 2, "queries": 2, "sources": 3}
    rows = found["choices"]
    assert {(r["op"], r["phase"]) for r in rows} == {(op, p) for op in backends.OPS for p in backends.PHASES}
    for r in rows:
        assert r["backend"] in backends.OPS[r["op"]].backends and r["reason"]
    cpu_rows = {(r["op"], r["phase"]): r for r in rows if r["device"] == "cpu" and not r["compiling"]}
    case = backends.Case(d=64, heads=2, queries=2, sources=3)
    for op in backends.OPS:
        want = backends.choose(op, "forward", case)
        assert (cpu_rows[op, "forward"]["backend"], cpu_rows[op, "forward"]["reason"]) == (want.backend, want.reason)
    # 6 source-query pairs on CUDA run the custom op, on the CPU the pointwise form
    cuda_sources = next(r for r in rows if r["op"] == "phase1_sources" and r["device"] == "cuda")
    assert cuda_sources["backend"] == "custom_op" and cpu_rows["phase1_sources", "forward"]["backend"] == "pointwise"
    cuda_merge = [
        r["backend"] for r in rows if r["op"] == "merge" and r["device"] == "cuda" and r["phase"] == "forward"
    ]
    assert cuda_merge[1] == "reference"  # with gradients


def test_the_environment_changes_the_rows(capsys, monkeypatch):
    monkeypatch.setenv("ATTNRES_CPU_KERNEL", "0")
    monkeypatch.setenv("ATTNRES_TRITON", "0")
    found = doctor_json(capsys)
    assert found["machine"]["env"]["ATTNRES_CPU_KERNEL"] == "0"
    assert found["backends"]["cpu_kernel"] == {"available": False, "reason": "off (ATTNRES_CPU_KERNEL=0)"}
    phase1 = [r for r in found["choices"] if r["op"] == "phase1" and r["phase"] == "forward"]
    assert {r["backend"] for r in phase1} == {"torch"}
    assert "ATTNRES_CPU_KERNEL=0" in phase1[0]["reason"] and "ATTNRES_TRITON=0" in phase1[-1]["reason"]


def test_a_kernel_that_must_build_and_cannot_is_reported_not_raised(capsys, monkeypatch):
    monkeypatch.setattr(cpu, "_STATE", {"lib": cpu._Loaded(None, "no C++ compiler ('c++' is not on PATH)")})
    monkeypatch.setenv("ATTNRES_CPU_KERNEL", "1")
    found = doctor_json(capsys)
    row = next(r for r in found["choices"] if r["op"] == "phase1" and r["device"] == "cpu")
    assert row["backend"] == "error" and "ATTNRES_CPU_KERNEL=1 but the CPU kernel is not available" in row["reason"]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--heads", "3", "--width", "8"], "--heads 3 does not divide --width 8"),
        (["--queries", "0"], "--queries 0: must be a positive whole number"),
    ],
)
def test_bad_shapes_are_one_line_errors(capsys, flags, message):
    assert main(["doctor", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"attnres doctor: error: {message}")
