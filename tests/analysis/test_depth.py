"""attnres.analysis.depth: the routing-sharpness probe and state-source names in the depth matrix."""

import math

import pytest

from attnres.analysis.depth import depth_weight_matrix, routing_sharpness

# ----------------------------------------------------------------------------- routing sharpness

PROBED = [
    ("full", {}),
    ("block", {}),
    ("full", {"attnres_sources": "states"}),
    ("gated", {"gated_heads": 4}),
    ("block", {"attnres_kernel": "sigmoid", "attnres_heads": 2}),
]


@pytest.mark.parametrize("residual,overrides", PROBED)
def test_routing_sharpness_from_the_record(residual, overrides, record_of):
    record = record_of(residual, **overrides)
    probe = routing_sharpness(record)
    assert len(probe["max_weight"]) == len(probe["entropy"]) == 7  # L sublayers + the final aggregation
    for i, w in enumerate(record.weights):
        # by hand: token by token (and head by head), then the mean
        flat = w.double().reshape(w.shape[0], -1)
        maxes, entropies = [], []
        for column in flat.t():
            p = column / column.sum()
            maxes.append(column.max().item())
            entropies.append(-sum(x * math.log(x) for x in p.tolist() if x > 0))
        assert probe["n_sources"][i] == w.shape[0]
        assert probe["max_weight"][i] == pytest.approx(sum(maxes) / len(maxes), rel=1e-12)
        assert probe["entropy"][i] == pytest.approx(sum(entropies) / len(entropies), rel=1e-12, abs=1e-15)
        assert 0 <= probe["entropy"][i] <= math.log(w.shape[0]) + 1e-12
    assert probe["entropy"][0] == 0.0  # one source
    if overrides.get("attnres_kernel") != "sigmoid":
        assert probe["max_weight"][0] == 1.0


def test_uniform_weights_give_one_over_k_and_log_k(record_of):
    probe = routing_sharpness(record_of("full", randomized=False))
    for i, k in enumerate(probe["n_sources"]):
        assert k == i + 1
        assert probe["max_weight"][i] == pytest.approx(1 / k, rel=1e-6)
        assert probe["entropy"][i] == pytest.approx(math.log(k), rel=1e-6, abs=1e-7)


def test_no_depth_weights_no_probe(record_of):
    assert routing_sharpness(record_of("prenorm", randomized=False)) is None
    assert routing_sharpness(record_of("mhc")) is None


def test_states_sources_are_named_and_placed_in_the_matrix(record_of):
    record = record_of("full", attnres_sources="states")
    assert record.sources[3] == ["emb", "s1", "s2", "s3"]
    assert depth_weight_matrix(record).shape == (7, 7)
    block = record_of("block", attnres_sources="states", attnres_block_size=2)
    assert block.sources[3] == ["emb", "sb1", "sb2~"] and block.sources[-1] == ["emb", "sb1", "sb2", "sb3"]
