"""The Hugging Face tests run offline and only where transformers is installed (pip install attnres[hf])."""

try:
    from transformers.utils import logging as hf_logging
except ImportError:  # the optional extra is not installed: nothing here to run
    collect_ignore_glob = ["test_*.py"]
else:
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
