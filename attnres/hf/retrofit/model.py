"""The retrofit wrapper: a transformers causal LM whose decoder layers talk through an AttnRes depth stream.

``retrofit(source, residual="block")`` returns a model of a class derived from the source's own
``XForCausalLM`` (``AttnResLlamaForCausalLM`` for Llama, ...) with a config derived from the source's
config class (``model_type = "attnres_retrofit"``, the AttnRes options under ``config.attnres_retrofit``).
The source's modules stay where they are, under their own names, and run their own code: embeddings,
rotary embeddings, masks, the KV cache, attention, MLP / MoE, norms, the final norm, the head and its
soft-cap. The only change is each decoder layer's ``forward``: instead of ``h = h + f(norm(h))`` it
reads the sublayer input from the depth stream and writes the sublayer output back to it
(``attnres.hf.retrofit.families`` says how each family's layer splits into sublayers).

Wiring. Layer 0 begins the stream with what the model hands it (the embedding, scaled or with
positions added as the family does). Each layer returns the read of the next layer's first sublayer,
which the model passes on as the next layer's ``hidden_states``; the last layer returns the final
aggregation, which goes through the source's final norm. So ``output_hidden_states`` holds each layer's
input as the AttnRes model reads it (c_l times the PreNorm hidden state at init).

Exactness at init (docs/method.md §3): every query is zero, so read l is c_l · S_l with S_l the
PreNorm residual sum; the norm reading it gets eps · c_l², which cancels c_l. ``rescale_reads=True``
instead multiplies every read by 1/c_l (so it starts as S_l exactly) and changes no eps: the exact
alternative for families whose sublayers read the stream without a norm (OLMo-2) or whose norms
have no settable eps (OLMo).
"""

from __future__ import annotations

import copy
import functools
import inspect
import types
import typing
from typing import Any

import torch
from torch import nn

from attnres.hf.errors import ConversionError, config_error, from_pretrained_strictly
from attnres.hf.retrofit.families import (
    FAMILIES,
    REFUSED,
    UNNORMALISED,
    Family,
    Part,
    Sublayer,
    family_name,
)
from attnres.residual import residual_scheme
from attnres.residual.norms import _BASE, _base_eps, _eps_attribute, prenorm_eps_scales

MODEL_TYPE = "attnres_retrofit"
OPTIONS = "attnres_retrofit"  # the config attribute holding the retrofit's options
RESIDUALS = ("block", "full", "prenorm")  # schemes whose fresh initialisation computes the PreNorm function
_EPS_FIELDS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_epsilon", "norm_eps")


def _parse_bool(value: Any, field: str) -> bool:
    """A yes/no option read strictly (from the CLI's --set it is a text, and bool("no") is True)."""
    from attnres.train.config import parse_bool

    try:
        return parse_bool(value, field)
    except ValueError as e:
        raise ConversionError(str(e)) from None


def _resolve(module: nn.Module, path: str):
    for name in path.split("."):
        module = getattr(module, name)
    return module


class _Runner:
    """What the patched layer forwards share (a plain object, so nothing here is a submodule twice)."""

    def __init__(self, scheme, sublayers: tuple[Sublayer, ...], n_layers: int, rescale: bool):
        self.scheme = scheme
        self.sublayers = sublayers
        self.n_layers = n_layers
        self.rescale = rescale
        self.stream: Any = None  # the Stream of the forward pass under way

    def read(self):
        h = self.stream.read()
        if self.rescale:
            c = self.scheme.prenorm_read_scale(self.stream.at)
            h = h if c in (None, 1, 1.0) else h * (1.0 / c)
        return h

    def end(self):
        h = self.stream.end()
        if self.rescale:
            c = self.scheme.prenorm_read_scale(self.scheme.n_sublayers)
            h = h if c in (None, 1, 1.0) else h * (1.0 / c)
        self.stream = None
        return h


