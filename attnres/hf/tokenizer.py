"""Native attnres tokenizers as Hugging Face ones, their special token ids, and the tokenizer files
that travel with a converted model directory."""

from __future__ import annotations

import shutil
from pathlib import Path

# files copied next to a converted model (tokenizer and generation defaults)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


def _byte_symbols() -> dict[int, str]:
    """The printable character byte-level BPE uses for each byte: bytes that are printable
    Latin-1 stand for themselves, the others are moved to code points from 256 upward."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAC + 1)) | set(range(0xAE, 0xFF + 1))
    symbols, shift = {}, 0
    for b in range(256):
        if b in printable:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(256 + shift)
            shift += 1
    return symbols


def special_token_ids(native) -> dict[str, int]:
    """``bos_token_id`` / ``eos_token_id`` / ``pad_token_id`` for a native attnres tokenizer, which has
    no special tokens of its own. The training stream joins documents with ``DOC_SEPARATOR``, encoded
    on its own: when that is one token (BPE) it ends each document (eos) and starts the next (bos).
    With the byte tokenizer it is two newlines, so there is no eos (generation runs to its length).
    Padding is the NUL byte: in every vocabulary, in no text, and a padded position is masked anyway."""
    from attnres.data import DOC_SEPARATOR

    ids = {"pad_token_id": native.encode("\0")[0]}
    separator = native.encode(DOC_SEPARATOR)
    if len(separator) == 1:
        ids["bos_token_id"] = ids["eos_token_id"] = separator[0]
    return ids


def hf_tokenizer(native):
    """A ``PreTrainedTokenizerFast`` that encodes and decodes exactly like a native attnres tokenizer
    (byte-level BPE, or raw UTF-8 bytes with id = byte value), with the bos / eos / pad tokens of
    :func:`special_token_ids` named (they are vocabulary tokens whose byte-level spelling, such as
    "ĊĊ", no plain text contains, so encoding is unchanged) and padding on the left, as batched
    generation wants."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from attnres.data import BPETokenizer, ByteTokenizer

    if isinstance(native, BPETokenizer):
        backend = Tokenizer.from_str(native.to_json())
    elif isinstance(native, ByteTokenizer):
        vocab = {symbol: b for b, symbol in _byte_symbols().items()}
        backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        backend.decoder = decoders.ByteLevel()
    else:
        raise TypeError(f"expected an attnres.data tokenizer, got {type(native).__name__}")
    names = {key.replace("_id", ""): backend.id_to_token(i) for key, i in special_token_ids(native).items()}
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, clean_up_tokenization_spaces=False, padding_side="left", **names
    )


def copy_tokenizer_files(source_dir, target_dir) -> list:
    """Copy the tokenizer (and generation defaults) of a HF model directory; returns the names copied."""
    copied = []
    for name in TOKENIZER_FILES:
        src = Path(source_dir) / name
        if src.is_file():
            shutil.copy2(src, Path(target_dir) / name)
            copied.append(name)
    return copied
