"""docs/options.md is ``attnres options``' output, and every ModelConfig field has its one line."""

import dataclasses
from pathlib import Path

from attnres.cli import main
from attnres.model.backbones import BACKBONES
from attnres.model.config import FIELD_DOCS, ModelConfig
from attnres.model.options_table import options_markdown
from attnres.residual import RESIDUALS

DOC = Path(__file__).resolve().parents[2] / "docs" / "options.md"


def test_every_field_has_exactly_one_description():
    assert list(FIELD_DOCS) == [f.name for f in dataclasses.fields(ModelConfig)]
    assert all(text.strip() and "\n" not in text for text in FIELD_DOCS.values())


def test_the_table_lists_every_field_with_its_readers():
    table = options_markdown()
    for f in dataclasses.fields(ModelConfig):
        assert table.count(f"| `{f.name}` |") == 1, f.name
    for name, info in {**RESIDUALS, **BACKBONES}.items():
        assert f"`{name}`" in table
        for option in info.options:
            row = next(line for line in table.splitlines() if line.startswith(f"| `{option}` |"))
            assert name in row.split(" | ")[3], (option, name)


def test_the_committed_docs_options_md_is_the_generated_table():
    assert DOC.read_text() == options_markdown() + "\n", "regenerate it: attnres options > docs/options.md"


def test_attnres_options_prints_it(capsys):
    assert main(["options"]) == 0
    assert capsys.readouterr().out == options_markdown() + "\n"
