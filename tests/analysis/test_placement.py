"""attnres.analysis.placement (and ``attnres placement``): learned depth-block sizes, exact by DP."""

import itertools
import json

import numpy as np
import pytest

from attnres.analysis.depth import depth_weight_matrix
from attnres.analysis.placement import (
    best_block_sizes,
    block_fit_error,
    block_mass,
    learned_block_sizes,
    runs_depth_weights,
)
from attnres.cli import main

# ----------------------------------------------------------------------------- placement


def random_matrix(L, seed):
    """A Full AttnRes-shaped weight matrix: row l is a distribution over sources 0 … l, NaN above."""
    rng = np.random.default_rng(seed)
    a = np.full((L + 1, L + 1), np.nan)
    for row in range(L + 1):
        w = rng.gamma(0.5, size=row + 1)
        a[row, : row + 1] = w / w.sum()
    return a


def all_placements(L, n, lo=1, hi=None):
    for cuts in itertools.combinations(range(1, L), n - 1):
        sizes = [b - a for a, b in zip((0,) + cuts, cuts + (L,), strict=True)]
        if min(sizes) >= lo and (hi is None or max(sizes) <= hi):
            yield sizes


@pytest.mark.parametrize("objective", ["mass", "fit"])
@pytest.mark.parametrize("L,seed", [(5, 0), (7, 1), (8, 2)])
def test_dynamic_programming_equals_brute_force(objective, L, seed):
    a = random_matrix(L, seed)
    score = block_mass if objective == "mass" else (lambda m, s: -block_fit_error(m, s))
    bounds = [(1, None), (2, None), (1, 3)]
    for n in range(1, L + 1):
        for lo, hi in bounds:
            candidates = list(all_placements(L, n, lo, hi))
            if not candidates:
                with pytest.raises(ValueError, match="no .* blocks with sizes"):
                    best_block_sizes(a, n, objective=objective, min_size=lo, max_size=hi)
                continue
            want = max(candidates, key=lambda s: score(a, s))
            got = best_block_sizes(a, n, objective=objective, min_size=lo, max_size=hi)
            assert sum(got) == L and len(got) == n and all(lo <= s <= (hi or L) for s in got)
            assert score(a, got) == pytest.approx(score(a, want), rel=1e-12, abs=1e-15), (n, lo, hi)
            assert got == want  # continuous random weights: the optimum is unique


def test_objectives_by_hand():
    # L = 3; sublayer 2 puts 0.5 on v1, sublayer 3 puts 0.3 on v1 and 0.4 on v2
    a = np.full((4, 4), np.nan)
    a[0, :1] = [1.0]
    a[1, :2] = [0.5, 0.5]
    a[2, :3] = [0.3, 0.3, 0.4]
    a[3, :4] = [0.1, 0.2, 0.3, 0.4]
    assert block_mass(a, [3]) == pytest.approx(0.5 + 0.3 + 0.4)
    assert block_mass(a, [2, 1]) == pytest.approx(0.5)
    assert block_mass(a, [1, 2]) == pytest.approx(0.4)
    assert block_mass(a, [1, 1, 1]) == 0
    # one sublayer per block is Full AttnRes: every weight is expressible
    assert block_fit_error(a, [1, 1, 1]) == 0
    # [2, 1]: sublayer 3 reads block {v1, v2} with weights 0.3, 0.4 (mean 0.35), the final reads {v1, v2}
    # with 0.2, 0.3 (mean 0.25)
    assert block_fit_error(a, [2, 1]) == pytest.approx(2 * 0.05**2 + 2 * 0.05**2)
    assert best_block_sizes(a, 2) == [2, 1] and best_block_sizes(a, 2, objective="fit") in ([2, 1], [1, 2])


def test_fit_error_is_zero_when_the_weights_are_constant_on_the_blocks(record_of):
    L, sizes = 6, [2, 3, 1]
    a = np.full((L + 1, L + 1), np.nan)
    starts = [1, 3, 6]
    for row in range(L + 1):
        a[row, 0] = 0.1
        for start, size in zip(starts, sizes, strict=True):  # constant over each block's sources this consumer reads
            a[row, start : min(start + size, row + 1)] = 0.05 * start
    assert block_fit_error(a, sizes) == pytest.approx(0, abs=1e-15)
    assert best_block_sizes(a, 3, objective="fit") == sizes


def write_run(record_of, config, tmp_path, residual="full", **overrides):
    from attnres.experiments.probes import _nan_to_none

    record = record_of(residual, **overrides)
    run = tmp_path / residual
    run.mkdir()
    cfg = config(residual, **overrides)
    (run / "config.json").write_text(json.dumps({"model": cfg.to_dict(), "train": {}}))
    (run / "probes.json").write_text(json.dumps({"depth_weights": _nan_to_none(depth_weight_matrix(record))}))
    return run, depth_weight_matrix(record)


def test_learned_block_sizes_from_a_run_directory(tmp_path, capsys, record_of, config):
    run, matrix = write_run(record_of, config, tmp_path)
    for objective in ("mass", "fit"):
        sizes = learned_block_sizes(run, 3, objective=objective)
        assert sizes == best_block_sizes(matrix, 3, objective=objective)
        cfg = config("block", attnres_block_sizes=sizes)  # usable as it is
        assert cfg.num_blocks == 3
    assert main(["placement", str(run), "--blocks", "3", "--max-size", "3"]) == 0
    line = capsys.readouterr().out.splitlines()[0]
    assert line == f"attnres_block_sizes = {best_block_sizes(matrix, 3, max_size=3)}"


def test_placement_from_several_runs_uses_their_mean_weights(tmp_path, capsys, record_of, config):
    one, a = write_run(record_of, config, tmp_path)
    (tmp_path / "seed2").mkdir()
    two, b = write_run(record_of, config, tmp_path / "seed2", attnres_kernel="sigmoid")  # other weights, same depth
    mean = runs_depth_weights([one, two])
    np.testing.assert_array_equal(np.isnan(mean), np.isnan(a))
    np.testing.assert_allclose(mean[~np.isnan(a)], ((a + b) / 2)[~np.isnan(a)], rtol=1e-15)
    assert learned_block_sizes([one, two], 3, objective="fit") == best_block_sizes(mean, 3, objective="fit")
    assert main(["placement", str(one), str(two), "--blocks", "2", "--objective", "fit"]) == 0
    assert (
        capsys.readouterr().out.splitlines()[0] == f"attnres_block_sizes = {best_block_sizes(mean, 2, objective='fit')}"
    )


def test_placement_needs_a_full_outputs_run(tmp_path, capsys, record_of, config):
    run, _ = write_run(record_of, config, tmp_path, "block")
    with pytest.raises(ValueError, match="needs a Full AttnRes run over sublayer outputs"):
        learned_block_sizes(run, 3)
    assert main(["placement", str(run), "--blocks", "3"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("attnres placement: error: ") and "residual='block'" in err[0]
    with pytest.raises(ValueError, match="not a finished experiment run"):
        learned_block_sizes(tmp_path / "missing", 3)
    with pytest.raises(ValueError, match="n_blocks=7 is invalid"):
        best_block_sizes(random_matrix(6, 0), 7)
    with pytest.raises(ValueError, match="objective='best' is invalid"):
        best_block_sizes(random_matrix(6, 0), 2, objective="best")
