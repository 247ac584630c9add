"""The Trainer configs ``--config`` names: ``<scheme>_<flavor>`` for every residual scheme and flavor
(``block_debugmodel``, ``full_1B``, ``prenorm_8B``, ``block_kimi_debugmodel``, ...), each a function
that returns a ``torchtitan.trainer.Trainer.Config``, as torchtitan's ``--module`` loading expects.

The defaults are torchtitan's llama3 ones for the same flavor (its c4_test data and test tokenizer
for the debug models: run from a torchtitan checkout, or pass ``--hf_assets_path`` and
``--dataloader.dataset_path``), with what attnres models need: AdamW whose no-decay group holds the
AttnRes parameters and norms, plain cross-entropy over the logits, torchtitan's DTensor backend
(``partial_dtensor``) without sequence parallelism, and attnres' depth-block activation checkpointing.
"""

from __future__ import annotations

from collections.abc import Callable

from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
from torchtitan.config import ParallelismConfig, TrainingConfig
from torchtitan.distributed.activation_checkpoint import FullAC
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
from torchtitan.trainer import Trainer

from attnres.integrations.torchtitan import FLAVORS, adamw_param_groups, model_registry
from attnres.residual import RESIDUALS

# (local batch, seq_len, steps, lr) per flavor: torchtitan's llama3 settings at the same sizes
_TRAINING = {
    "debugmodel": (8, 2048, 10, 8e-4),
    "kimi_debugmodel": (8, 2048, 10, 8e-4),
    "1B": (1, 8192, 1000, 3e-4),
    "8B": (1, 8192, 1000, 3e-4),
}


def trainer_config(residual: str, flavor: str) -> Trainer.Config:
    """The Trainer config of scheme ``residual`` at ``flavor`` (module docstring)."""
    spec = model_registry(flavor, residual)
    local_batch, seq_len, steps, lr = _TRAINING[flavor]
    debug = flavor.endswith("debugmodel")
    return Trainer.Config(
        model_spec=spec,
        hf_assets_path="./tests/assets/tokenizer" if debug else "./assets/hf/Llama-3.1-8B",
        loss=CrossEntropyLoss.Config(),
        optimizer=OptimizersContainer.Config(param_groups=adamw_param_groups(spec.model.lm, lr=lr, weight_decay=0.1)),
        lr_scheduler=LRSchedulersContainer.Config(
            warmup_steps=2 if debug else 200, decay_ratio=0.8, decay_type="linear", min_lr_factor=0.0
        ),
        training=TrainingConfig(local_batch_size=local_batch, seq_len=seq_len, steps=steps),
        dataloader=HuggingFaceTextDataLoader.Config(dataset="c4_test" if debug else "c4"),
        metrics=MetricsProcessor.Config(log_freq=1 if debug else 10),
        parallelism=ParallelismConfig(spmd_backend="partial_dtensor", enable_sequence_parallel=False),
        checkpoint=CheckpointManager.Config(interval=10 if debug else 500, last_save_model_only=False),
        activation_checkpoint=FullAC.Config(),
    )


def _config_function(residual: str, flavor: str) -> Callable[[], Trainer.Config]:
    def config() -> Trainer.Config:
        return trainer_config(residual, flavor)

    config.__name__ = config.__qualname__ = f"{residual}_{flavor}"
    config.__doc__ = f"Scheme {residual!r} at flavor {flavor!r} (attnres.integrations.torchtitan.FLAVORS)."
    return config


CONFIGS: dict[str, Callable[[], Trainer.Config]] = {
    f"{residual}_{flavor}": _config_function(residual, flavor) for residual in RESIDUALS for flavor in FLAVORS
}
# torchtitan looks the --config name up as an attribute of this module
globals().update(CONFIGS)
