"""Data for attnres: corpus loading, document-level splits, tokenizers, cached token arrays, batches.

Typical use::

    from attnres.data import prepare_data, check_length, sample_batch, eval_batches, bits_per_byte, batch_seed

    data = prepare_data()                      # bundled Shakespeare, BPE 4096, cached
    check_length(data.train, seq_len); check_length(data.val, seq_len)
    x, y = sample_batch(data.train.tokens, batch_size, seq_len, seed=batch_seed(run_seed, step, micro))
    for x, y in eval_batches(data.val.tokens, batch_size, seq_len): ...
    bpb = bits_per_byte(mean_val_loss, data.val.bytes_per_token)
"""

from .corpus import (
    BUNDLED_CORPUS,
    TEXT_SUFFIXES,
    Document,
    load_bundled_corpus,
    load_documents,
    split_documents,
)
from .dataset import (
    DOC_SEPARATOR,
    PreparedData,
    TokenData,
    batch_seed,
    bits_per_byte,
    check_length,
    count_eval_batches,
    encode_documents,
    eval_batches,
    prepare_data,
    sample_batch,
    token_dtype,
)
from .tokenizer import (
    BPETokenizer,
    ByteTokenizer,
    Tokenizer,
    build_tokenizer,
    default_cache_dir,
    load_tokenizer,
    train_bpe,
)

__all__ = [
    "BUNDLED_CORPUS",
    "TEXT_SUFFIXES",
    "Document",
    "load_bundled_corpus",
    "load_documents",
    "split_documents",
    "DOC_SEPARATOR",
    "PreparedData",
    "TokenData",
    "batch_seed",
    "bits_per_byte",
    "check_length",
    "count_eval_batches",
    "encode_documents",
    "eval_batches",
    "prepare_data",
    "sample_batch",
    "token_dtype",
    "BPETokenizer",
    "ByteTokenizer",
    "Tokenizer",
    "build_tokenizer",
    "default_cache_dir",
    "load_tokenizer",
    "train_bpe",
]
