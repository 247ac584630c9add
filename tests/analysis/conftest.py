"""Depth records of the tiny model (L = 6 sublayers) for the analysis tests."""

import pytest
from reference import randomize


@pytest.fixture
def record_of(make, tokens):
    """record_of(residual, randomized=True, **overrides) -> the DepthRecord of one forward pass of the
    tiny float64 model, its depth parameters moved off their initialisation unless randomized=False."""

    def record(residual, randomized=True, **overrides):
        model = make(residual, **overrides)
        if randomized:
            randomize(model.residual, scale=0.5 if residual != "gated" else 0.3)
        return model(tokens(seed=1, t=5), return_record=True).record

    return record
