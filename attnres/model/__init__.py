"""Models the residual schemes plug into."""

from attnres.model.config import ModelConfig
from attnres.model.lm import AttnResLM, LMOutput

__all__ = ["AttnResLM", "LMOutput", "ModelConfig"]
