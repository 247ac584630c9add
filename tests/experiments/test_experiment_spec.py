"""Spec files: parsing, expansion into runs (grid x axes x seeds), config hashing, clear errors."""

import re
from pathlib import Path

import pytest

from attnres.experiments import (
    ExperimentError,
    available,
    config_hash,
    expand,
    find_spec,
    load_spec,
    parse_spec,
)
from attnres.experiments.runner import format_plan, plan_status
from attnres.experiments.spec import with_overrides
from attnres.train.config import build_configs

REPO_SPECS = Path(__file__).resolve().parents[2] / "experiments"


def test_grid_times_axes_times_seeds(tmp_path, write_spec, tiny_base):
    path = write_spec(
        tmp_path,
        "demo-grid",
        f"""
        [experiment]
        name = "demo-grid"
        seeds = [0, 1]

        {tiny_base(d_model=32)}
        [grid]
        lr = [1e-3, 3e-3]

        [[axis.scheme]]
        label = "prenorm"
        residual = "prenorm"
        seeds = [0, 1, 2]

        [[axis.scheme]]
        label = "full"
        residual = "full"
        tags = {{ family = "attnres" }}
        speed = 0.5
    """,
    )
    spec = parse_spec(path)
    assert spec.report == "generic" and [a for a, _ in spec.axes] == ["lr", "scheme"]
    runs = expand(spec)
    assert len(runs) == 2 * (3 + 2)
    names = [r.name for r in runs]
    assert names[:3] == [
        "lr=0.001/scheme=prenorm/seed=0",
        "lr=0.001/scheme=prenorm/seed=1",
        "lr=0.001/scheme=prenorm/seed=2",
    ]
    full = [r for r in runs if r.labels["scheme"] == "full"]
    assert all(r.labels["family"] == "attnres" and r.model.residual == "full" for r in full)
    assert {r.train.lr for r in runs} == {1e-3, 3e-3}
    assert all(r.train.steps == 4 and r.model.d_model == 32 and r.train.tokenizer == "byte" for r in runs)
    assert [r.seed for r in runs if r.labels["lr"] == "0.003" and r.labels["scheme"] == "full"] == [0, 1]
    assert full[0].tokens_per_second == pytest.approx(0.5 * 6000)
    assert len({r.hash for r in runs}) == len(runs)


def test_later_points_override_earlier_ones_and_base(tmp_path, write_spec, tiny_base):
    path = write_spec(
        tmp_path,
        "order",
        f"""
        [experiment]
        name = "order"
        {tiny_base(lr=0.01)}
        [[axis.a]]
        label = "x"
        lr = 0.02
        [[axis.b]]
        label = "y"
        lr = 0.03
        seeds = [5]
    """,
    )
    (run,) = expand(parse_spec(path))
    assert run.train.lr == 0.03 and run.seed == 5 and run.train.seed == 5


def test_by_overrides_apply_only_with_the_matching_point_of_another_axis(tmp_path, write_spec, tiny_base):
    path = write_spec(
        tmp_path,
        "bytest",
        f"""
        [experiment]
        name = "bytest"
        {tiny_base(steps=10)}
        [[axis.scheme]]
        label = "prenorm"
        residual = "prenorm"
        [[axis.scheme]]
        label = "mhc"
        residual = "mhc"
        [[axis.budget]]
        label = "tokens"
        [[axis.budget]]
        label = "time"
        [axis.budget.by.scheme]
        mhc = {{ steps = 5, warmup_steps = 1 }}
    """,
    )
    steps = {r.name: r.train.steps for r in expand(parse_spec(path))}
    assert steps == {
        "scheme=prenorm/budget=tokens/seed=0": 10,
        "scheme=prenorm/budget=time/seed=0": 10,
        "scheme=mhc/budget=tokens/seed=0": 10,
        "scheme=mhc/budget=time/seed=0": 5,
    }
    runs = expand(parse_spec(path))
    assert runs[0].hash == runs[1].hash  # identical configs: one run serves both labels
    bad = write_spec(
        tmp_path,
        "bybad",
        """
        [experiment]
        name = "bybad"
        [[axis.scheme]]
        label = "prenorm"
        [[axis.budget]]
        label = "time"
        [axis.budget.by.scheme]
        hyper = { steps = 5 }
    """,
    )
    with pytest.raises(ExperimentError, match=r"by.scheme: labels \['hyper'\] are not points of axis 'scheme'"):
        parse_spec(bad)


def _configs(**overrides):
    return build_configs("tiny", {"tokenizer": "byte", **overrides})


