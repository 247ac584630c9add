"""Encoded splits on disk, deterministic batches, and bits per byte.

:func:`prepare_data` loads the documents, splits them by document, builds the
tokenizer on the training split, and encodes each split once into a
``numpy.memmap`` cached under ``<cache_dir>/tokens/``.

Layout of an encoded split: the documents' token ids, in split order, with
the ids of :data:`DOC_SEPARATOR` (``"\\n\\n"``) between consecutive documents
(not before the first or after the last).  Documents are encoded one by one,
so no token spans two documents, and decoding the whole array gives exactly
``DOC_SEPARATOR.join(texts)``.  ``n_bytes`` counts the UTF-8 bytes of that
joined text (separators included).

Batches are pure functions of their arguments: :func:`sample_batch` draws
windows with a generator seeded only by ``seed``, so a resumed run that
passes the same seeds sees the same data.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from attnres.files import atomic_write_bytes, atomic_writer

from .corpus import Document, load_documents, split_documents
from .tokenizer import Tokenizer, build_tokenizer, default_cache_dir

__all__ = [
    "DOC_SEPARATOR",
    "TokenData",
    "PreparedData",
    "token_dtype",
    "encode_documents",
    "prepare_data",
    "documents_digest",
    "check_length",
    "batch_seed",
    "sample_batch",
    "eval_batches",
    "count_eval_batches",
    "bits_per_byte",
]

log = logging.getLogger(__name__)

#: Text put between consecutive documents of a split.
DOC_SEPARATOR = "\n\n"

_CACHE_VERSION = b"attnres-tokens-v1\0"
_ENCODE_CHUNK_CHARS = 8 << 20  # encode about this many characters at a time


def token_dtype(vocab_size: int) -> np.dtype:
    """``uint16`` when every id fits (``vocab_size <= 65535``), else ``uint32``."""
    return np.dtype(np.uint16) if vocab_size <= 65535 else np.dtype(np.uint32)


@dataclass
class TokenData:
    """One encoded split.

    ``tokens`` is a read-only 1-D ``numpy.memmap`` (a plain array when the
    split is empty or was not cached); ``n_bytes`` is the number of UTF-8
    bytes of the text it encodes, so ``bytes_per_token = n_bytes / len(tokens)``.
    """

    split: str
    tokens: np.ndarray
    n_bytes: int
    doc_names: list[str] = field(default_factory=list)
    path: Path | None = None
    source: str = ""
    docs_digest: str = ""  # documents_digest of the documents it encodes

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def n_tokens(self) -> int:
        return len(self)

    @property
    def bytes_per_token(self) -> float:
        """Average UTF-8 bytes per token over the whole split."""
        if len(self) == 0:
            raise ValueError(f"the {self.split} split has no tokens")
        return self.n_bytes / len(self)

    def __repr__(self) -> str:
        bpt = f"{self.n_bytes / len(self):.3f}" if len(self) else "n/a"
        return (
            f"TokenData(split={self.split!r}, n_tokens={len(self)}, n_bytes={self.n_bytes}, "
            f"bytes_per_token={bpt}, docs={len(self.doc_names)})"
        )


class PreparedData(NamedTuple):
    """What :func:`prepare_data` returns; unpacks as a tuple too."""

    tokenizer: Tokenizer
    train: TokenData
    val: TokenData
    train_names: list[str]
    val_names: list[str]

    @property
    def data_digest(self) -> str:
        """SHA-256 of both splits' documents (names and texts): a resumed run checks it to notice
        changed data."""
        return hashlib.sha256(f"{self.train.docs_digest}:{self.val.docs_digest}".encode()).hexdigest()


# --------------------------------------------------------------------------- encoding and caching


def documents_digest(docs: Sequence[Document]) -> str:
    """SHA-256 of the documents' names and texts, in order: equal digests mean the same data."""
    h = hashlib.sha256(b"attnres-documents-v1\0")
    for doc in docs:
        for part in (doc.name.encode("utf-8"), doc.text.encode("utf-8")):
            h.update(len(part).to_bytes(8, "little"))
            h.update(part)
    return h.hexdigest()