def _run_part(layer: nn.Module, part: Part, x: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
    module = getattr(layer, part.module)
    out = module(x, **kwargs) if part.attention else module(x)
    if isinstance(out, tuple):  # attention: (output, weights); GPT-OSS / Qwen2-MoE MLPs: (output, router)
        out = out[0]
    if part.post is not None:
        out = getattr(layer, part.post)(out)
    if part.dropout is not None:
        out = getattr(layer, part.dropout)(out)
    if part.scale is not None:
        out = out * getattr(layer, part.scale)
    return out


def _returns_tuple(signature: inspect.Signature) -> bool:
    """Whether a decoder layer's forward returns ``(hidden_state, ...)`` rather than the hidden state: the
    older convention (GPT-J in transformers 5.17, not 5.24), whose layers take ``output_attentions`` and whose
    model reads ``outputs[0]``, which of a bare tensor is its first row. The annotation alone does not
    tell (Gemma 3 and GLM-4 annotate a tuple and return a tensor)."""
    if "output_attentions" not in signature.parameters:
        return False
    annotation = signature.return_annotation
    alternatives = (
        typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) else ()
    )
    alternatives = tuple(a for a in alternatives if a is not type(None)) or (annotation,)
    return all(typing.get_origin(a) is tuple for a in alternatives)


def _layer_forward(
    runner: _Runner, index: int, layer: nn.Module, signature: inspect.Signature, as_tuple: bool, *args, **kwargs
):
    """The decoder layer's forward with the residual wiring replaced by the depth stream (``as_tuple``:
    wrapped in a 1-tuple, as the layer's own forward returns it)."""
    h = _layer_output(runner, index, layer, signature, *args, **kwargs)
    return (h,) if as_tuple else h


def _layer_output(runner: _Runner, index: int, layer: nn.Module, signature: inspect.Signature, *args, **kwargs):
    try:
        bound = signature.bind(layer, *args, **kwargs)
    except TypeError:  # a caller using names the signature does not list: pass them through
        bound = None
    if bound is not None:
        arguments = dict(bound.arguments)
        arguments.pop(next(iter(signature.parameters)))  # self
        for name, p in signature.parameters.items():
            if p.kind is inspect.Parameter.VAR_KEYWORD:
                arguments.update(arguments.pop(name, {}))
            elif p.kind is inspect.Parameter.VAR_POSITIONAL:
                arguments.pop(name, None)
        hidden = arguments.pop(list(signature.parameters)[1])
    else:
        arguments = dict(kwargs)
        hidden = args[0] if args else arguments.pop("hidden_states")
    for name in ("encoder_hidden_states", "encoder_attention_mask"):
        if arguments.get(name, 0) is None:
            arguments.pop(name)
    if index == 0:
        runner.stream = runner.scheme.begin(hidden)
        h = runner.read()
    else:
        h = hidden
        if runner.rescale:
            c = runner.scheme.prenorm_read_scale(runner.stream.at)
            h = h if c in (None, 1, 1.0) else h * (1.0 / c)
    stream = runner.stream
    for k, sublayer in enumerate(runner.sublayers):
        if k:
            h = runner.read()
        normed: dict[str | None, torch.Tensor] = {}
        f = None
        for part in sublayer.parts:
            if part.norm not in normed:
                normed[part.norm] = h if part.norm is None else getattr(layer, part.norm)(h)
            out = _run_part(layer, part, normed[part.norm], arguments)
            f = out if f is None else f + out
        stream.write(None, f)
    if index == runner.n_layers - 1:
        return runner.end()
    h = stream.read()  # the next layer's first read, handed on as its hidden_states
    return h