def test_hash_is_stable_and_ignores_only_fields_that_do_not_change_results():
    h = config_hash(*_configs())
    assert h == config_hash(*_configs()) and re.fullmatch(r"[0-9a-f]{12}", h)
    for same in (
        {"out_dir": "elsewhere"},
        {"progress": False},
        {"threads": 1},
        {"cache_dir": "/tmp/x"},
        {"checkpoint_every": 7},
        {"lr": 3e-3},
    ):
        assert config_hash(*_configs(**same)) == h, same
    assert config_hash(*_configs(weight_decay=1)) == config_hash(*_configs(weight_decay=1.0))
    for different in (
        {"lr": 1e-3},
        {"seed": 1},
        {"steps": 31},
        {"residual": "full"},
        {"d_model": 64},
        {"attnres_kernel": "sigmoid", "residual": "full"},
        {"eval_every": 5},
        {"batch_size": 8},
        {"data": "corpus.txt"},
        {"optimizer": "adamw"},
        {"precision": "bf16"},
    ):
        assert config_hash(*_configs(**different)) != h, different


def test_hash_survives_a_fresh_expansion(tmp_path, write_spec, tiny_base):
    body = f"""
        [experiment]
        name = "again"
        seeds = [3]
        {tiny_base()}
    """
    a = expand(parse_spec(write_spec(tmp_path / "a", "again", body)))
    b = expand(parse_spec(write_spec(tmp_path / "b", "again", body)))
    assert a[0].hash == b[0].hash


def test_unknown_experiment_lists_the_available_ones(tmp_path, write_spec, tiny_base):
    for name in ("alpha", "beta"):
        write_spec(tmp_path, name, f'[experiment]\nname = "{name}"\n')
    with pytest.raises(ExperimentError, match=r"unknown experiment 'gamma'.*alpha, beta"):
        find_spec("gamma", tmp_path)
    assert available(tmp_path) == ["alpha", "beta"]


@pytest.mark.parametrize(
    "body, where",
    [
        ('[experiment]\nname = "bad"\n[base]\nd_modle = 3\n', r"\[base\] d_modle: unknown option"),
        ('[experiment]\nname = "bad"\nseeds = [1, -1]\n', r"\[experiment\] seeds: must be a non-empty list"),
        ('[experiment]\nname = "other"\n', r"\[experiment\] name: 'other' must equal the file name 'bad'"),
        ('[experiment]\nname = "bad"\n[[axis.s]]\nresidual = "full"\n', r"\[\[axis.s\]\] #1 label: required"),
        ('[experiment]\nname = "bad"\n[[axis.s]]\nlabel = "a"\n[[axis.s]]\nlabel = "a"\n', r"repeated labels"),
        ('[experiment]\nname = "bad"\nbudget = 3\n', r"\[experiment\] budget: unknown key"),
        ('[experiment]\nname = "bad"\n[base]\nout_dir = "x"\n', r"\[base\] out_dir: is set by the runner"),
        ('[experiment]\nname = "bad"\nreport = "scaling"\n', r"the 'scaling' report needs an axis named 'size'"),
        ('[experiment]\nname = "bad"\n[oops]\n', r"oops: unknown top-level key"),
        ('[experiment\nname = "bad"\n', r"not valid TOML"),
        ("[base]\nsteps = 3\n", r"\[experiment\]: missing"),
        ('[experiment]\nname = "bad"\n[[axis.s]]\nlabel = "a"\npaper_loss = "low"\n', r"paper_loss: must be a"),
    ],
)
def test_malformed_specs_name_the_file_and_the_field(tmp_path, write_spec, body, where):
    path = write_spec(tmp_path, "bad", body)
    with pytest.raises(ExperimentError) as info:
        load_spec("bad", tmp_path)
    assert str(path) in str(info.value)
    assert re.search(where, str(info.value)), str(info.value)


def test_invalid_config_values_name_the_run_and_the_field(tmp_path, write_spec, tiny_base):
    write_spec(
        tmp_path,
        "bad",
        f"""
        [experiment]
        name = "bad"
        {tiny_base()}
        [[axis.scheme]]
        label = "win"
        residual = "block"
        attnres_window = 4
    """,
    )
    with pytest.raises(ExperimentError, match=r"bad.toml: run scheme=win/seed=0: .*attnres_window"):
        expand(load_spec("bad", tmp_path))


def test_dry_run_lists_states_and_estimates(tmp_path, write_spec, tiny_base):
    write_spec(
        tmp_path,
        "plan",
        f"""
        [experiment]
        name = "plan"
        seeds = [0, 1]
        tokens_per_second = 128
        budget_cpu_hours = 0.5
        {tiny_base(steps=10)}
    """,
    )
    spec = load_spec("plan", tmp_path)
    text = format_plan(spec, plan_status(spec, tmp_path / "runs"))
    assert "run=base/seed=0" in text and "missing" in text and "stated budget 0.5 h" in text
    # 10 steps x 4 x 32 tokens at 128 tokens/s = 10 s, plus 5 evaluations of one batch at a third
    assert expand(spec)[0].estimated_seconds() == pytest.approx(10 + 5 * 128 / 3 / 128)


