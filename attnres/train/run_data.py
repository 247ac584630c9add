"""A run's data, as the trainer prepares it (``attnres.data.prepare_data``): a resumed run encodes with
its own saved tokenizer and refuses data that changed since it started; with several processes rank 0
fills the tokenizer and token caches and the others then read them."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch.distributed as dist

from attnres.files import TOKENIZER_FILE
from attnres.train.config import TrainConfig

if TYPE_CHECKING:
    from attnres.data.tokenizer import Tokenizer


def prepare_run_data(c: TrainConfig, out_dir: Path, saved: dict | None, world: int, is_main: bool):
    """The run's prepared data (train and validation splits, tokenizer). ``saved``: the state.json of
    the checkpoint a resumed run continues (None for a new run)."""
    from attnres.data import check_length, load_tokenizer, prepare_data

    tokenizer: str | Tokenizer = c.tokenizer
    if saved is not None and (out_dir / TOKENIZER_FILE).is_file():
        tokenizer = load_tokenizer(out_dir / TOKENIZER_FILE)  # the run's own, never a retrained one

    def data():
        return prepare_data(
            data=c.data,
            tokenizer=tokenizer,
            vocab_size=c.vocab_size,
            val_fraction=c.val_fraction,
            cache_dir=c.cache_dir,
        )

    if world > 1:  # rank 0 fills the tokenizer and token caches, the others then read them
        if is_main:
            prepared = data()
        dist.barrier()
        if not is_main:
            prepared = data()
    else:
        prepared = data()
    if saved is not None:
        digest = saved.get("train_state", {}).get("data_digest")
        if digest and digest != prepared.data_digest:
            where = "the bundled corpus" if c.data is None else repr(c.data)
            raise ValueError(
                f"--resume: the data {where} changed since the run in {out_dir} started (digest "
                f"{prepared.data_digest[:12]} now, {digest[:12]} in its checkpoint), so resuming would "
                "train on other text. Fix: restore the original data, or train a new run (a new --out)"
            )
    check_length(prepared.train, c.seq_len)
    check_length(prepared.val, c.seq_len)
    return prepared
