"""attnres.files: atomic writes leave the old file (or directory) or the whole new one, never a part, with the
umask's modes."""

import os
import stat

import pytest

from attnres.files import (
    PARTIAL_TAG,
    REPLACED_TAG,
    atomic_directory,
    atomic_path,
    atomic_write_json,
    atomic_write_text,
    atomic_writer,
    parse_toml,
    read_json,
)


def test_atomic_writes_replace_whole_files_and_leave_no_temp(tmp_path):
    path = tmp_path / "deep" / "x.json"
    atomic_write_json(path, {"b": 1, "a": float("nan")})
    assert path.read_text() == '{\n  "a": NaN,\n  "b": 1\n}\n'
    assert read_json(path)["b"] == 1
    atomic_write_text(path, "é\nline\n")
    assert path.read_bytes() == "é\nline\n".encode()
    assert sorted(p.name for p in path.parent.iterdir()) == ["x.json"]


def test_a_failed_write_keeps_the_old_file(tmp_path):
    path = tmp_path / "x.txt"
    atomic_write_text(path, "old")
    with pytest.raises(RuntimeError), atomic_writer(path) as fh:
        fh.write(b"half of the new")
        raise RuntimeError("crash mid-write")
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["x.txt"]


def test_read_json_is_none_for_missing_or_broken_files(tmp_path):
    assert read_json(tmp_path / "missing.json") is None
    (tmp_path / "torn.json").write_text('{"a": ')
    assert read_json(tmp_path / "torn.json") is None


def test_parse_toml_raises_value_error():
    assert parse_toml("a = 1\n[t]\nb = 'x'\n") == {"a": 1, "t": {"b": "x"}}
    with pytest.raises(ValueError):
        parse_toml("a = \n")


def _tree(root):
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def test_a_directory_is_published_whole_or_not_at_all(tmp_path):
    out = tmp_path / "out"
    with atomic_directory(out) as tmp:
        (tmp / "a.txt").write_text("old")
    assert _tree(out) == {"a.txt": b"old"}
    with pytest.raises(OSError), atomic_directory(out, replace=True) as tmp:
        (tmp / "a.txt").write_text("half of the new")
        raise OSError(28, "No space left on device")
    assert _tree(out) == {"a.txt": b"old"} and [p.name for p in tmp_path.iterdir()] == ["out"]
    with atomic_directory(out, replace=True) as tmp:
        (tmp / "b.txt").write_text("new")
    assert _tree(out) == {"b.txt": b"new"} and [p.name for p in tmp_path.iterdir()] == ["out"]
    with pytest.raises(FileExistsError), atomic_directory(out):
        pass


def test_a_file_written_by_path_is_published_whole(tmp_path):
    path = tmp_path / "m.gguf"
    atomic_write_text(path, "old")
    with pytest.raises(OSError), atomic_path(path) as tmp:
        tmp.write_bytes(b"GGUF and half the tensors")
        raise OSError(28, "No space left on device")
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["m.gguf"]
    with atomic_path(path) as tmp:
        tmp.write_bytes(b"GGUF")
    assert path.read_bytes() == b"GGUF" and [p.name for p in tmp_path.iterdir()] == ["m.gguf"]


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_published_files_get_the_umasks_mode_whatever_their_writer_chose(tmp_path, umask):
    old = os.umask(umask)
    try:
        with atomic_directory(tmp_path / "out") as tmp:
            (tmp / "sub").mkdir(mode=0o700)
            for name in ("weights.safetensors", "sub/config.json"):  # safetensors and mkstemp write 0600
                os.close(os.open(tmp / name, os.O_WRONLY | os.O_CREAT, 0o600))
        with atomic_path(tmp_path / "m.gguf") as tmp:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT, 0o600))
        atomic_write_text(tmp_path / "x.json", "{}")
    finally:
        os.umask(old)
    files = [tmp_path / "out" / "weights.safetensors", tmp_path / "out" / "sub" / "config.json"]
    files += [tmp_path / "m.gguf", tmp_path / "x.json"]
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in files} == {p.name: 0o666 & ~umask for p in files}
    folders = [tmp_path / "out", tmp_path / "out" / "sub"]
    assert [stat.S_IMODE(p.stat().st_mode) for p in folders] == [0o777 & ~umask] * 2


def test_what_a_dead_writer_left_is_cleaned_up_and_a_cut_off_swap_put_back(tmp_path):
    dead = 2**22 + 12345  # above Linux's pid_max: no such process
    out = tmp_path / "out"
    (tmp_path / f".out{PARTIAL_TAG}{dead}-abc").mkdir()  # a write that died midway
    old = tmp_path / f".out{REPLACED_TAG}{dead}-abc"  # an old output renamed aside, then the process died
    old.mkdir()
    (old / "a.txt").write_text("old")
    with pytest.raises(FileExistsError), atomic_directory(out):
        pass
    assert _tree(out) == {"a.txt": b"old"} and [p.name for p in tmp_path.iterdir()] == ["out"]