def _tokens_cache_key(docs: Sequence[Document], tokenizer: Tokenizer) -> str:
    h = hashlib.sha256(_CACHE_VERSION)
    h.update(f"tokenizer={tokenizer.digest};sep={DOC_SEPARATOR!r};n={len(docs)}\0".encode())
    for doc in docs:
        raw = doc.text.encode("utf-8")
        h.update(len(raw).to_bytes(8, "little"))
        h.update(raw)
    return h.hexdigest()


def _chunks(docs: Sequence[Document]) -> Iterator[list[Document]]:
    chunk: list[Document] = []
    size = 0
    for doc in docs:
        chunk.append(doc)
        size += len(doc.text)
        if size >= _ENCODE_CHUNK_CHARS:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def _write_tokens(fh, docs: Sequence[Document], tokenizer: Tokenizer, dtype: np.dtype) -> int:
    sep = np.asarray(tokenizer.encode(DOC_SEPARATOR), dtype=dtype)
    n = 0
    first = True
    for chunk in _chunks(docs):
        for ids in tokenizer.encode_batch([d.text for d in chunk]):
            if not first:
                sep.tofile(fh)
                n += sep.size
            first = False
            arr = np.asarray(ids, dtype=np.int64)
            if arr.size and (arr.min() < 0 or arr.max() >= tokenizer.vocab_size):
                raise ValueError(f"tokenizer {tokenizer.name} produced ids outside [0, {tokenizer.vocab_size})")
            arr.astype(dtype).tofile(fh)
            n += arr.size
    return n


def _n_bytes(docs: Sequence[Document]) -> int:
    if not docs:
        return 0
    return sum(d.n_bytes for d in docs) + len(DOC_SEPARATOR.encode("utf-8")) * (len(docs) - 1)


def encode_documents(
    docs: Sequence[Document],
    tokenizer: Tokenizer,
    split: str,
    cache_dir: str | os.PathLike | None = None,
    source: str = "",
) -> TokenData:
    """Encode ``docs`` (one split) into a cached memmap, or reuse the cached one.

    The cache file ``<cache_dir>/tokens/<split>-<tokenizer>-<key>.bin`` is
    keyed by a hash of the tokenizer and the texts; it is written to a temp
    file and moved into place, and its ``.json`` sidecar (written last)
    marks it complete.
    """
    docs = list(docs)
    names = [d.name for d in docs]
    dtype = token_dtype(tokenizer.vocab_size)
    n_bytes = _n_bytes(docs)
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    key = _tokens_cache_key(docs, tokenizer)
    stem = f"{split}-{tokenizer.name}-{key[:20]}"
    bin_path = cache / "tokens" / f"{stem}.bin"
    meta_path = cache / "tokens" / f"{stem}.json"

    tokens = _open_cached(bin_path, meta_path, key, dtype, tokenizer.vocab_size)
    if tokens is None:
        start = time.perf_counter()
        with atomic_writer(bin_path) as fh:
            n_tokens = _write_tokens(fh, docs, tokenizer, dtype)
        meta = {
            "sha256": _file_sha256(bin_path),
            "key": key,
            "split": split,
            "tokenizer": tokenizer.name,
            "tokenizer_digest": tokenizer.digest,
            "dtype": dtype.name,
            "n_tokens": n_tokens,
            "n_bytes": n_bytes,
            "separator": DOC_SEPARATOR,
            "doc_names": names,
        }
        atomic_write_bytes(meta_path, json.dumps(meta, indent=1).encode("utf-8"))
        log.info("encoded %s split: %d tokens in %.1fs -> %s", split, n_tokens, time.perf_counter() - start, bin_path)
        tokens = _open_cached(bin_path, meta_path, key, dtype, tokenizer.vocab_size)
        if tokens is None:
            raise RuntimeError(f"the token cache {bin_path} was written but cannot be read back")
    else:
        log.info("reusing cached %s tokens %s", split, bin_path)
    return TokenData(
        split=split,
        tokens=tokens,
        n_bytes=n_bytes,
        doc_names=names,
        path=bin_path,
        source=source,
        docs_digest=documents_digest(docs),
    )


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _open_cached(bin_path: Path, meta_path: Path, key: str, dtype: np.dtype, vocab_size: int) -> np.ndarray | None:
    """The cached tokens, or None when there are none or they cannot be trusted: a cache is used
    only when its size and sha256 match its sidecar and every id is below ``vocab_size`` (a
    damaged cache is re-encoded, with a warning, instead of feeding out-of-range ids to the model)."""
    if not (bin_path.is_file() and meta_path.is_file()):
        return None
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        n_tokens = int(meta["n_tokens"])
        if meta.get("key") != key or meta.get("dtype") != dtype.name or "sha256" not in meta:
            return None  # another encoding, or written before caches carried a hash
        problem = None
        if bin_path.stat().st_size != n_tokens * dtype.itemsize:
            problem = "has the wrong size"
        elif _file_sha256(bin_path) != meta["sha256"]:
            problem = "does not match the sha256 recorded beside it"
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if problem is None and n_tokens == 0:
        return np.zeros(0, dtype=dtype)  # an empty file cannot be memory-mapped
    tokens = None if problem else np.memmap(bin_path, dtype=dtype, mode="r", shape=(n_tokens,))
    if tokens is not None and int(tokens.max()) >= vocab_size:
        problem = f"holds ids >= the vocabulary size {vocab_size}"
        tokens = None
    if problem:
        log.warning("token cache %s %s; re-encoding it", bin_path, problem)
    return tokens