# ----------------------------------------------------------------------------- the shipped specs

# in suite order: a later experiment's rows that an earlier one already ran are copied, not trained
SHIPPED = ("scaling", "ablations", "block-size", "dynamics", "arena", "arch-sweep")


def test_the_shipped_specs_parse_expand_and_fit_the_suite_budget():
    assert set(SHIPPED) <= set(available(REPO_SPECS))
    seen, total_budget = set(), 0.0
    for name in SHIPPED:
        spec = load_spec(name, REPO_SPECS)
        runs = expand(spec)
        assert spec.budget_cpu_hours and spec.budget_note and spec.description
        new = {r.hash: r for r in runs if r.hash not in seen}
        seen |= set(new)
        estimate = sum(r.estimated_seconds() for r in new.values()) / 3600
        total_budget += spec.budget_cpu_hours
        # the stated budget is the dry-run estimate of the runs this experiment adds, rounded
        assert 0.8 * spec.budget_cpu_hours <= estimate <= 1.1 * spec.budget_cpu_hours, (name, estimate)
        groups = {}
        for r in runs:
            groups.setdefault(tuple(sorted((k, v) for k, v in r.labels.items())), set()).add(r.seed)
        assert min(len(s) for s in groups.values()) >= (1 if name == "dynamics" else 2), name
        for label in spec.headline:
            assert all(len(s) >= 3 for g, s in groups.items() if label in dict(g).values()), (name, label)
    # "about 6 CPU-hours" plus at most 3 for the rows beyond the paper, plus the 5-seed whole-split runs
    # of the headline rows (scaling's 60 runs alone measured 5.6 CPU-hours at one thread); the arena's share
    # is at one-thread throughput, the threads its equal-time calibration has to match
    assert 5.0 <= total_budget <= 15.0, total_budget