class RetrofitMixin:
    """Mixed into the source's ``XForCausalLM``: builds the residual scheme and rewires the layers."""

    config: Any  # what PreTrainedModel (the class this is mixed into) provides
    base_model_prefix: str

    _attnres_runner: _Runner | None = None

    def post_init(self):
        self._attach_attnres()
        super().post_init()  # type: ignore[misc]  # PreTrainedModel's, after this mixin

    # transformers converts some families' weights between their checkpoint layout and their modules (the
    # experts of Mixtral, Qwen2/3-MoE, DeepSeek-V3 stacked on load and split per expert on save; GPT-NeoX's
    # head renamed embed_out <-> lm_head), and finds those conversions by the source's class name or
    # model_type, which the retrofit's class ("AttnRes...") and model_type ("attnres_retrofit") are not: a
    # checkpoint saved in the source's layout would reload with those weights freshly drawn. So a retrofit
    # saves its modules' own names, which load back with no conversion in every transformers version.
    def save_pretrained(self, *args, save_original_format: bool = False, **kwargs):
        """``PreTrainedModel.save_pretrained`` under the modules' own weight names (module doc)."""
        if save_original_format:
            raise ConversionError(
                "save_original_format=True: a retrofit saves its modules' own weight names, which is what "
                "from_pretrained reads back (the source family's checkpoint layout would not reload); omit it"
            )
        return super().save_pretrained(*args, save_original_format=False, **kwargs)  # type: ignore[misc]

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """``PreTrainedModel.from_pretrained``, strict: a checkpoint with any missing, unexpected or
        re-initialised key is a :class:`ConversionError` naming the keys (transformers only logs them)."""
        return from_pretrained_strictly(super().from_pretrained, cls.__name__, *args, **kwargs)  # type: ignore[misc]

    def _attach_attnres(self) -> None:
        config = self.config
        options = getattr(config, OPTIONS)
        family = FAMILIES[options["source_model_type"]]
        base = getattr(self, self.base_model_prefix)
        layers = list(_resolve(base, family.layers))[: config.num_hidden_layers]
        sublayers = family.sublayers(config)
        n_sublayers = len(sublayers) * len(layers)
        eps = next(
            (float(getattr(config, f)) for f in _EPS_FIELDS if isinstance(getattr(config, f, None), float)), 1e-6
        )
        scheme = residual_scheme(
            options["residual"], config.hidden_size, n_sublayers, norm_eps=eps, **options.get("scheme", {})
        )
        self.attnres = scheme
        rescale = _parse_bool(options.get("rescale_reads", False), "rescale_reads")
        runner = _Runner(scheme, sublayers, len(layers), rescale)
        self.__dict__["_attnres_runner"] = runner
        for i, layer in enumerate(layers):
            signature = inspect.signature(type(layer).forward)
            as_tuple = _returns_tuple(signature)
            layer.forward = functools.partial(_layer_forward, runner, i, layer, signature, as_tuple)
        if not rescale:
            _scale_eps(family, sublayers, layers, _resolve(base, family.final_norm), scheme)

    def activation_checkpointing_enable(self, *args, **kwargs):
        raise NotImplementedError(
            "gradient checkpointing is not supported on a retrofitted model (its layers share one depth stream, "
            "which a recomputation would write twice); train without it, or convert to attnres' own format"
        )

    gradient_checkpointing_enable = activation_checkpointing_enable  # transformers' older name

    def depth_stream_scheme(self):
        """The residual scheme (``self.attnres``): queries, key norms, ``block_sizes``."""
        return self.attnres


def _scale_eps(family: Family, sublayers, layers, final_norm: nn.Module, scheme) -> None:
    """eps · c_l² on every norm that reads sublayer l's input, and on the final norm (docs/method.md §3)."""
    scales = prenorm_eps_scales(scheme, final=True)
    targets: list[tuple[nn.Module, float, str]] = []
    for i, layer in enumerate(layers):
        for k, sublayer in enumerate(sublayers):
            l = i * len(sublayers) + k  # noqa: E741
            for norm in sublayer.norms:
                if norm is not None:
                    targets.append((getattr(layer, norm), scales[l], f"layer {i}'s {norm}"))
    targets.append((final_norm, scales[-1], f"the final norm ({family.final_norm})"))
    for module, scale, where in targets:
        try:
            attribute = _eps_attribute(module, where)
        except TypeError as e:
            raise ConversionError(
                f"cannot scale the eps of {where} ({type(module).__name__}): {e}. Fix: retrofit "
                "with rescale_reads=True (reads start as the PreNorm sum, no eps change)"
            ) from None
        base = _base_eps(module, attribute)
        setattr(module, _BASE, base)
        setattr(module, attribute, base * scale)


# ----------------------------------------------------------------------------- classes per family

_CLASSES: dict[str, tuple[Any, Any]] = {}


