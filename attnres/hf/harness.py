"""EleutherAI's lm-evaluation-harness on a run's held-out validation works, as a local task.

The harness evaluates our Hugging Face model through its ``hf`` backend like any causal LM; the
task is written here, beside its data, so nothing is downloaded: a JSON-lines file with one
validation document per line and a task file (``output_type: loglikelihood_rolling``, the harness's
perplexity over whole documents, as its wikitext task) that points at it. The harness reports
``word_perplexity``, ``byte_perplexity`` and ``bits_per_byte`` of each document's text given the
tokenizer's eos (our document separator, see ``attnres.hf.tokenizer.special_token_ids``) as its only
context at the start.

    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    task_dir = write_validation_task("runs/block", "harness")
    simple_evaluate(model="hf", model_args=model_args("out/block-hf"), tasks=[TASK],
                    task_manager=TaskManager(include_path=str(task_dir)))

Needs ``pip install 'attnres[eval]'`` (lm-eval) to run the harness; writing the task does not.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from attnres.checkpoint import STATE_FILE, read_checkpoint_state
from attnres.data import Document, load_documents, split_documents
from attnres.files import CHECKPOINT_DIR, atomic_write_text

TASK = "attnres_validation"
# the harness's metrics of a rolling log-likelihood, with the aggregation over documents it uses for them
METRICS = {
    "word_perplexity": "weighted_perplexity",
    "byte_perplexity": "weighted_perplexity",
    "bits_per_byte": "bits_per_byte",
}


def validation_documents(run) -> list:
    """The documents a native run (``attnres train``) held out for validation: its data (the bundled
    corpus by default) split with its ``val_fraction``, as the trainer split it."""
    path = Path(run)
    ckpt = path / CHECKPOINT_DIR if (path / CHECKPOINT_DIR / STATE_FILE).is_file() else path
    train_config = read_checkpoint_state(ckpt)["train_config"]
    if "val_fraction" not in train_config:
        raise ValueError(
            f"{run}: its checkpoint records no train config (val_fraction); pass a run "
            "directory of attnres train, or write_task() with the texts to evaluate"
        )
    return split_documents(load_documents(train_config.get("data")), train_config["val_fraction"])[1]


def model_args(pretrained, tokenizer=None) -> str:
    """The harness's ``model_args`` for an exported model directory: ``pretrained=DIR``, plus
    ``prefix_token_id`` when its tokenizer has neither bos nor eos (a byte-tokenizer run: the token
    that precedes every document in the training stream, the newline ending the separator, id 10),
    which the harness would otherwise lack to start each document with. ``tokenizer``: the model's
    Hugging Face tokenizer (default: loaded from ``pretrained``)."""
    from attnres.data import DOC_SEPARATOR

    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(pretrained), trust_remote_code=False)
    args = f"pretrained={pretrained}"
    if tokenizer.bos_token_id is None and tokenizer.eos_token_id is None:
        last = tokenizer.encode(DOC_SEPARATOR[-1], add_special_tokens=False)
        if len(last) == 1:
            args += f",prefix_token_id={last[0]}"
    return args


def write_task(directory, documents: Iterable[Document], name: str = TASK) -> Path:
    """Write the task ``name`` over ``documents`` into ``directory`` (created): ``NAME.jsonl`` and
    ``NAME.yaml``; returns the directory, for the harness's ``--include_path``."""
    directory = Path(directory).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    data = directory / f"{name}.jsonl"
    atomic_write_text(data, "".join(json.dumps({"name": d.name, "text": d.text}) + "\n" for d in documents))
    task = {
        "task": name,
        "dataset_path": "json",  # the datasets library's own JSON loader: a local file, no hub
        "dataset_kwargs": {"data_files": {"validation": str(data)}},
        "output_type": "loglikelihood_rolling",
        "validation_split": "validation",
        "doc_to_text": "",
        "doc_to_target": "{{text}}",
        "metric_list": [
            {"metric": metric, "aggregation": aggregation, "higher_is_better": False}
            for metric, aggregation in METRICS.items()
        ],
        "metadata": {"version": 1.0},
    }
    # JSON is YAML: the harness reads this file as it reads its own task files
    atomic_write_text(directory / f"{name}.yaml", json.dumps(task, indent=2) + "\n")
    return directory


def write_validation_task(run, directory, name: str = TASK, max_documents: int | None = None) -> Path:
    """:func:`write_task` over the run's :func:`validation_documents` (the first ``max_documents``)."""
    documents = validation_documents(run)
    return write_task(directory, documents[:max_documents] if max_documents else documents, name)
