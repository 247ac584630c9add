"""The error every conversion raises: a feature the target cannot express, or an inconsistent request;
and the check that turns transformers' load report into that error (a checkpoint loads whole or not at all)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any


class ConversionError(ValueError):
    """The source model uses something the target does not have (or the request is inconsistent)."""


# transformers' load report (from_pretrained(..., output_loading_info=True)): what each list means for the model
_LOAD_PROBLEMS = (
    ("missing_keys", "missing (they would start at random)"),
    ("unexpected_keys", "unexpected (they would be dropped)"),
    ("mismatched_keys", "of another shape (they would be re-initialised)"),
)
SHOWN_KEYS = 8  # the names an error lists per kind before it says how many more


def _key_name(entry: Any) -> str:
    # mismatched_keys entries are (name, checkpoint shape, model shape) in some transformers versions
    return str(entry[0]) if isinstance(entry, (tuple, list)) and entry else str(entry)


def _listed(keys: Iterable[str]) -> str:
    keys = sorted(keys)
    shown = ", ".join(keys[:SHOWN_KEYS])
    return shown + (f" and {len(keys) - SHOWN_KEYS} more" if len(keys) > SHOWN_KEYS else "")


def check_loading_info(source: Any, info: Mapping[str, Any], model_name: str) -> None:
    """ConversionError naming every key transformers did not load exactly (missing, unexpected, of another
    shape) or the errors it collected; nothing when the checkpoint matched the model whole. transformers
    only logs these and hands back a model with those weights freshly drawn, which computes another
    function without a word."""
    parts = []
    for field, meaning in _LOAD_PROBLEMS:
        keys = {_key_name(k) for k in info.get(field) or ()}
        if field == "missing_keys":  # a residual scheme's record, absent from directories saved before it: the
            keys = {k for k in keys if not k.endswith("._extra_state")}  # config's settings hold (residual.record)
        if keys:
            parts.append(f"{len(keys)} {meaning}: {_listed(keys)}")
    errors = [str(e).strip().replace("\n", " ") for e in info.get("error_msgs") or () if str(e).strip()]
    if errors:
        parts.append(f"load errors: {'; '.join(errors[:SHOWN_KEYS])}")
    if parts:
        raise ConversionError(
            f"{source} does not hold the weights of the {model_name} its config.json describes: "
            f"{'; '.join(parts)}. Fix: load the directory as it was saved (restore its weight files and "
            "config.json), or convert the source model again"
        )


@contextlib.contextmanager
def quiet_load_report() -> Iterator[None]:
    """transformers' load report (a table logged as a warning, with "UNEXPECTED: can be ignored") held back
    while a loader that checks the report itself runs: every key in it is then either refused in one line,
    naming it, or one the loader places itself or knows to be absent (a scheme record older directories
    lack). When transformers raises instead (a weight conversion that failed), its error points at the
    report, which is then logged after all."""
    from transformers.utils import logging as hf_logging

    logger = hf_logging.get_logger("transformers.modeling_utils")
    held: list[logging.LogRecord] = []

    class Hold(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            held.append(record)
            return False

    hold = Hold()
    logger.addFilter(hold)
    try:
        yield
    except BaseException:
        logger.removeFilter(hold)
        for record in held:
            logger.handle(record)
        raise
    finally:
        logger.removeFilter(hold)


def from_pretrained_strictly(load: Callable[..., Any], model_name: str, *args: Any, **kwargs: Any) -> Any:
    """``load(*args, **kwargs)`` (a ``from_pretrained``) that refuses any checkpoint not matching the model
    whole (:func:`check_loading_info`); returns what ``load`` returns for the caller's
    ``output_loading_info``."""
    want_info = kwargs.pop("output_loading_info", False)
    # a shape mismatch then comes back in the report, named, instead of transformers' RuntimeError that
    # points at a log; the check below refuses it all the same
    kwargs["ignore_mismatched_sizes"] = True
    with quiet_load_report():
        model, info = load(*args, output_loading_info=True, **kwargs)
    source = args[0] if args else kwargs.get("pretrained_model_name_or_path")
    check_loading_info(source, info, model_name)
    return (model, info) if want_info else model


def config_error(config_file: Any, e: BaseException) -> ConversionError | None:
    """The one-line error for a config.json that transformers refuses (a field of the wrong type, such as a
    layer count written as a text, or an architecture that does not add up, such as heads not dividing the
    width); None for any other exception. transformers' configs validate through huggingface_hub's strict
    dataclasses, whose StrictDataclassError is no ValueError and would end in a traceback."""
    if not any(c.__name__ == "StrictDataclassError" for c in type(e).__mro__):
        return None
    detail = " ".join(str(e).split()).rstrip(".")
    return ConversionError(
        f"{config_file} is invalid: {detail}. Fix: correct that value (or restore the model "
        "directory's own config.json)"
    )
