"""Two-phase depth attention (docs/method.md §6), one file per implementation with the same names,
arguments and results: ``phase1`` and ``merge`` in each, ``merge_partial`` (Phase 2) where it is
computed. ``reference.py`` is the plain reference; ``fused.py`` the custom-autograd ops the residual
streams run (plus ``phase1_outputs``, Phase 1 on the stream's buffer), which route Phase 1 to the
device's kernels: ``triton.py`` / ``triton_backward.py`` on CUDA, ``cpu.py`` (the C++ kernel of
``cpu_kernel.cpp``, compiled on first use) on the CPU. ``compiled.py`` is the form the streams hand to
``torch.compile`` for training (``phase1_sources``: the sources as separate tensors, no buffer), whose larger
Phase 1s run the custom ops of ``library.py``."""
