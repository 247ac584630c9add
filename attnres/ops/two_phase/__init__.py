"""Two-phase depth attention (docs/method.md §6), one file per implementation with the same names,
arguments and results: ``phase1`` and ``merge`` in each, ``merge_partial`` (Phase 2) where it is
computed. ``reference.py`` is the plain reference; ``fused.py`` the custom-autograd ops the residual
streams run (plus ``phase1_outputs``, Phase 1 on the stream's buffer), which route CUDA calls to
``triton.py``, the forward kernels. ``compiled.py`` is the form the streams hand to ``torch.compile`` for training
(``phase1_sources``: plain autograd over the sources as separate tensors, no buffer)."""