def test_issue_18_rows_of_the_shipped_specs():
    """The variants beyond the paper are planned where they belong: ablations (state sources, low-rank queries,
    gated), block-size (learned uneven blocks beside equal ones with the same N), dynamics (the routing
    rows, shared with the ablations) and the arena (gated at equal tokens and equal time)."""

    def models(name):
        return {
            (r.labels.get("variant") or r.labels.get("scheme"), r.labels.get("budget"), r.seed): r.model
            for r in expand(load_spec(name, REPO_SPECS))
        }

    ablations = models("ablations")
    assert ablations[("full-states", None, 2)].attnres_sources == "states"
    assert ablations[("block-states", None, 1)].attnres_sources == "states"
    assert ablations[("block-states", None, 1)].block_size == 4
    for r in (4, 16):
        m = ablations[(f"full-low-rank-r{r}", None, 1)]
        assert (m.residual, m.attnres_weights, m.attnres_query_rank) == ("full", "low_rank_query", r)
    assert ablations[("gated", None, 2)].residual == "gated"
    sizes = models("block-size")
    for n, equal in ((4, "S8"), (8, "S4")):
        assert sizes[(equal, None, 0)].num_blocks == n
        for objective in ("mass", "fit"):
            learned = sizes[(f"learned-{objective}-N{n}", None, 1)]
            assert learned.num_blocks == n and sum(learned.attnres_block_sizes) == 32
            assert learned.attnres_block_sizes != [32 // n] * n
    dynamics = {
        r.hash for r in expand(load_spec("dynamics", REPO_SPECS)) if r.labels["scheme"] in ("full-states", "gated")
    }
    assert len(dynamics) == 6 and dynamics <= {
        r.hash for r in expand(load_spec("ablations", REPO_SPECS))
    }  # 3 seeds each
    arena = models("arena")
    assert arena[("gated", "equal-time", 1)].residual == "gated"
    train = {
        r.labels["budget"]: r.train.steps
        for r in expand(load_spec("arena", REPO_SPECS))
        if r.labels["scheme"] == "gated"
    }
    assert train["equal-time"] < train["equal-tokens"]


def test_shared_rows_of_the_shipped_specs_have_identical_hashes():
    """ablations, block-size and dynamics share their deep-narrow base: their common rows run once."""
    hashes = {
        name: {r.hash for r in expand(load_spec(name, REPO_SPECS))} for name in ("ablations", "block-size", "dynamics")
    }
    assert len(hashes["ablations"] & hashes["block-size"]) >= 6
    assert len(hashes["ablations"] & hashes["dynamics"]) >= 6


def test_the_demo_spec_plans_exactly_what_attnres_demo_trained():
    """Before it became a spec, `attnres demo` trained build_configs("demo", {"residual": scheme}) per
    scheme at the default seed: the spec's runs must be those configs, so they compute the same losses."""
    runs = expand(load_spec("demo", REPO_SPECS))
    assert [r.labels["scheme"] for r in runs] == ["prenorm", "block", "full"]
    for run in runs:
        model, train = build_configs("demo", {"residual": run.labels["scheme"]})
        assert run.model == model and run.seed == train.seed == 1337
        assert {k: v for k, v in run.train.to_dict().items() if k != "out_dir"} == {
            k: v for k, v in train.to_dict().items() if k != "out_dir"
        }


def test_overrides_enter_every_run_and_its_hash(tmp_path, write_spec, tiny_base):
    write_spec(
        tmp_path,
        "over",
        f"""
        [experiment]
        name = "over"
        {tiny_base()}
        [[axis.scheme]]
        label = "prenorm"
        residual = "prenorm"
        [[axis.scheme]]
        label = "full"
        residual = "full"
    """,
    )
    spec = load_spec("over", tmp_path)
    changed = with_overrides(spec, {"steps": 7, "d_model": 16, "seed": 5})
    before, after = expand(spec), expand(changed)
    assert [r.labels for r in after] == [r.labels for r in before]
    assert all(r.train.steps == 7 and r.model.d_model == 16 and r.seed == 5 for r in after)
    assert not {r.hash for r in before} & {r.hash for r in after}
    assert [r.hash for r in expand(with_overrides(spec, {}))] == [r.hash for r in before]
    assert spec.base.get("steps") == 4  # the spec itself is untouched
    with pytest.raises(ExperimentError, match="overrides depth: unknown option"):
        with_overrides(spec, {"depth": 3})
    with pytest.raises(ExperimentError, match="overrides out_dir: is set by the runner"):
        with_overrides(spec, {"out_dir": "x"})


def test_specs_parse_without_tomllib_through_tomli(tmp_path, write_spec, tiny_base, monkeypatch):
    """Python 3.10 has no tomllib; the tomli package (a dependency there) parses instead."""
    import sys
    import types

    try:
        import tomllib as parser
    except ModuleNotFoundError:  # running on 3.10 itself
        import tomli as parser
    calls = []
    tomli = types.ModuleType("tomli")  # a stand-in that counts its calls
    tomli.loads = lambda text: calls.append(text) or parser.loads(text)
    tomli.TOMLDecodeError = parser.TOMLDecodeError
    monkeypatch.setattr(sys, "version_info", (3, 10, 14, "final", 0))  # what attnres.files asks
    monkeypatch.setitem(sys.modules, "tomllib", None)  # `import tomllib` raises ModuleNotFoundError
    monkeypatch.setitem(sys.modules, "tomli", tomli)
    path = write_spec(
        tmp_path,
        "old",
        f"""
        [experiment]
        name = "old"
        seeds = [3]
        {tiny_base()}
    """,
    )
    spec = parse_spec(path)
    assert spec.seeds == [3] and spec.base["preset"] == "tiny" and len(calls) == 1
    (tmp_path / "bad.toml").write_text("[experiment\n")
    with pytest.raises(ExperimentError, match="not valid TOML"):
        parse_spec(tmp_path / "bad.toml")


KIMI_DEMO_VARIANT = "backbone=kimi_linear:moe_experts=8:moe_top_k=2"  # the kimi-demo preset, as a bench variant


@pytest.mark.parametrize(
    "name, calibration, baseline",
    [
        ("equal-time", "equal_time_llama_calibration.json", "prenorm"),
        ("equal-time-kimi", "equal_time_kimi_calibration.json", "prenorm:" + KIMI_DEMO_VARIANT),
    ],
)
def test_equal_time_steps_follow_their_calibration(name, calibration, baseline):
    """Each AttnRes arm trains prenorm's steps over its step-time ratio (the median over the calibration's
    processes of each process's ratio of step medians), warm-up 10 % of them, rounded half up: the spec says what was
    measured, and a new calibration cannot leave stale step counts behind."""
    import json
    import statistics

    bench = json.loads((REPO_SPECS.parent / "reports" / "bench" / calibration).read_text())
    runs = {r.labels["scheme"]: r for r in expand(load_spec(name, REPO_SPECS)) if r.seed == 0}
    steps = runs["prenorm"].train.steps
    for scheme in ("block", "full"):
        variant = baseline.replace("prenorm", scheme, 1)
        ratio = statistics.median(
            p["rows"][variant]["step_ms_median"] / p["rows"][baseline]["step_ms_median"] for p in bench["runs"]
        )
        assert runs[scheme].train.steps == round(steps / ratio), (name, scheme, ratio)
        assert runs[scheme].train.warmup_steps == int(runs[scheme].train.steps / 10 + 0.5), (name, scheme)
