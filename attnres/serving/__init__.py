"""Serving what we train: our Kimi Linear-backbone models as the released Kimi K3 architecture that
llama.cpp (GGUF, :mod:`attnres.serving.gguf`) and mlx-lm (:mod:`attnres.serving.mlx`) run
(docs/serving.md). Optional dependencies: ``pip install 'attnres[serving]'`` (gguf) and
``'attnres[mlx]'`` (mlx, mlx-lm); nothing here is imported by the rest of the package."""
