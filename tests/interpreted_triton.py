"""Import a module of Triton kernels so that its tests run anywhere.

Without a GPU the kernels run in Triton's interpreter on CPU tensors. The interpreter has to be
switched on before the first ``import triton`` (triton's own ``@jit`` helpers are defined at
import), so importing this helper sets ``TRITON_INTERPRET=1`` first; it stays set for the session,
because triton defines more ``@jit`` helpers lazily (at the first launch). With a GPU (and
TRITON_INTERPRET not set) the same tests run the compiled kernels on CUDA. Call
``import_kernels`` at the top of a test module: it skips the module where triton is missing, or
was imported (by an earlier test) before the interpreter could be switched on.
"""

import importlib
import os
import sys

import pytest
import torch

ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
if not ON_GPU and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"
DEVICE = "cuda" if ON_GPU else "cpu"


def import_kernels(name: str):
    pytest.importorskip("triton")
    module = importlib.import_module(name)
    interpreted = importlib.import_module("attnres.ops.depth_attention.triton").INTERPRETED
    if not ON_GPU and not interpreted:
        pytest.skip(
            "triton was imported before TRITON_INTERPRET=1 could be set; run this file alone", allow_module_level=True
        )
    return module
