"""Two-phase depth attention (docs/method.md §6): ``naive.py`` the plain reference, ``fused.py``
the custom-autograd ops the streams run, ``triton.py`` forward kernels for inference on CUDA.
Each defines ``phase1`` and ``merge`` or ``merge_partial`` with the same arguments and results."""
