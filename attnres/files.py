"""Files on disk: atomic writes, the names inside a run directory, and TOML.

Atomic writes go to a temp file beside the target, are fsynced and then moved
onto it with ``os.replace``: a reader sees the old file or the complete new
one, never half a file, and a crash leaves no partial target behind.

A run directory (what ``attnres train`` writes to ``--out``)::

    config.json      the model and training configs            CONFIG_FILE
    metrics.jsonl    one JSON row per logged step              METRICS_FILE
    tokenizer.json   the tokenizer the run trained with        TOKENIZER_FILE
    checkpoint/      the latest checkpoint (attnres.checkpoint) CHECKPOINT_DIR
    summary.json     written last, when training finished      SUMMARY_FILE
    .lock            held (flock) by the one process writing it LOCK_FILE
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO, TextIO

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
TOKENIZER_FILE = "tokenizer.json"
CHECKPOINT_DIR = "checkpoint"
SUMMARY_FILE = "summary.json"
LOSS_PLOT = "loss.png"  # train / validation curves of the run
DEPTH_WEIGHTS_FILE = "depth_weights.json"  # the final model's mean depth weights on a validation batch
DEPTH_PLOT = "depth_weights.png"
LOCK_FILE = ".lock"


# ----------------------------------------------------------------------------- atomic writes


def file_mode() -> int:
    """The mode ``open()`` gives a new file under the process's umask (0644 under the usual 022): for
    files whose writer picks a private mode (mkstemp, safetensors' 0600)."""
    return 0o666 & ~_umask()


def _umask() -> int:
    umask = os.umask(0o022)  # the only way to read it is to set it
    os.umask(umask)
    return umask


@contextlib.contextmanager
def atomic_writer(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """Open a temp file beside ``path``; on success fsync it and move it onto ``path``.

    Readers see either the old file or the complete new one, never a partial
    write; on error the temp file is removed.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, file_mode())  # mkstemp makes 0600 files
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """A fresh temp path beside ``path`` for a writer that opens files by name (GGUF's); on success the
    file there gets the umask's mode, is fsynced and moved onto ``path``; on error it is removed and
    ``path`` keeps what it held."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:12]}.tmp"
    try:
        yield tmp
        if not tmp.is_file():
            raise FileNotFoundError(f"the writer of {path} left no file at {tmp}")
        os.chmod(tmp, file_mode())
        fsync_path(tmp)
        os.replace(tmp, path)
        fsync_path(path.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (so that a rename into it is durable); a no-op where the platform cannot."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # a directory on Windows
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# hidden siblings of a directory being written (PARTIAL) or replaced (REPLACED): ".NAME.TAG<pid>-<hex>"
PARTIAL_TAG = ".partial-"
REPLACED_TAG = ".replaced-"


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike, *, replace: bool = False) -> Iterator[Path]:
    """An empty hidden directory beside ``path`` to write a whole output into; on success its files get
    the umask's modes (safetensors and mkstemp write 0600), are fsynced, and the directory is renamed to
    ``path``. An existing ``path`` (only with ``replace``) is renamed aside first and removed once the
    new one is in place, so it is never lost before the new one is complete; on error the hidden
    directory is removed and ``path`` is untouched. Siblings left by a process that died are cleaned up
    first (an old output whose swap was cut off is put back)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _clean_siblings(path)
    if path.exists() and not replace:
        raise FileExistsError(f"{path} exists")
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
    tmp = path.parent / f".{path.name}{PARTIAL_TAG}{tag}"
    tmp.mkdir()
    try:
        yield tmp
        _publish_modes(tmp)
        old = None
        if path.exists() or path.is_symlink():
            old = path.parent / f".{path.name}{REPLACED_TAG}{tag}"
            os.rename(path, old)
        try:
            os.rename(tmp, path)
        except BaseException:
            if old is not None and not path.exists():
                os.rename(old, path)
            raise
        fsync_path(path.parent)
        if old is not None:
            _remove(old)
    except BaseException:
        _remove(tmp)
        raise


def _publish_modes(root: Path) -> None:
    """The modes a plain ``open()`` / ``mkdir`` would give under the umask, for every file and folder
    under ``root``; each file is fsynced."""
    umask = _umask()
    mode, folder_mode = 0o666 & ~umask, 0o777 & ~umask
    os.chmod(root, folder_mode)
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            os.chmod(os.path.join(dirpath, d), folder_mode)
        for f in filenames:
            full = os.path.join(dirpath, f)
            if not os.path.islink(full):
                os.chmod(full, mode)
                fsync_path(Path(full))
        fsync_path(Path(dirpath))


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # alive, owned by someone else
        return True
    return True


def _clean_siblings(path: Path) -> None:
    """Remove the hidden siblings of ``path`` that a dead process left (see :func:`atomic_directory`)."""
    if not path.parent.is_dir():
        return
    for tag in (REPLACED_TAG, PARTIAL_TAG):
        prefix = f".{path.name}{tag}"
        for sibling in sorted(path.parent.iterdir()):
            pid = sibling.name[len(prefix) :].partition("-")[0] if sibling.name.startswith(prefix) else ""
            if not pid.isdigit() or _pid_alive(int(pid)):
                continue
            if tag == REPLACED_TAG and not path.exists():
                os.rename(sibling, path)  # cut off between the two renames: the old output is whole
            else:
                _remove(sibling)


def atomic_write_bytes(path: str | os.PathLike, payload: bytes) -> None:
    """Write ``payload`` to ``path`` atomically."""
    with atomic_writer(path) as fh:
        fh.write(payload)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` as UTF-8 to ``path`` atomically (newlines as given)."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    """Write ``obj`` as indented JSON with sorted keys (NaN and infinity allowed) atomically."""
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, allow_nan=True) + "\n")


def read_json(path: str | os.PathLike) -> Any | None:
    """The JSON value in ``path``, or None when the file is missing or not valid JSON."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


# ----------------------------------------------------------------------------- exclusive locks


def nested_paths(source: str | os.PathLike, out: str | os.PathLike) -> str | None:
    """Why writing ``out`` could overwrite ``source`` (the same path, one inside the other), else None.
    Paths are resolved first, so links and ``..`` cannot hide it."""
    src, dst = Path(source).resolve(), Path(out).resolve()
    if src == dst:
        return f"{out} is the source itself"
    if src in dst.parents:
        return f"{out} lies inside the source {source}"
    if dst in src.parents:
        return f"the source {source} lies inside {out}"
    return None


def this_command() -> str:
    """The command line of this process, as typed (``attnres ...`` for the command and ``python -m attnres``)."""
    argv = list(sys.argv)
    if argv and Path(argv[0]).name in ("attnres", "__main__.py"):
        return "attnres " + " ".join(argv[1:])
    return " ".join(argv)


class ExclusiveLock:
    """An ``flock`` on ``path``, held until :meth:`release` (or until the process dies: the kernel
    drops it then, so a crash never leaves a stale lock). :meth:`acquire` returns None when this
    process now holds the lock, else who holds it ("pid N: command", as written by the holder).
    Where flock does not exist (Windows) every acquire succeeds: one process at a time, by trust."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._file: TextIO | None = None

    def acquire(self, holder: str | None = None) -> str | None:
        try:
            import fcntl
        except ImportError:
            return None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        f = open(self.path, "a+")  # noqa: SIM115 -- the open file is the lock: held until release()
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            f.seek(0)
            who = f.read().strip() or "another process"
            f.close()
            if e.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                raise
            return who
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()}: {holder or this_command()}\n")
        f.flush()
        self._file = f
        return None

    @property
    def held(self) -> bool:
        return self._file is not None

    def release(self) -> None:
        if self._file is None:
            return
        import fcntl

        f, self._file = self._file, None
        with contextlib.suppress(OSError):
            f.truncate(0)
        fcntl.flock(f, fcntl.LOCK_UN)
        f.close()


@contextlib.contextmanager
def exclusive_lock(path: str | os.PathLike, holder: str | None = None) -> Iterator[str | None]:
    """:class:`ExclusiveLock` as a context: yields None while this process holds the lock, else who does."""
    lock = ExclusiveLock(path)
    who = lock.acquire(holder)
    try:
        yield who
    finally:
        lock.release()


# ----------------------------------------------------------------------------- TOML


def parse_toml(text: str) -> dict:
    """Parse TOML text with ``tomllib`` (Python 3.11+) or the ``tomli`` package (3.10).

    Raises ValueError (both modules' TOMLDecodeError is one) on invalid TOML."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # Python 3.10: the same parser, as a package
        import tomli as tomllib
    return tomllib.loads(text)
