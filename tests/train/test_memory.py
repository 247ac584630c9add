"""The up-front memory estimate: a batch that clearly cannot fit is refused with what fits."""
import pytest
import torch

from attnres.train.config import build_configs
from attnres.train.memory import check_memory, estimate_step_memory


def test_a_batch_that_cannot_fit_is_refused_with_what_fits():
    model, train_cfg = build_configs("tiny", {"batch_size": 100_000_000})
    with pytest.raises(ValueError, match=r"batch_size=100000000 needs about [\d,.]+ GiB .* batch_size <= \d+ fits"):
        check_memory(model, train_cfg, torch.device("cpu"), available=8 << 30)
    fits = estimate_step_memory(model, 4, 32)
    check_memory(model, build_configs("tiny")[1], torch.device("cpu"), available=fits)  # the tiny preset fits
    with pytest.raises(ValueError, match="not even batch_size=1 fits"):
        check_memory(model, build_configs("tiny")[1], torch.device("cpu"), available=1000)


def test_the_estimate_grows_with_the_batch_and_skips_pipelines():
    model, train_cfg = build_configs("tiny")
    assert estimate_step_memory(model, 8, 32) > estimate_step_memory(model, 4, 32) > 0
    _, piped = build_configs("tiny", {"pp": 2})
    check_memory(model, piped, torch.device("cpu"), available=1)  # pipeline stages split the model: not checked
