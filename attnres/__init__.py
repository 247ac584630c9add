"""attnres: Attention Residuals (Kimi team, 2026) for PyTorch.

    from attnres import ModelConfig, AttnResLM
    model = AttnResLM(ModelConfig(residual="block", attnres_blocks=8))
"""
from attnres.model import AttnResLM, LMOutput, ModelConfig
from attnres.ops import depth_attention, merge_stats
from attnres.residual import RESIDUALS

__version__ = "0.1.0"
__all__ = ["AttnResLM", "LMOutput", "ModelConfig", "RESIDUALS", "depth_attention", "merge_stats"]