def retrofit_classes(source_model_type: str) -> tuple[Any, Any]:
    """(config class, model class) of the retrofit of ``source_model_type``, created once and
    registered with ``AutoModelForCausalLM``."""
    if source_model_type in _CLASSES:
        return _CLASSES[source_model_type]
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    check_family(source_model_type)
    source_config: Any = CONFIG_MAPPING[source_model_type]
    source_model: Any = MODEL_FOR_CAUSAL_LM_MAPPING[source_config]
    config_cls = type(
        f"AttnRes{source_config.__name__}", (source_config,), {"model_type": MODEL_TYPE, "__module__": __name__}
    )
    model_cls = type(
        f"AttnRes{source_model.__name__}",
        (RetrofitMixin, source_model),
        {"config_class": config_cls, "__module__": __name__},
    )
    globals()[config_cls.__name__], globals()[model_cls.__name__] = config_cls, model_cls  # picklable
    AutoModelForCausalLM.register(config_cls, model_cls, exist_ok=True)
    _CLASSES[source_model_type] = (config_cls, model_cls)
    return config_cls, model_cls


def _retrofit_config_base():
    from transformers import PretrainedConfig

    class RetrofitConfig(PretrainedConfig):
        """What ``AutoConfig`` finds under ``model_type = "attnres_retrofit"``: it hands the saved
        config to the retrofit config class of the source family (``config.attnres_retrofit``)."""

        model_type = MODEL_TYPE

        @classmethod
        def from_dict(cls, config_dict, **kwargs):
            options = config_dict.get(OPTIONS)
            if not isinstance(options, dict) or "source_model_type" not in options:
                raise ConversionError(
                    f"a config with model_type={MODEL_TYPE!r} needs {OPTIONS}.source_model_type "
                    "(the family it was retrofitted from); restore the saved config.json"
                )
            config_cls, _ = retrofit_classes(options["source_model_type"])
            try:
                config = config_cls.from_dict(config_dict, **kwargs)
                # the source class's architecture checks (heads dividing the width, ...), which the derived
                # class's construction does not run; transformers versions without them have no validate
                getattr(config[0] if isinstance(config, tuple) else config, "validate", lambda: None)()
                return config
            except Exception as e:
                error = config_error("the retrofit's config.json", e)
                if error is None:
                    raise
                raise error from None

    RetrofitConfig.__module__ = __name__
    return RetrofitConfig


RetrofitConfig = _retrofit_config_base()


def register() -> None:
    """Let ``AutoConfig`` / ``AutoModelForCausalLM`` load saved retrofits (done by ``import attnres.hf``)."""
    from transformers import AutoConfig

    AutoConfig.register(MODEL_TYPE, RetrofitConfig, exist_ok=True)


# ----------------------------------------------------------------------------- retrofitting


def check_family(model_type: str) -> Family:
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    why = REFUSED.get(model_type, "its decoder layer has no layer spec in attnres.hf.retrofit.families yet")
    raise ConversionError(f"cannot retrofit model_type={model_type!r}: {why}. Supported: {', '.join(sorted(FAMILIES))}")


def check_request(config, residual: str, rescale_reads: bool, scheme: dict[str, Any]) -> Family:
    """The one-line refusals, before anything is copied."""
    family = check_family(family_name(config))
    if residual not in RESIDUALS:
        raise ConversionError(
            f"residual={residual!r}: a retrofit keeps the model's outputs only for {RESIDUALS} "
            "(the other schemes do not start as the PreNorm function)"
        )
    if scheme.get("attnres_window") is not None:
        raise ConversionError(
            "attnres_window drops sources, so the retrofit would not keep the source's outputs; retrofit without it"
        )
    if getattr(config, "add_cross_attention", False):
        raise ConversionError(
            "cannot retrofit a decoder with cross-attention (add_cross_attention=True): its "
            "third sublayer reads encoder states; use a decoder-only config"
        )
    if family.name in UNNORMALISED and residual != "prenorm" and not rescale_reads:
        raise ConversionError(
            f"cannot retrofit {family.name} exactly with zero-initialised reads: {UNNORMALISED[family.name]}. Fix: "
            "rescale_reads=True (CLI: --set rescale_reads=true) multiplies each read by its source count, so it "
            "starts as the PreNorm sum exactly"
        )
    return family


