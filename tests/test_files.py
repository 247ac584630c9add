"""attnres.files: atomic writes leave the old file or the whole new one, never a part."""

import pytest

from attnres.files import (
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
