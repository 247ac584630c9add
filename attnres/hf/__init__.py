"""Hugging Face integration (needs ``pip install attnres[hf]``).

Importing this package registers the "attnres" model type with ``AutoConfig``
and ``AutoModelForCausalLM``, so saved models load with the Auto classes and
no ``trust_remote_code``:

    import attnres.hf
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained("my-attnres-model")      # a local directory

- :class:`AttnResConfig`, :class:`AttnResForCausalLM`: the config and the causal LM
  (``save_pretrained`` / ``from_pretrained`` / ``generate``), wrapping ``attnres.AttnResLM``;
- :func:`retrofit` (``attnres.hf.retrofit``): retrofit a pretrained causal LM of any of 30 decoder families
  (Llama, Mistral, Qwen2/3, MoEs, Gemma 1-3, Phi, GPT-2, GPT-NeoX, ...) into AttnRes by wrapping its own
  layers: exact at init, saved under ``model_type = "attnres_retrofit"`` with its modules' weight names;
- :func:`convert_to_attnres`: the same into our own model (:class:`AttnResForCausalLM`, native format)
  where ``AttnResLM`` can express the source (LLaMA / Mistral / Qwen2 without biases), else the wrapper;
- :func:`native_to_hf` / :func:`hf_to_native`: the trainer's checkpoints <-> this format;
- :func:`convert_kimi_linear` / :func:`save_kimi_linear` (``attnres.hf.kimi``): Kimi Linear checkpoints
  (plain, retrofitted; or the released AttnRes layout of docs/method.md §10) <-> our
  ``backbone="kimi_linear"`` models; ``AutoModelForCausalLM`` loads the §10 layout as ours after this
  import;
- :func:`source_kind` / :func:`convert_directory`: what a model directory holds, and converting it
  (the ``attnres convert`` command).

Modules import one way: ``directories`` -> ``kimi`` -> ``convert`` -> ``retrofit``, ``modeling`` ->
``configuration``, ``tokenizer``, ``errors``.
"""

import transformers

if int(transformers.__version__.split(".")[0]) < 5:
    raise ImportError(f"attnres.hf needs transformers>=5 (found {transformers.__version__}): pip install 'attnres[hf]'")

from transformers import AutoConfig, AutoModelForCausalLM

from attnres.hf.configuration import AttnResConfig
from attnres.hf.convert import ConversionError, convert_to_attnres
from attnres.hf.directories import SOURCE_KINDS, convert_directory, source_kind
from attnres.hf.kimi import convert_kimi_linear, register_auto_model, save_kimi_linear
from attnres.hf.modeling import (
    AttnResForCausalLM,
    AttnResPreTrainedModel,
    hf_to_native,
    native_to_hf,
)
from attnres.hf.retrofit import register as register_retrofit
from attnres.hf.retrofit import retrofit
from attnres.hf.tokenizer import hf_tokenizer

AutoConfig.register(AttnResConfig.model_type, AttnResConfig, exist_ok=True)
AutoModelForCausalLM.register(AttnResConfig, AttnResForCausalLM, exist_ok=True)
register_retrofit()  # model_type "attnres_retrofit": the wrapped families of attnres.hf.retrofit
register_auto_model()  # kimi_linear checkpoints in the released AttnRes layout (docs/method.md §10) load as ours

__all__ = [
    "AttnResConfig",
    "AttnResForCausalLM",
    "AttnResPreTrainedModel",
    "ConversionError",
    "SOURCE_KINDS",
    "convert_directory",
    "convert_kimi_linear",
    "convert_to_attnres",
    "hf_to_native",
    "hf_tokenizer",
    "native_to_hf",
    "retrofit",
    "save_kimi_linear",
    "source_kind",
]
