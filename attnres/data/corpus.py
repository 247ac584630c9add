"""Documents: the bundled Shakespeare corpus, user text, and the train/val split.

A :class:`Document` is one unit of text that is never cut across splits (a
work, a file, or one JSON-lines record).  :func:`load_documents` reads them;
:func:`split_documents` holds whole documents out for validation.
"""

from __future__ import annotations

import glob as _glob
import gzip
import hashlib
import json
import logging
import lzma
import os
import re
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "BUNDLED_CORPUS",
    "TEXT_SUFFIXES",
    "Document",
    "load_bundled_corpus",
    "load_documents",
    "split_documents",
]

#: The compressed corpus shipped inside the package (see ``corpus/SOURCE.md``).
BUNDLED_CORPUS = Path(__file__).resolve().parent / "corpus" / "shakespeare.jsonl.xz"

#: File name endings read as plain text when ``data`` is a directory.
#: ``.jsonl`` files found there are read record by record; ``.gz``/``.xz``
#: variants of all of these are decompressed.
TEXT_SUFFIXES = (".txt", ".text", ".md", ".markdown", ".rst")
_JSONL_SUFFIXES = (".jsonl",)
_COMPRESSED = (".gz", ".xz")
_GLOB_MAGIC = re.compile(r"[*?\[]")
_SPLIT_SALT = b"attnres-split-v1\0"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Document:
    """One document: a unit of text that is kept whole when splitting.

    ``group`` (optional) names the document whose split this one must share;
    documents with the same group always land in the same split.  It is used
    for works that quote each other (see ``split_documents``).
    """

    name: str
    text: str
    group: str | None = None

    @property
    def n_bytes(self) -> int:
        """Length of the text in UTF-8 bytes."""
        return len(self.text.encode("utf-8"))

    def __repr__(self) -> str:  # keep reprs short: texts are large
        return f"Document(name={self.name!r}, chars={len(self.text)})"


# --------------------------------------------------------------------------- loading


