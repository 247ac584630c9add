"""Fine-tune a retrofitted model with transformers' Trainer, in one process or under accelerate + FSDP2.

    python examples/hf_trainer.py --out runs/hf_trainer                  # one process, about 10 s on 2 CPU cores
    python examples/hf_trainer.py --out runs/hf_trainer --steps 12 --resume   # continue from its last checkpoint
    accelerate launch --config_file examples/accelerate_fsdp2_cpu.yaml \\
        examples/hf_trainer.py --out runs/hf_trainer_fsdp2               # FSDP2 on 2 CPU processes (gloo)

1. A tiny LLaMA (or ``--family qwen2``) is built from a config in-process (random weights, no
   download) and retrofitted into AttnRes (``attnres.hf.retrofit``: its own layers, wired through a
   depth stream; exact at init). A real run retrofits a pretrained checkpoint the same way:
   ``retrofit(AutoModelForCausalLM.from_pretrained(...))``.
2. The data are windows of the bundled Shakespeare corpus (byte tokens), in an order fixed by
   ``--seed`` and read sequentially, so a run, its resumption and its data-parallel split see the
   same batches: ``--batch-size`` is the global batch, split over the processes.
3. :class:`AttnResTrainer` is ``transformers.Trainer`` with the optimizer attnres wants: AdamW over
   ``attnres.param_groups`` (the AttnRes pseudo-queries and key norms, the norms and biases without
   weight decay), the residual scheme's parameters in a group of their own with ``--attnres-lr``
   (they start at zero / one and move slowly at the matrices' rate). The scheduler scales every
   group alike.
4. Checkpoints every ``--save-steps`` (the Trainer's own: weights, optimizer, scheduler, RNG and data
   position); ``--resume`` continues from the last one and logs the losses an uninterrupted run logs.
   The per-step losses go to ``<out>/losses.json``, the process layout to ``<out>/layout.json``.

Under ``accelerate launch`` the Trainer takes FSDP2 from the accelerate config
(examples/accelerate_fsdp2_cpu.yaml: ``fully_shard`` per decoder layer, the root holding the embedding,
the head and the residual scheme); on GPUs use the same file with ``use_cpu: false`` and the number of
GPUs as ``num_processes``. tests/examples/test_hf_trainer.py checks that 2 processes log the losses of
one, and that a resumed run logs those of an uninterrupted one.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch
from torch.utils.data import Dataset
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Trainer,
    TrainingArguments,
)
from transformers.trainer_callback import TrainerCallback

from attnres import param_groups
from attnres.data import prepare_data
from attnres.hf.retrofit import retrofit

FAMILIES = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the Trainer's output directory (checkpoints, losses.json)")
    p.add_argument("--family", choices=sorted(FAMILIES), default="llama")
    p.add_argument("--residual", choices=("block", "full"), default="block")
    p.add_argument("--steps", type=int, default=12, help="optimizer steps in all (a resumed run: up to this step)")
    p.add_argument("--batch-size", type=int, default=8, help="global batch (windows per step, over all processes)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--attnres-lr", type=float, default=2e-2, help="learning rate of the residual scheme's parameters")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--save-steps", type=int, default=6, help="checkpoint every this many steps (0: never)")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --out")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def build_model(family: str, residual: str, vocab_size: int, seed: int):
    """A tiny decoder of ``family`` with random weights (seeded), retrofitted into ``residual``."""
    config_cls, model_cls = FAMILIES[family]
    config = config_cls(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return retrofit(model_cls(config), residual=residual, attnres_block_size=4 if residual == "block" else None)


class WindowDataset(Dataset):
    """``n`` non-overlapping windows of ``tokens`` (``seq_len`` each), in an order fixed by ``seed``;
    each item is the Trainer's ``input_ids`` / ``labels`` pair (the model shifts the labels)."""

    def __init__(self, tokens, seq_len: int, n: int, seed: int):
        available = (len(tokens) - 1) // seq_len
        if n > available:
            raise ValueError(f"{n} windows of {seq_len} tokens asked; the split has {available}")
        starts = np.random.default_rng(seed).permutation(available)[:n] * seq_len
        windows = np.stack([np.asarray(tokens[s : s + seq_len]) for s in starts])
        self.windows = torch.from_numpy(windows.astype(np.int64))

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.windows[i], "labels": self.windows[i]}


