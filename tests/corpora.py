"""Small deterministic corpora for trainer-level tests (no dependence on the bundled one)."""

from pathlib import Path

import torch

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "seven",
    "kings",
    "of",
    "old",
    "sing",
    "about",
    "rain",
    "and",
    "wind",
    "upon",
    "the",
    "hills",
    "where",
    "shepherds",
    "keep",
    "their",
    "flocks",
    "by",
    "night",
]


def write_pseudo_english(root: Path, works: int, words_per_work: int) -> str:
    """``works`` text files of pseudo-English, 12 words a line; returns the directory."""
    g = torch.Generator().manual_seed(0)
    for i in range(works):
        idx = torch.randint(0, len(WORDS), (words_per_work,), generator=g).tolist()
        lines = [" ".join(WORDS[j] for j in idx[k : k + 12]) for k in range(0, len(idx), 12)]
        (root / f"work_{i}.txt").write_text("\n".join(lines) + "\n")
    return str(root)
