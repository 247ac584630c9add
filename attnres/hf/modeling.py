"""AttnResForCausalLM: our AttnResLM behind the Hugging Face ``PreTrainedModel`` / ``generate()`` API.

The HF model holds one :class:`attnres.AttnResLM` as ``self.model`` and adds
nothing to its arithmetic: ``model(input_ids).logits`` is exactly
``model.model(input_ids)``. Parameter names are the native ones under the
``model.`` prefix (``model.embed.weight``, ``model.blocks.3.attn.q_proj.weight``,
``model.residual.queries``, ...), which is what ``save_pretrained`` writes.

Generation runs through our KV cache (``attnres.inference.KVCache``): the
first step prefills the prompt, each later step feeds one token; past
``max_seq_len`` the last ``max_seq_len`` tokens are re-prefilled each step,
like :func:`attnres.inference.sampling.generate`. Padded batches (an
``attention_mask`` with zeros, left padding for generation) give each row what
its prompt gives alone; beam search reorders the cache (``KVCache.reorder_cache``).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from itertools import chain
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as hf_init
from transformers.modeling_outputs import CausalLMOutputWithPast

from attnres.checkpoint import load_model, save_checkpoint
from attnres.files import TOKENIZER_FILE
from attnres.hf.configuration import AttnResConfig
from attnres.hf.errors import from_pretrained_strictly
from attnres.hf.tokenizer import special_token_ids
from attnres.model.llama import rope_tables
from attnres.model.lm import AttnResLM
from attnres.residual import build_residual

if TYPE_CHECKING:  # imported where it is used: compiled decoding is optional
    from attnres.inference import CompiledDecoder

IGNORE_INDEX = -100


def causal_lm_loss(logits: Tensor, labels: Tensor, num_items_in_batch=None) -> Tensor:
    """Next-token cross-entropy, HF convention: ``labels`` are aligned with the inputs (the shift
    happens here) and ``-100`` marks positions without a target. With ``num_items_in_batch`` (the
    HF Trainer's gradient-accumulation count) the sum is divided by it instead of averaged."""
    logits = logits[:, :-1].flatten(0, 1).float()
    targets = labels[:, 1:].flatten().to(logits.device)
    if num_items_in_batch is None:
        return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX)
    total = F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def _mark_initialized(module: nn.Module) -> None:
    """Tell transformers' weight initialisation that these tensors already hold their values."""
    for t in chain(module.parameters(), module.buffers()):
        t._is_hf_initialized = True  # type: ignore[attr-defined]  # transformers' own marker on a tensor


def _is_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in chain(module.parameters(), module.buffers()))


@torch.no_grad()
def _init_attnres_lm(lm: AttnResLM) -> None:
    """AttnResLM's own initialisation, applied only to tensors that transformers has not loaded
    (``transformers.initialization`` skips tensors flagged ``_is_hf_initialized``)."""
    cfg = lm.config
    std = cfg.init_std
    for name, module in lm.named_modules():
        if name.startswith("residual"):
            continue
        if isinstance(module, (nn.Linear, nn.Embedding)):
            scale = 1.0 / math.sqrt(2 * cfg.n_layers) if name.endswith(("o_proj", "down_proj")) else 1.0
            hf_init.normal_(module.weight, mean=0.0, std=std * scale)
        elif isinstance(module, nn.RMSNorm):
            hf_init.ones_(module.weight)
    missing = [(n, p) for n, p in lm.residual.named_parameters() if not getattr(p, "_is_hf_initialized", False)]
    if missing:
        # each residual scheme initialises itself (zero queries, unit key norms, ...): copy a fresh one
        with torch.device("cpu"):
            fresh = dict(build_residual(cfg).named_parameters())
        for n, p in missing:
            hf_init.copy_(p, fresh[n].to(dtype=p.dtype, device=p.device))
    _reset_rope(lm)


@torch.no_grad()
def _reset_rope(lm: AttnResLM) -> None:
    """The RoPE tables are non-persistent buffers: never in a checkpoint, always recomputed."""
    cfg = lm.config
    cos, sin = rope_tables(cfg.rope_dim, lm.rope_cos.shape[0], cfg.rope_theta)  # the rows built so far
    lm.rope_cos.copy_(cos.to(dtype=lm.rope_cos.dtype, device=lm.rope_cos.device))
    lm.rope_sin.copy_(sin.to(dtype=lm.rope_sin.dtype, device=lm.rope_sin.device))


