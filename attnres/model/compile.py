"""torch.compile for AttnResLM, applied in place so that parameter and state-dict names stay an
eager model's (a checkpoint written compiled loads eagerly and back; no ``_orig_mod.`` prefixes).

Two granularities:

- ``"model"``: the whole forward (embedding, every block, the residual stream's depth attention,
  head) as one graph. The residual arithmetic is where compiling pays: a dozen small memory-bound
  ``[B, T, D]`` passes per sublayer fuse into a few loops.
- ``"sublayer"``: each attention and MLP sublayer's ``forward`` on its own; the residual stream
  stays eager (its depth attention runs the eager kernels: the C++ Phase 1 and merge + RMSNorm on the
  CPU, Triton on CUDA). This is regional compilation: every block's attention runs the same code over
  parameters of the same shapes, so dynamo compiles it once and every block reuses that graph (the MLP
  likewise), and the first compile costs the same whatever the residual scheme. The whole-model graph
  instead unrolls the depth attention of every sublayer, each over a different number of sources, which
  makes an AttnRes model's first compile 3-4x PreNorm's (docs/performance.md). Also for wrappers whose
  hooks must stay outside the graph (FSDP2 shards per sublayer, pipeline stages send tensors between
  sublayer groups): only the sublayer's ``forward`` method is compiled, so the module's ``__call__``
  and its hooks run eagerly around it, as PyTorch recommends for FSDP2 (compile per unit that
  ``fully_shard`` wraps).
"""

from __future__ import annotations

import os
import shutil
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from attnres.model.lm import AttnResLM

DEFAULT_BACKEND = "inductor"
GRANULARITIES = ("model", "sublayer")


def compile_backend(setting: bool | str) -> str | None:
    """The torch.compile backend a ``compile`` setting asks for: None for False, inductor for True,
    else the named backend (e.g. "aot_eager", which traces and runs autograd ahead of time without
    generating code: for finding graph breaks quickly)."""
    if setting is False or setting is None:
        return None
    return DEFAULT_BACKEND if setting is True else setting


def check_compile_setting(setting, field: str = "TrainConfig.compile") -> None:
    """False, True, or the name of a torch.compile backend; a one-line error otherwise."""
    if isinstance(setting, bool):
        return
    if isinstance(setting, str):
        import torch._dynamo

        known = torch._dynamo.list_backends(exclude_tags=()) + [DEFAULT_BACKEND]
        if setting in known:
            return
        raise ValueError(
            f"{field}={setting!r} is not a torch.compile backend; use true (inductor) or one of {sorted(set(known))}"
        )
    raise ValueError(f"{field}={setting!r} is invalid: use true, false, or a torch.compile backend name")


def check_compiler(setting, device, field: str = "TrainConfig.compile") -> None:
    """A one-line error, before anything is built, where inductor would need a C++ compiler that is not
    there: on the CPU it writes C++ and builds it with the first of ``torch._inductor.config.cpp.cxx``
    it finds (g++, or $CXX), and without one the first compiled step ends in a long traceback from
    inside torch. Other backends and devices need none."""
    if compile_backend(setting) != DEFAULT_BACKEND or torch.device(device).type != "cpu":
        return
    from torch._inductor import config

    names = config.cpp.cxx if isinstance(config.cpp.cxx, (list, tuple)) else (config.cpp.cxx,)
    # None: a compiler torch installs itself from conda, when TORCH_INDUCTOR_INSTALL_GXX asks it to
    if any(shutil.which(name) if name else os.environ.get("TORCH_INDUCTOR_INSTALL_GXX") for name in names):
        return
    wanted = " or ".join(name for name in names if name) or "g++"
    raise ValueError(
        f"{field}={setting!r} compiles with inductor, which on the CPU needs a C++ compiler ({wanted}), and "
        f"none is on PATH. Fix: install one (e.g. apt install g++, or set CXX to yours), or drop --compile "
        "(or use the aot_eager backend, which generates no code)"
    )


def compile_model(
    model: AttnResLM, setting: bool | str = True, *, granularity: str = "model", fullgraph: bool = False
) -> AttnResLM:
    """Compile ``model`` (an AttnResLM) in place and return it; ``setting`` as in
    :func:`compile_backend` (False: leave it eager)."""
    backend = compile_backend(setting)
    if backend is None:
        return model
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity={granularity!r} is invalid: choose one of {GRANULARITIES}")
    if granularity == "model":
        model.compile(backend=backend, fullgraph=fullgraph)
    else:
        # children() skips the None entries: a pipeline rank's model holds only its own stages' blocks
        for block in model.blocks.children():
            for sublayer in (block.get_submodule("attn"), block.get_submodule("mlp")):
                # the bound method, not the module: hooks on the module (FSDP2's) stay eager
                sublayer.forward = torch.compile(sublayer.forward, backend=backend, fullgraph=fullgraph)
    return model