def prepare_data(
    data: str | os.PathLike | None = None,
    tokenizer: str | Tokenizer = "bpe",
    vocab_size: int = 4096,
    val_fraction: float = 0.1,
    cache_dir: str | os.PathLike | None = None,
) -> PreparedData:
    """Load, split, tokenize and encode; everything expensive is cached.

    * ``data``: see :func:`attnres.data.load_documents` (``None`` = bundled
      Shakespeare).
    * ``tokenizer``: ``"bpe"`` (trained on the training split, cached),
      ``"byte"``, or a ready :class:`Tokenizer` (e.g. one restored from a
      checkpoint, so a resumed run encodes exactly as before).
    * ``val_fraction``: see :func:`attnres.data.split_documents`.
    * ``cache_dir``: defaults to ``$ATTNRES_CACHE`` or ``~/.cache/attnres``.
    """
    docs = load_documents(data)
    train_docs, val_docs = split_documents(docs, val_fraction)
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    if isinstance(tokenizer, Tokenizer):
        tok = tokenizer
    else:
        tok = build_tokenizer(tokenizer, train_docs, vocab_size=vocab_size, cache_dir=cache)
    source = "the bundled Shakespeare corpus" if data is None else repr(os.fspath(data))
    train = encode_documents(train_docs, tok, "train", cache, source)
    val = encode_documents(val_docs, tok, "val", cache, source)
    return PreparedData(tok, train, val, train.doc_names, val.doc_names)


def check_length(token_data: TokenData, seq_len: int) -> None:
    """Raise ``ValueError`` unless the split holds one window (``seq_len + 1`` tokens)."""
    need = int(seq_len) + 1
    n = len(token_data)
    if n < need:
        where = f" of {token_data.source}" if token_data.source else ""
        hint = "a larger val_fraction, " if token_data.split == "val" else "a smaller val_fraction, "
        raise ValueError(
            f"the {token_data.split} split{where} has only {n} tokens, but seq_len={seq_len} needs at least "
            f"{need}; use a shorter seq_len, {hint}or more data"
        )


# --------------------------------------------------------------------------- batches


def _as_array(tokens) -> np.ndarray:
    if isinstance(tokens, TokenData):
        return tokens.tokens
    if isinstance(tokens, torch.Tensor):
        return tokens.detach().cpu().numpy()
    return tokens


def batch_seed(run_seed: int, step: int, micro_step: int = 0) -> int:
    """A 63-bit seed for :func:`sample_batch` derived from (run seed, step, micro-step).

    Uses ``numpy.random.SeedSequence`` so nearby inputs give unrelated seeds
    (unlike ``run_seed + step``).  All inputs must be non-negative integers.
    """
    ss = np.random.SeedSequence([int(run_seed), int(step), int(micro_step)])
    return int(ss.generate_state(1, dtype=np.uint64)[0] >> np.uint64(1))


