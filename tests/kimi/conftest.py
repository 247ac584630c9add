"""The Kimi Linear tests need transformers' Kimi Linear modules (pip install attnres[hf]); offline."""

try:
    from transformers import KimiLinearConfig  # noqa: F401
    from transformers.utils import logging as hf_logging
except ImportError:  # the optional extra is not installed: nothing here to run
    collect_ignore_glob = ["test_*.py"]
else:
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """transformers' reference KDA kernel is a loop of small operations: on one thread it runs several
    times faster than on two, and far more so on a busy machine (two spinning OpenMP threads on two
    shared cores stall). The previous setting is restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
