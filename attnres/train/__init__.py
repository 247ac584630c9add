"""Training components: optimizer construction, LR schedules, checkpoints, metrics.

The checkpoint names live in :mod:`attnres.checkpoint` (inference and conversion read checkpoints
without the trainer); they are re-exported here.
"""

from attnres.checkpoint import (
    FORMAT_VERSION,
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    read_checkpoint_state,
    save_checkpoint,
)
from attnres.train.metrics import MetricsLogger
from attnres.train.optim import (
    OPTIMIZER_NAMES,
    PARAM_KINDS,
    CombinedOptimizer,
    build_optimizer,
    group_parameters,
)
from attnres.train.schedule import (
    SCHEDULE_NAMES,
    Schedule,
    constant,
    cosine,
    make_schedule,
    set_lr,
    wsd,
)

__all__ = [
    "FORMAT_VERSION",
    "CheckpointError",
    "latest_checkpoint",
    "load_checkpoint",
    "read_checkpoint_state",
    "save_checkpoint",
    "MetricsLogger",
    "OPTIMIZER_NAMES",
    "PARAM_KINDS",
    "CombinedOptimizer",
    "build_optimizer",
    "group_parameters",
    "SCHEDULE_NAMES",
    "Schedule",
    "constant",
    "cosine",
    "make_schedule",
    "set_lr",
    "wsd",
]