class AttnResPreTrainedModel(PreTrainedModel):
    config_class = AttnResConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    # activation_checkpointing_enable() (gradient_checkpointing_enable()) sets the flag of every
    # TransformerBlock: its two sublayers recompute their activations in backward
    supports_gradient_checkpointing = True
    # the residual stream crosses every block: keep the whole model on one device
    _no_split_modules = ["AttnResLM"]

    def _init_weights(self, module: nn.Module) -> None:
        # everything is initialised at the AttnResLM level, with its own rules
        if isinstance(module, AttnResLM):
            _init_attnres_lm(module)


class AttnResForCausalLM(AttnResPreTrainedModel, GenerationMixin):
    """A causal LM for the Hugging Face ecosystem around :class:`attnres.AttnResLM`.

        import attnres.hf  # registers "attnres" with AutoConfig / AutoModelForCausalLM
        model = AttnResForCausalLM(AttnResConfig(vocab_size=256, d_model=64, n_layers=4))
        out = model(input_ids, labels=input_ids)          # out.loss, out.logits
        model.generate(input_ids, max_new_tokens=20, do_sample=False)
        model.save_pretrained("dir"); AutoModelForCausalLM.from_pretrained("dir")

    ``model.model`` is the native AttnResLM (``model.model(ids, return_record=True)`` gives the
    depth weights). ``from_native`` / ``to_native`` convert from / to the trainer's checkpoints.
    """

    _tied_weights_keys = {"model.lm_head.weight": "model.embed.weight"}

    def __init__(self, config: AttnResConfig):
        super().__init__(config)
        self.model = AttnResLM(config.model_config())
        if not _is_meta(self.model):
            # AttnResLM initialised itself; post_init must not draw the weights a second time
            _mark_initialized(self.model)
        self.post_init()

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """``PreTrainedModel.from_pretrained``, strict: a checkpoint with any missing, unexpected or
        re-initialised key is a :class:`ConversionError` naming the keys (transformers only logs them).
        Then the RoPE tables, which no checkpoint holds, are recomputed whatever transformers' loader
        did with non-persistent buffers."""
        loaded = from_pretrained_strictly(super().from_pretrained, cls.__name__, *args, **kwargs)
        _reset_rope((loaded[0] if isinstance(loaded, tuple) else loaded).model)
        return loaded

    # ------------------------------------------------------------------ wrapping and conversion
    @classmethod
    def from_attnres_lm(cls, lm: AttnResLM, **config_kwargs) -> AttnResForCausalLM:
        """Wrap an existing AttnResLM (its parameters are shared, not copied). ``config_kwargs``
        are HF-only options such as ``eos_token_id``."""
        config = AttnResConfig.from_model_config(lm.config, **config_kwargs)
        with torch.device("meta"):
            model = cls(config)
        model.model = lm
        _mark_initialized(lm)
        return model

    @classmethod
    def from_native(cls, path, device: str = "cpu", **config_kwargs) -> AttnResForCausalLM:
        """Load a native run directory or checkpoint directory (``attnres train``): :func:`native_to_hf`."""
        return native_to_hf(path, device=device, **config_kwargs)

    def to_native(self, path):
        """Write a native weights-only checkpoint directory: :func:`hf_to_native`."""
        return hf_to_native(self, path)

    # ------------------------------------------------------------------ embeddings
    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.model.embed = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.model.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.model.lm_head = value

    # ------------------------------------------------------------------ forward
    def _run(self, input_ids: Tensor, cache=None, attention_mask: Tensor | None = None) -> Tensor:
        """The one place the wrapped AttnResLM runs. With ``cache`` (an ``attnres.inference.KVCache``)
        ``input_ids`` are the tokens after the cached positions; ``attention_mask`` covers both. A
        ``CompiledDecoder`` (see :meth:`compile_decoding`) runs them through its compiled step."""
        from attnres.inference import CompiledDecoder

        if isinstance(cache, CompiledDecoder):
            if attention_mask is not None and not bool(attention_mask.all()):
                raise ValueError(
                    "compiled decoding does not run padded batches (its static cache has no "
                    "padding mask); generate them without compile_decoding(), or one prompt at a time"
                )
            return cache(input_ids)
        return self.model(input_ids, cache=cache, attention_mask=attention_mask)

    def compile_decoding(self, setting: bool | str = True) -> AttnResForCausalLM:
        """Make ``generate()`` decode through ``attnres.inference.CompiledDecoder``: the forward compiled
        (``setting``: True for inductor, or a torch.compile backend name) over a static KV cache, once
        for the prompt's shape and once for one token, then reused by later calls with the same batch
        size. Greedy, sampling and beam search; not padded batches or Kimi Linear (its recurrent
        state is not a KV cache). ``compile_decoding(False)`` goes back to eager decoding."""
        from attnres.model.compile import check_compile_setting

        check_compile_setting(setting, field="compile_decoding(setting)")
        if setting:
            from attnres.inference.compiled import check_static_cache

            check_static_cache(self.config, "compile_decoding")
        self._decoding = setting
        self._decoders: dict[int, CompiledDecoder] = {}
        return self

    def forward(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        labels: Tensor | None = None,
        cache=None,
        inputs_embeds: Tensor | None = None,
        use_cache: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ):
        """``input_ids`` [B, T] -> ``CausalLMOutputWithPast(loss, logits)``.

        ``labels`` follow the HF convention (same positions as ``input_ids``, shifted inside,
        ``-100`` ignored). ``attention_mask`` [B, cached + T]: 1 for tokens, 0 for padding (left or
        right); each row's tokens get the logits of that row run alone. ``output_hidden_states``:
        ``hidden_states`` holds the 2 * n_layers sublayer inputs h_l (what each pre-norm reads, in
        sublayer order, docs/method.md §2) and then the stream's output (what the final norm reads).
        Not supported: ``inputs_embeds``, ``output_attentions``. ``cache``: an
        ``attnres.inference.KVCache`` (returned as ``output.cache``).
        """
        cache = cache if cache is not None else kwargs.pop("past_key_values", None)
        if inputs_embeds is not None:
            raise NotImplementedError("AttnResForCausalLM takes input_ids, not inputs_embeds")
        if input_ids is None:
            raise ValueError("AttnResForCausalLM.forward needs input_ids [batch, seq_len]")
        if kwargs.get("output_attentions"):
            raise NotImplementedError(
                "output_attentions=True is not supported: the attention weights are never formed "
                "(model.model(input_ids, return_record=True) gives the depth weights)"
            )
        output_hidden_states = kwargs.get("output_hidden_states")
        if output_hidden_states is None:
            output_hidden_states = self.config.output_hidden_states
        hidden_states = None
        if output_hidden_states:
            with sublayer_inputs(self.model) as hidden_states:
                logits = self._run(input_ids, cache, attention_mask)
            hidden_states = tuple(hidden_states)
        else:
            logits = self._run(input_ids, cache, attention_mask)
        loss = None
        if labels is not None:
            loss = causal_lm_loss(logits, labels, kwargs.get("num_items_in_batch"))
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        if not return_dict:
            out = (logits,) if loss is None else (loss, logits)
            return out + (hidden_states,) if output_hidden_states else out
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=cache, hidden_states=hidden_states)

    # ------------------------------------------------------------------ generation
    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        # generate() must not create a transformers DynamicCache: ours is made on the first step
        return False

    def prepare_inputs_for_generation(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        cache=None,
        use_cache: bool | None = None,
        **kwargs,
    ) -> dict:
        """Feed generate() through our KV cache (``attnres.inference.KVCache``, created on the first
        step; forward returns it as ``output.cache`` and generate() hands it back here): the first
        step prefills the prompt, later steps feed only the new token. Once the sequence reaches
        ``max_seq_len`` the model sees the last ``max_seq_len`` tokens (each step re-prefills that
        window), exactly like :func:`attnres.inference.sampling.generate`. ``use_cache=False`` recomputes the
        cropped sequence every step. The ``attention_mask`` travels whole (cached and new columns, as
        AttnResLM takes it); the window counts columns, padding included."""
        limit = self.config.max_seq_len
        if use_cache is False:
            cache = None
            new = input_ids[:, -limit:]
        else:
            if cache is None and getattr(self, "_decoding", False):
                from attnres.inference import CompiledDecoder

                batch = input_ids.shape[0]
                if batch not in self._decoders:  # compiled once per batch size, kept for later calls
                    self._decoders[batch] = CompiledDecoder(self.model, batch, setting=self._decoding)
                cache = self._decoders[batch]
                cache.reset()
            elif cache is None:
                from attnres.inference import make_cache

                cache = make_cache(self.model, input_ids.shape[0])  # KVCache, or HybridCache (Kimi Linear)
            new = input_ids[:, cache.length :]
            if input_ids.shape[1] > limit or cache.room() < new.shape[1]:
                cache.reset()
                new = input_ids[:, -limit:]
        inputs = {"input_ids": new, "cache": cache}
        if attention_mask is not None:  # the mask covers the cached columns and the new ones
            seen = 0 if cache is None else cache.length
            inputs["attention_mask"] = attention_mask[:, -(seen + new.shape[1]) :]
        return inputs


