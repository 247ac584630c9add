"""attnres.train.schedule: WSD and cosine learning-rate schedules."""

from __future__ import annotations

from itertools import pairwise

import pytest

from attnres.train import cosine, make_schedule, wsd


def test_wsd_key_steps_and_monotonic():
    f = make_schedule("wsd", total_steps=100, warmup_steps=10, decay_fraction=0.2)
    assert f(0) == pytest.approx(0.1)
    assert f(9) == 1.0 and f(10) == 1.0  # end of warmup
    assert f(79) == 1.0 and f(80) == 1.0  # start of decay
    assert f(90) == pytest.approx(0.5)
    assert f(100) == 0.0 and f(150) == 0.0  # end of decay and beyond
    values = [f(s) for s in range(120)]
    assert all(a <= b for a, b in pairwise(values[:11]))
    assert all(a >= b for a, b in pairwise(values[10:]))

    g = make_schedule(
        "wsd", total_steps=100, warmup_steps=0, decay_fraction=0.2, final_lr_frac=0.1, decay_shape="1-sqrt"
    )
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
    assert all(a >= b for a, b in pairwise(values))
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
