"""``AutoModelForCausalLM`` on a ``kimi_linear`` config after ``import attnres.hf``: §10 checkpoints load
as ours, any other as transformers' own model.
"""

from __future__ import annotations

from pathlib import Path

import torch

from attnres.hf.configuration import AttnResConfig
from attnres.hf.convert import ConversionError
from attnres.hf.kimi.layout import (
    attn_res_block_size,
    kimi_model_fields,
    layout_residual,
)
from attnres.hf.kimi.load import convert_kimi_linear
from attnres.hf.modeling import AttnResForCausalLM
from attnres.model.config import ModelConfig


class KimiLinearAutoModel:
    """What ``AutoModelForCausalLM`` builds for a ``kimi_linear`` config once ``attnres.hf`` is
    imported: a §10 checkpoint (``attn_res_block_size`` set) becomes our ``AttnResForCausalLM``;
    any other Kimi Linear checkpoint goes to transformers' own ``KimiLinearForCausalLM``, unchanged."""

    from transformers import KimiLinearConfig as config_class

    @classmethod
    def from_pretrained(cls, path, *args, config=None, **kwargs):
        from transformers import AutoConfig, KimiLinearForCausalLM

        if config is None:
            config = AutoConfig.from_pretrained(
                path, local_files_only=kwargs.get("local_files_only", False), trust_remote_code=False
            )
        if attn_res_block_size(config) is None:
            return KimiLinearForCausalLM.from_pretrained(path, *args, config=config, **kwargs)
        if not Path(path).is_dir():
            raise ConversionError(f"{path}: attnres reads the §10 layout from a local directory only")
        dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
        return convert_kimi_linear(path, dtype=dtype if isinstance(dtype, torch.dtype) else None)

    @classmethod
    def _from_config(cls, config, **kwargs):
        from transformers import KimiLinearForCausalLM

        b = attn_res_block_size(config)
        if b is None:
            return KimiLinearForCausalLM._from_config(config, **kwargs)
        fields = kimi_model_fields(config)
        model_config = ModelConfig(**fields, **layout_residual(fields["n_layers"], b))
        return AttnResForCausalLM(AttnResConfig.from_model_config(model_config))


def register_auto_model() -> None:
    from transformers import AutoModelForCausalLM, KimiLinearConfig

    AutoModelForCausalLM.register(KimiLinearConfig, KimiLinearAutoModel, exist_ok=True)