@contextmanager
def sublayer_inputs(lm: AttnResLM):
    """Collect, while the context is open, what each pre-norm reads (the sublayer inputs h_l, in
    sublayer order) and then what the final norm reads; yields the list that fills up."""
    seen = []
    norms: list[nn.Module] = [lm.norm]
    norms[:0] = [block.get_submodule(name) for block in lm.blocks for name in ("attn_norm", "mlp_norm")]
    handles = [norm.register_forward_pre_hook(lambda module, args: seen.append(args[0])) for norm in norms]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


# ----------------------------------------------------------------------------- native <-> HF


def native_to_hf(path, device: str = "cpu", **config_kwargs) -> AttnResForCausalLM:
    """An AttnResForCausalLM from a native run directory or checkpoint directory (``attnres train``).
    The bos / eos / pad ids come from the run's tokenizer (``attnres.hf.tokenizer.special_token_ids``),
    unless ``config_kwargs`` name them; they are also the generation defaults."""
    return native_to_hf_with_tokenizer(path, device, **config_kwargs)[0]


def native_to_hf_with_tokenizer(path, device: str = "cpu", **config_kwargs):
    """:func:`native_to_hf` and the run's native tokenizer (None if the directory has none)."""
    lm, tokenizer, state = load_model(str(path), device=device)
    special = special_token_ids(tokenizer) if tokenizer is not None else {}
    if state["train_config"]:  # kept in config.json: to_native writes it back (see hf_to_native)
        special["native_train_config"] = state["train_config"]
    model = AttnResForCausalLM.from_attnres_lm(lm, **{**special, **config_kwargs}).eval()
    model.native_tokenizer = tokenizer
    return model, tokenizer


