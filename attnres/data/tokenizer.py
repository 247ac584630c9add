"""Tokenizers: raw UTF-8 bytes, or byte-level BPE trained with HF ``tokenizers``.

Both share one small interface (:class:`Tokenizer`): ``encode``, ``decode``,
``vocab_size``, ``name``, ``save``/``load``.  Both are lossless: for any
string ``s``, ``decode(encode(s)) == s``.  Neither adds special tokens;
documents are joined with plain text (see ``attnres.data.dataset``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from pathlib import Path

from attnres.files import atomic_write_bytes

__all__ = [
    "Tokenizer",
    "ByteTokenizer",
    "BPETokenizer",
    "train_bpe",
    "build_tokenizer",
    "load_tokenizer",
    "default_cache_dir",
]

log = logging.getLogger(__name__)

_BYTE_FORMAT = "attnres-byte-tokenizer"
_BPE_CACHE_VERSION = b"attnres-bpe-v1\0"


def default_cache_dir() -> Path:
    """``$ATTNRES_CACHE`` if set, else ``~/.cache/attnres``."""
    env = os.environ.get("ATTNRES_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "attnres"


class Tokenizer(ABC):
    """Common interface of the tokenizers."""

    #: short human-readable id, e.g. ``"byte"`` or ``"bpe4096"``
    name: str

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of token ids; every id is in ``range(vocab_size)``."""

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``."""

    @abstractmethod
    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids`` (exact inverse of :meth:`encode` on whole sequences)."""

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Encode several texts (the BPE tokenizer does this in parallel)."""
        return [self.encode(t) for t in texts]

    @abstractmethod
    def to_json(self) -> str:
        """The JSON that :meth:`save` writes."""

    def save(self, path: str | os.PathLike) -> Path:
        """Write the tokenizer to a JSON file (atomically) that :func:`load_tokenizer` reads."""
        path = Path(path)
        atomic_write_bytes(path, self.to_json().encode("utf-8"))
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> Tokenizer:
        """Read a tokenizer written by :meth:`save`."""
        tok = load_tokenizer(path)
        if not isinstance(tok, cls):
            raise ValueError(f"{path} holds a {type(tok).__name__}, not a {cls.__name__}")
        return tok

    @property
    def digest(self) -> str:
        """SHA-256 of the serialised tokenizer: equal digests encode identically."""
        cached = getattr(self, "_digest", None)
        if cached is None:
            cached = hashlib.sha256(self.to_json().encode("utf-8")).hexdigest()
            self._digest = cached
        return cached

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, vocab_size={self.vocab_size})"


class ByteTokenizer(Tokenizer):
    """Token id = one UTF-8 byte (vocabulary 256)."""

    name = "byte"

    @property
    def vocab_size(self) -> int:
        return 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        # A sequence cut inside a multi-byte character decodes with U+FFFD.
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def to_json(self) -> str:
        return json.dumps({"format": _BYTE_FORMAT, "version": 1})

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ByteTokenizer)

    def __hash__(self) -> int:
        return hash(ByteTokenizer)


class BPETokenizer(Tokenizer):
    """Byte-level BPE (GPT-2 style) backed by a HF ``tokenizers.Tokenizer``.

    Text is split with the ByteLevel pre-tokenizer (no prefix space, no
    normalisation), so every byte is representable and decoding restores the
    exact input.  Train one with :func:`train_bpe` or :func:`build_tokenizer`.
    """

    def __init__(self, hf_tokenizer) -> None:
        self.hf = hf_tokenizer
        self._vocab_size = int(hf_tokenizer.get_vocab_size(with_added_tokens=True))
        self.name = f"bpe{self._vocab_size}"
        #: the cache file it was loaded from or saved to by build_tokenizer, if any
        self.path: Path | None = None

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.hf.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=False)

    def to_json(self) -> str:
        return self.hf.to_str()

    @classmethod
    def from_json(cls, payload: str) -> BPETokenizer:
        from tokenizers import Tokenizer as HFTokenizer

        return cls(HFTokenizer.from_str(payload))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BPETokenizer) and other.digest == self.digest

    def __hash__(self) -> int:
        return hash(self.digest)


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Read a tokenizer saved by :meth:`Tokenizer.save` (byte or BPE)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer file {path} does not exist")
    payload = path.read_text(encoding="utf-8")
    try:
        obj = json.loads(payload)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not a tokenizer JSON file ({exc.msg})") from None
    if isinstance(obj, dict) and obj.get("format") == _BYTE_FORMAT:
        return ByteTokenizer()
    if isinstance(obj, dict) and isinstance(obj.get("model"), dict):
        tok = BPETokenizer.from_json(payload)
        tok.path = path
        return tok
    raise ValueError(f"{path} is neither an attnres byte tokenizer nor a HF tokenizers JSON file")


def train_bpe(texts: Iterable[str], vocab_size: int = 4096, min_frequency: int = 2) -> BPETokenizer:
    """Train a byte-level BPE tokenizer on ``texts`` (held in memory).

    The 256 byte symbols are always in the vocabulary, so any text encodes.
    The result can have fewer than ``vocab_size`` tokens if the texts run
    out of pairs seen ``min_frequency`` times.
    """
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if vocab_size < 256:
        raise ValueError(
            f"a byte-level BPE vocabulary needs at least the 256 byte symbols; got vocab_size={vocab_size}"
        )
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        show_progress=False,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    hf.train_from_iterator(texts, trainer=trainer)
    return BPETokenizer(hf)


def _bpe_cache_key(texts: Sequence[str], vocab_size: int, min_frequency: int) -> str:
    h = hashlib.sha256(_BPE_CACHE_VERSION)
    h.update(f"vocab_size={vocab_size};min_frequency={min_frequency};n={len(texts)}\0".encode())
    for text in texts:
        raw = text.encode("utf-8")
        h.update(len(raw).to_bytes(8, "little"))
        h.update(raw)
    return h.hexdigest()


def build_tokenizer(
    kind: str,
    train_docs: Sequence = (),
    vocab_size: int = 4096,
    cache_dir: str | os.PathLike | None = None,
    min_frequency: int = 2,
) -> Tokenizer:
    """Make the tokenizer for a run.

    ``kind="byte"`` returns a :class:`ByteTokenizer` (nothing to train).
    ``kind="bpe"`` trains byte-level BPE on the texts of ``train_docs``
    (documents or strings: pass the TRAINING split only), or reuses the copy
    cached in ``<cache_dir>/tokenizers/`` under a hash of those texts and the
    settings.  ``cache_dir`` defaults to :func:`default_cache_dir`.
    """
    kind = str(kind).lower()
    if kind == "byte":
        return ByteTokenizer()
    if kind != "bpe":
        raise ValueError(f"unknown tokenizer kind {kind!r}; use 'bpe' or 'byte'")
    texts = [d if isinstance(d, str) else d.text for d in train_docs]
    if not any(texts):
        raise ValueError("cannot train a BPE tokenizer on no text; pass the training documents")
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    key = _bpe_cache_key(texts, vocab_size, min_frequency)
    path = cache / "tokenizers" / f"bpe{vocab_size}-{key[:20]}.json"
    if path.is_file():
        try:
            tok = load_tokenizer(path)
            if isinstance(tok, BPETokenizer):
                log.info("reusing cached BPE tokenizer %s", path)
                return tok
        except Exception as exc:  # a damaged cache entry is rebuilt
            log.warning("ignoring unreadable cached tokenizer %s: %s", path, exc)
    start = time.perf_counter()
    tok = train_bpe(texts, vocab_size=vocab_size, min_frequency=min_frequency)
    log.info("trained BPE tokenizer (%d tokens) in %.1fs", tok.vocab_size, time.perf_counter() - start)
    tok.save(path)
    tok.path = path
    return tok