def sample_batch(tokens, batch_size: int, seq_len: int, seed) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch_size`` random windows: ``x`` and ``y = x`` shifted by one, int64 ``[batch_size, seq_len]``.

    Window starts are drawn uniformly from ``[0, len(tokens) - seq_len - 1]``
    by ``numpy.random.default_rng(seed)``, so the batch depends on ``seed``
    (a non-negative int, or a sequence of them) and nothing else — no global
    RNG state.  ``tokens`` is a 1-D array/memmap, a tensor, or a
    :class:`TokenData`.
    """
    arr = _as_array(tokens)
    n = int(arr.shape[0])
    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"batch_size and seq_len must be positive, got {batch_size} and {seq_len}")
    if n < seq_len + 1:
        if isinstance(tokens, TokenData):
            check_length(tokens, seq_len)
        raise ValueError(f"only {n} tokens, but a window of seq_len={seq_len} needs {seq_len + 1}")
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, n - seq_len, size=batch_size, dtype=np.int64)
    window = np.asarray(arr[starts[:, None] + np.arange(seq_len + 1, dtype=np.int64)], dtype=np.int64)
    return torch.from_numpy(window[:, :-1].copy()), torch.from_numpy(window[:, 1:].copy())


def count_eval_batches(n_tokens: int, batch_size: int, seq_len: int, max_batches: int | None = None) -> int:
    """How many batches :func:`eval_batches` yields."""
    windows = max(int(n_tokens) - 1, 0) // seq_len
    batches = -(-windows // batch_size)
    return batches if max_batches is None else min(batches, int(max_batches))


def eval_batches(
    tokens, batch_size: int, seq_len: int, max_batches: int | None = None
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Contiguous, non-overlapping windows covering the split from its start.

    Window ``i`` is ``x = tokens[i*seq_len : (i+1)*seq_len]`` with targets
    ``y = tokens[i*seq_len + 1 : (i+1)*seq_len + 1]``; there are
    ``(len(tokens) - 1) // seq_len`` windows, so every token but the first
    is a target exactly once, except a final remainder shorter than
    ``seq_len``, which is dropped.  Windows are grouped ``batch_size`` at a
    time in order; the last batch may be smaller, so average losses weighted
    by ``y.numel()``.  ``max_batches`` stops early (the first batches only).
    """
    arr = _as_array(tokens)
    n = int(arr.shape[0])
    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"batch_size and seq_len must be positive, got {batch_size} and {seq_len}")
    if n < seq_len + 1:
        if isinstance(tokens, TokenData):
            check_length(tokens, seq_len)
        raise ValueError(f"only {n} tokens, but a window of seq_len={seq_len} needs {seq_len + 1}")
    windows = (n - 1) // seq_len
    offsets = np.arange(seq_len + 1, dtype=np.int64)
    for b, first in enumerate(range(0, windows, batch_size)):
        if max_batches is not None and b >= max_batches:
            return
        starts = np.arange(first, min(first + batch_size, windows), dtype=np.int64) * seq_len
        window = np.asarray(arr[starts[:, None] + offsets], dtype=np.int64)
        yield torch.from_numpy(window[:, :-1].copy()), torch.from_numpy(window[:, 1:].copy())


# --------------------------------------------------------------------------- metrics


def bits_per_byte(loss_nats_per_token, bytes_per_token):
    """Convert a mean cross-entropy in nats per token to bits per UTF-8 byte.

    ``bpb = loss / ln(2) / bytes_per_token``: dividing by ln 2 turns nats into
    bits per token, and dividing by the split's average bytes per token
    (``TokenData.bytes_per_token``) spreads them over the bytes those tokens
    encode.  This makes models with different tokenizers comparable (for the
    byte tokenizer ``bytes_per_token`` is 1).  Works on floats and tensors.
    """
    if isinstance(bytes_per_token, (int, float)) and not bytes_per_token > 0:
        raise ValueError(f"bytes_per_token must be positive, got {bytes_per_token}")
    return loss_nats_per_token / math.log(2) / bytes_per_token