def optimizer_groups(model, *, lr: float, attnres_lr: float, weight_decay: float) -> list[dict]:
    """AdamW groups: ``attnres.param_groups`` (weight decay on matrices, embeddings and the head; none
    on the AttnRes parameters, norms and biases), with the residual scheme's parameters split into
    a group of their own at ``attnres_lr`` (weight decay 0)."""
    scheme = {id(p) for p in model.depth_stream_scheme().parameters()}
    groups = []
    for group in param_groups(model, weight_decay=weight_decay):
        members = list(zip(group["names"], group["params"], strict=True))
        for name, pick, rate in (
            ("attnres", lambda p: id(p) in scheme, attnres_lr),
            (group["kind"], lambda p: id(p) not in scheme, lr),
        ):
            chosen = [(n, p) for n, p in members if pick(p)]
            if chosen:
                wd = 0.0 if name == "attnres" else group["weight_decay"]
                params, names = [p for _, p in chosen], [n for n, _ in chosen]
                groups.append({"params": params, "names": names, "name": name, "lr": rate, "weight_decay": wd})
    return groups


class AttnResTrainer(Trainer):
    """``transformers.Trainer`` whose optimizer keeps attnres' parameter groups (module docstring)."""

    def __init__(self, *args, attnres_lr: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.attnres_lr = attnres_lr

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        state = self.accelerator.state
        fsdp_asked = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
        if fsdp_asked and getattr(state, "fsdp_plugin", None) is None:
            # accelerate (1.16) runs CPU processes as plain data parallel even when its config asks for
            # FSDP; FSDP2 itself runs on gloo, so hand accelerate the plugin its config describes
            from accelerate.state import PartialState
            from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

            state.fsdp_plugin = FullyShardedDataParallelPlugin()  # from the FSDP_* variables accelerate launch sets
            state.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP
            self.is_fsdp_enabled = True

    def create_optimizer(self, model=None):
        if self.optimizer is None:
            groups = optimizer_groups(
                model if model is not None else self.model,
                lr=self.args.learning_rate,
                attnres_lr=self.attnres_lr,
                weight_decay=self.args.weight_decay,
            )
            self.optimizer = torch.optim.AdamW(groups, betas=(0.9, 0.95), eps=1e-8)
        return self.optimizer


class LossLog(TrainerCallback):
    """The training loss of every logged step (the Trainer's mean over processes), by step."""

    def __init__(self):
        self.losses: dict[int, float] = {}

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses[state.global_step] = float(logs["loss"])


def main(argv=None) -> dict[int, float]:
    """Train (or resume) as the arguments say; returns {step: loss} of the steps this run took."""
    args = parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.batch_size % world:
        raise ValueError(f"--batch-size={args.batch_size} must be divisible by the {world} processes")
    data = prepare_data(tokenizer="byte")
    model = build_model(args.family, args.residual, data.tokenizer.vocab_size, args.seed)
    dataset = WindowDataset(data.train.tokens, args.seq_len, args.steps * args.batch_size, args.seed)
    training_args = TrainingArguments(
        output_dir=args.out,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size // world,
        learning_rate=args.lr,
        weight_decay=args.weight_decay,
        lr_scheduler_type="linear",
        logging_steps=1,
        save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 1,
        train_sampling_strategy="sequential",
        dataloader_num_workers=0,
        seed=args.seed,
        report_to=[],
        disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(),
    )
    log = LossLog()
    trainer = AttnResTrainer(
        model=model, args=training_args, train_dataset=dataset, callbacks=[log], attnres_lr=args.attnres_lr
    )
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    if trainer.is_world_process_zero():
        path = Path(args.out) / "losses.json"
        done = json.loads(path.read_text()) if args.resume and path.exists() else {}
        done.update({str(step): loss for step, loss in log.losses.items()})
        path.write_text(json.dumps(done, indent=1) + "\n")
        layout = {"distributed_type": trainer.accelerator.distributed_type.value, "processes": world}
        (Path(args.out) / "layout.json").write_text(json.dumps(layout) + "\n")
        for step, loss in sorted(log.losses.items()):
            print(f"step {step:4d}  loss {loss:.6f}")
    if torch.distributed.is_initialized():
        # an orderly end of the gloo group: left to interpreter exit, its threads can abort a rank
        # ("terminate called without an active exception") after training has finished
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return log.losses


if __name__ == "__main__":
    main()
