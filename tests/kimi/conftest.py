"""The Kimi Linear tests need transformers' Kimi Linear modules (pip install attnres[hf]); offline."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

try:
    from transformers import KimiLinearConfig  # noqa: F401
    from transformers.utils import logging as hf_logging
except ImportError:  # the optional extra is not installed: nothing here to run
    collect_ignore_glob = ["test_*.py"]
else:
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