def hf_to_native(model: AttnResForCausalLM, path, tokenizer=None) -> Path:
    """Write ``model`` as a native weights-only checkpoint directory (no optimizer state: it does not
    resume a run) that ``attnres eval`` and ``attnres sample`` accept. ``tokenizer``: a native
    ``attnres.data`` tokenizer saved beside it as tokenizer.json (default: the one ``from_native``
    read). The train config is the native run's when the model came from one (``from_native`` keeps
    it in ``config.native_train_config``), else :func:`default_train_config`."""
    tokenizer = tokenizer if tokenizer is not None else getattr(model, "native_tokenizer", None)
    train_config = getattr(model.config, "native_train_config", None) or default_train_config(model, tokenizer)
    target = save_checkpoint(
        path,
        model=model.model,
        optimizer=None,
        step=0,
        train_state={"converted_from": "huggingface"},
        model_config=model.config.model_config().to_dict(),
        train_config=train_config,
    )
    if tokenizer is not None:
        tokenizer.save(target / TOKENIZER_FILE)
    return target


def default_train_config(model: AttnResForCausalLM, tokenizer=None) -> dict:
    """The train config of a native checkpoint made from a Hugging Face model that was never a native
    run: the defaults (evaluation on the bundled corpus), the tokenizer's kind and the model's
    vocabulary, windows no longer than the model's context."""
    from attnres.data import ByteTokenizer
    from attnres.train.config import TrainConfig

    config = TrainConfig(
        tokenizer="byte" if isinstance(tokenizer, ByteTokenizer) else "bpe",
        vocab_size=model.config.vocab_size,
        seq_len=min(TrainConfig.seq_len, model.config.max_seq_len),
        progress=False,
    )
    return config.to_dict()