def load_bundled_corpus() -> list[Document]:
    """The complete works of Shakespeare shipped with the package, one document per work."""
    if not BUNDLED_CORPUS.is_file():
        raise FileNotFoundError(
            f"the bundled corpus {BUNDLED_CORPUS} is missing; reinstall attnres or rebuild it with "
            "scripts/build_corpus.py"
        )
    docs = []
    with lzma.open(BUNDLED_CORPUS, "rt", encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                record = json.loads(line)
                docs.append(Document(record["name"], record["text"], record.get("group")))
    return docs


def load_documents(data: str | os.PathLike | None = None) -> list[Document]:
    """Load the documents to train on.

    ``data`` may be

    * ``None``: the bundled Shakespeare corpus (42 works, one document each);
    * a text file: one document, named by its file name;
    * a ``.jsonl`` file: one document per non-blank line, each a JSON object
      with a string ``"text"`` field; named ``<file name>:<line number>``;
    * a directory: every file under it (recursively, skipping hidden files
      and folders) whose name ends in one of :data:`TEXT_SUFFIXES` or
      ``.jsonl`` (optionally ``.gz``/``.xz`` compressed), in sorted order,
      named by their path relative to the directory;
    * a glob pattern (``*``, ``?``, ``[...]``, ``**`` recursive): every file
      it matches, in sorted order, named by their path relative to the
      pattern's fixed leading folder.

    Text must be UTF-8 (a leading BOM is dropped); ``\\r\\n`` and ``\\r`` line
    endings become ``\\n``.  Empty files and records are skipped.

    Raises ``FileNotFoundError`` for a missing path or a glob matching nothing
    and ``ValueError`` for binary or non-UTF-8 data, malformed JSON lines,
    records without ``text``, and data with no text at all.
    """
    if data is None:
        return load_bundled_corpus()
    spec = os.fspath(data)
    if not spec:
        raise ValueError("data is an empty string; pass a file, directory or glob, or None for the bundled corpus")
    path = Path(spec).expanduser()

    if path.is_dir():
        files = _files_under(path)
        if not files:
            raise ValueError(
                f"directory {spec!r} holds no text files (looked for {', '.join(TEXT_SUFFIXES + _JSONL_SUFFIXES)}, "
                "also .gz/.xz); add some, or pass a glob such as "
                f"{os.path.join(spec, '**', '*')!r} to choose files by name"
            )
        docs = [d for f in files for d in _load_file(f, f.relative_to(path).as_posix())]
    elif path.is_file():
        docs = _load_file(path, path.name)
    elif _GLOB_MAGIC.search(spec):
        matches = sorted(p for p in _glob.glob(os.path.expanduser(spec), recursive=True) if os.path.isfile(p))
        if not matches:
            raise FileNotFoundError(
                f"glob {spec!r} matches no files; check the pattern (use '**' with a '/' to search subfolders) "
                "and the working directory"
            )
        root = _glob_root(os.path.expanduser(spec))
        docs = [d for m in matches for d in _load_file(Path(m), _relative_name(m, root))]
    elif path.exists():  # a FIFO would block forever, a device never ends: only regular files are read
        raise ValueError(
            f"data path {spec!r} is a {_file_kind(path)}, not a regular file or directory; pass a text/.jsonl "
            "file, a directory or a glob"
        )
    else:
        raise FileNotFoundError(
            f"data path {spec!r} does not exist; pass an existing text/.jsonl file, a directory, a glob, "
            "or leave it unset to use the bundled Shakespeare corpus"
        )

    if not docs:
        raise ValueError(
            f"data {spec!r} contains no text (all files or records are empty); point it at non-empty UTF-8 text"
        )
    return docs


def _files_under(root: Path) -> list[Path]:
    files, skipped = [], []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for fname in filenames:
            if fname.startswith("."):
                continue
            base = _strip_compression(fname.lower())
            if base.endswith(TEXT_SUFFIXES + _JSONL_SUFFIXES):
                path = Path(dirpath) / fname
                if path.is_file():  # a FIFO or device would block or never end: regular files only
                    files.append(path)
                else:
                    skipped.append(f"{path.relative_to(root).as_posix()} ({_file_kind(path)})")
    if skipped:
        log.warning(
            "data directory %s: skipped %d entries that are not regular files: %s",
            root,
            len(skipped),
            ", ".join(sorted(skipped)),
        )
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _file_kind(path: Path) -> str:
    """What a path that is not a regular file is, in words."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return "broken link"
    for test, name in (
        (stat.S_ISFIFO, "FIFO (named pipe)"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
        (stat.S_ISSOCK, "socket"),
        (stat.S_ISDIR, "directory"),
    ):
        if test(mode):
            return name
    return "special file"


def _glob_root(pattern: str) -> str:
    """The leading folders of ``pattern`` that contain no wildcard."""
    parts = Path(pattern).parts
    fixed = []
    for part in parts[:-1]:
        if _GLOB_MAGIC.search(part):
            break
        fixed.append(part)
    return str(Path(*fixed)) if fixed else "."


def _relative_name(path: str, root: str) -> str:
    try:
        return Path(os.path.relpath(path, root)).as_posix()
    except ValueError:  # different drive on Windows
        return Path(path).as_posix()


def _strip_compression(name: str) -> str:
    for suffix in _COMPRESSED:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def _read_bytes(path: Path) -> bytes:
    lower = path.name.lower()
    try:
        if lower.endswith(".gz"):
            with gzip.open(path, "rb") as fh:
                return fh.read()
        if lower.endswith(".xz"):
            with lzma.open(path, "rb") as fh:
                return fh.read()
    except (OSError, lzma.LZMAError, EOFError) as exc:
        raise ValueError(f"{path}: cannot decompress ({exc}); is it really a {path.suffix} file?") from exc
    return path.read_bytes()


def _decode(raw: bytes, where: str) -> str:
    nul = raw.find(b"\0")
    if nul >= 0:
        raise ValueError(
            f"{where} looks binary (NUL byte at offset {nul}); data must be UTF-8 text files — "
            "remove or exclude this file (e.g. pass a glob that matches only the text files)"
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"{where} is not valid UTF-8 (bad byte {raw[exc.start]:#04x} at offset {exc.start}); "
            "convert it to UTF-8 (e.g. `iconv -f latin1 -t utf-8`) or exclude it"
        ) from None
    if text.startswith("\ufeff"):
        text = text[1:]
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _load_file(path: Path, name: str) -> list[Document]:
    base = _strip_compression(path.name.lower())
    raw = _read_bytes(path)
    if base.endswith(_JSONL_SUFFIXES):
        return _parse_jsonl(_decode(raw, str(path)), path, name)
    text = _decode(raw, str(path))
    return [Document(name, text)] if text else []


def _parse_jsonl(content: str, path: Path, name: str) -> list[Document]:
    docs = []
    for lineno, line in enumerate(content.split("\n"), start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(
                f'{where} is not valid JSON ({exc.msg}); each line must be an object like {{"text": "..."}}'
            ) from None
        if not isinstance(record, dict) or "text" not in record:
            keys = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise ValueError(
                f'{where} has no "text" field (got {keys}); each line of a .jsonl data file must be '
                'a JSON object like {"text": "..."}'
            )
        text = record["text"]
        if not isinstance(text, str):
            raise ValueError(f'{where}: "text" is a {type(text).__name__}, not a string')
        if "\0" in text:
            raise ValueError(f"{where}: text contains NUL characters; data must be plain text")
        text = text.replace("\r\n", "\n").replace("\r", "\n")
        if text:
            docs.append(Document(f"{name}:{lineno}", text))
    return docs


# --------------------------------------------------------------------------- splitting


def _split_key(key: str) -> int:
    """A stable 64-bit sort key for ``key`` (unlike ``hash``, the same in every process)."""
    return int.from_bytes(hashlib.sha256(_SPLIT_SALT + key.encode("utf-8")).digest()[:8], "big")


def split_documents(docs: Sequence[Document], val_fraction: float = 0.1) -> tuple[list[Document], list[Document]]:
    """Split documents into ``(train_docs, val_docs)``, holding out whole documents.

    The choice is deterministic and depends only on the documents, never on
    their order or on a random seed:

    * **Two or more documents.**  Documents are bundled into units: those
      with the same ``group`` (default: their own name) and those with
      identical text form one unit, so no text can end up in both splits.
      Units are ordered by a SHA-256 hash of their key (the smallest group
      name in the unit), and taken for validation in that order until the
      validation text reaches ``val_fraction`` of all characters.  Both
      splits always get at least one unit, so with units of very different
      sizes the held-out fraction can differ from ``val_fraction``.  Each
      split keeps the documents' input order.
    * **One document** (e.g. a single text file).  Its contiguous tail is
      held out: the cut goes at the first line break at or after
      ``(1 - val_fraction)`` of its characters (or else the last line break
      before it; a text with no line break is cut at that character).  The
      parts are named ``<name>#train`` and ``<name>#val``.  The cut keeps a
      non-empty part on each side.

    ``val_fraction`` must be strictly between 0 and 1.
    """
    if not 0.0 < float(val_fraction) < 1.0:
        raise ValueError(f"val_fraction must be strictly between 0 and 1, got {val_fraction}")
    docs = list(docs)
    if not docs:
        raise ValueError("no documents to split; load some data first")
    if len(docs) == 1:
        return _split_tail(docs[0], val_fraction)

    units = _units(docs)
    if len(units) == 1:
        raise ValueError(
            f"all {len(docs)} documents are copies of one text or share one group, so whole documents cannot "
            "be held out without leaking; supply more distinct documents or a single file to split by lines"
        )
    order = sorted(range(len(units)), key=lambda u: (_split_key(units[u][0]), units[u][0]))
    total = sum(len(docs[i].text) for _, members in units for i in members)
    target = float(val_fraction) * total
    val_units: set[int] = set()
    held = 0
    for u in order[:-1]:  # the last unit in hash order always stays in training
        if val_units and held >= target:
            break
        val_units.add(u)
        held += sum(len(docs[i].text) for i in units[u][1])
    val_idx = {i for u in val_units for i in units[u][1]}
    train = [d for i, d in enumerate(docs) if i not in val_idx]
    val = [d for i, d in enumerate(docs) if i in val_idx]
    return train, val


def _units(docs: Sequence[Document]) -> list[tuple[str, list[int]]]:
    """Union documents sharing a group or an identical text; return (key, member indices)."""
    parent = list(range(len(docs)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    def union(i: int, j: int) -> None:
        ri, rj = find(i), find(j)
        if ri != rj:
            parent[max(ri, rj)] = min(ri, rj)

    first_by: dict[tuple[str, str], int] = {}
    for i, doc in enumerate(docs):
        for kind, value in (("group", doc.group or doc.name), ("text", hashlib.sha256(doc.text.encode()).hexdigest())):
            j = first_by.setdefault((kind, value), i)
            if j != i:
                union(i, j)
    members: dict[int, list[int]] = {}
    for i in range(len(docs)):
        members.setdefault(find(i), []).append(i)
    return [(min(docs[i].group or docs[i].name for i in idx), idx) for idx in members.values()]


def _split_tail(doc: Document, val_fraction: float) -> tuple[list[Document], list[Document]]:
    text = doc.text
    if len(text) < 2:
        raise ValueError(
            f"document {doc.name!r} has {len(text)} character(s): too short to split into training and "
            "validation; supply more text"
        )
    target = min(max(int(round(len(text) * (1.0 - float(val_fraction)))), 1), len(text) - 1)
    cut = text.find("\n", target - 1)  # a cut just after a '\n' at index >= target - 1
    if cut == -1 or cut + 1 >= len(text):
        cut = text.rfind("\n", 0, target - 1)
    cut = cut + 1 if cut != -1 else target
    if not 0 < cut < len(text):
        cut = target
    return [Document(f"{doc.name}#train", text[:cut], doc.group)], [Document(f"{doc.name}#val", text[cut:], doc.group)]