def retrofit(
    source,
    residual: str = "block",
    attnres_blocks: int | None = None,
    *,
    attnres_block_size: int | None = None,
    rescale_reads: bool = False,
    copy_weights: bool = True,
    dtype: torch.dtype | None = None,
    **scheme: Any,
):
    """Retrofit a transformers causal LM (a model object, or a local directory) into AttnRes by wrapping its
    own layers; the result computes the source's function at init (float rounding apart).

    ``residual``: "block" (``attnres_blocks`` = N or ``attnres_block_size`` = S sublayers per depth block;
    default: at most 8 blocks), "full" or "prenorm". ``rescale_reads``: the exact alternative for
    families whose sublayers read the stream un-normalised (module doc). ``copy_weights=False``: share
    the source object's tensors. ``dtype``: cast the result. ``scheme``: other scheme options by their
    ModelConfig names (``attnres_impl``, ...). Raises :class:`ConversionError` with the reason and the fix.
    """
    rescale_reads = _parse_bool(rescale_reads, "rescale_reads")  # before any weight is read
    if isinstance(source, (str, bytes)) or hasattr(source, "__fspath__"):
        from transformers import AutoModelForCausalLM

        from attnres.hf.remote_code import refuse_remote_code

        refuse_remote_code(str(source))
        try:
            source = AutoModelForCausalLM.from_pretrained(
                str(source),
                local_files_only=True,
                trust_remote_code=False,
                **({} if dtype is None else {"dtype": dtype}),
            )
        except Exception as e:
            error = config_error(f"{source}/config.json", e)
            if error is None:
                raise
            raise error from None
        copy_weights = False
    config = getattr(source, "config", None)
    if config is None or not isinstance(source, nn.Module):
        raise ConversionError(
            f"cannot retrofit a {type(source).__name__}: pass a transformers causal LM "
            "(e.g. LlamaForCausalLM) or a directory holding one"
        )
    if getattr(config, OPTIONS, None) is not None:
        raise ConversionError("the model is already retrofitted (config.attnres_retrofit is set)")
    if attnres_blocks is not None:
        scheme["attnres_blocks"] = attnres_blocks
    if attnres_block_size is not None:
        scheme["attnres_block_size"] = attnres_block_size
    family = check_request(config, residual, rescale_reads, scheme)
    if not hasattr(source, getattr(source, "base_model_prefix", "") or "-"):
        raise ConversionError(
            f"pass the causal LM (e.g. {type(source).__name__.replace('Model', 'ForCausalLM')}), "
            f"not its bare decoder {type(source).__name__}"
        )
    config_cls, model_cls = retrofit_classes(family.name)
    options = {
        "source_model_type": family.name,
        "residual": residual,
        "scheme": dict(scheme),
        "rescale_reads": rescale_reads,
    }
    new_config = config_cls.from_dict({**config.to_dict(), OPTIONS: options})
    new_config._attn_implementation = config._attn_implementation

    tensors = list(source.parameters()) + list(source.buffers())
    memo: dict[int, Any] = {} if copy_weights else {id(t): t for t in tensors}
    model: Any = copy.deepcopy(source, memo)
    old = model.config
    model.__class__ = model_cls
    for module in model.modules():
        if getattr(module, "config", None) is old:
            module.config = new_config
    model.config = new_config
    try:
        model._attach_attnres()
    except (TypeError, ValueError) as e:
        raise ConversionError(f"cannot build the residual scheme: {e}") from e
    first = next(model.parameters())
    embedding: Any = model.get_input_embeddings()
    model.attnres.to(device=first.device, dtype=embedding.weight.dtype)
    if dtype is not None:
        model = model.to(dtype)
    return model.eval()


def family_of(model) -> str:
    """The source family of a retrofitted model."""
    return getattr(model.config, OPTIONS)["source_model_type"]


@torch.no_grad()
def max_logit_difference(
    source, converted, input_ids: torch.Tensor | None = None, seed: int = 0, length: int = 32
) -> float:
    """Max |logit difference| between a source causal LM and its retrofit on ``input_ids`` (default:
    2 x ``length`` random tokens, capped at the source's context)."""
    if input_ids is None:
        config = source.config
        for c in (config, converted.config):  # the converted model's max_seq_len, where it has one
            length = min(
                length, getattr(c, "max_seq_len", None) or getattr(c, "max_position_embeddings", None) or length
            )
        gen = torch.Generator().manual_seed(seed)
        input_ids = torch.randint(0, config.vocab_size, (2, length), generator=gen)
    device = next(converted.parameters()).device
    a = source(input_ids.to(next(source.parameters()).device)).logits.double().cpu()
    b = converted(input_ids.to(device)).logits.double().cpu()
    return (a - b).abs().max().item()
