"""Retrofit a pretrained LLaMA into Block AttnRes, check it computes the same function, keep training.

    python examples/continue_training.py                 # about a minute on 2 CPU cores
    python examples/continue_training.py --out runs/retrofit --residual full

1. A tiny LLaMA (transformers' LlamaForCausalLM, built from a config) is pretrained for a few
   dozen AdamW steps on the bundled Shakespeare corpus (byte tokens). It stands in for a real
   checkpoint, which ``convert_to_attnres("path/to/llama")`` or ``attnres convert`` take the same way.
2. ``convert_to_attnres(..., layout="native")`` turns it into our own AttnResForCausalLM (the
   default layout wraps the LLaMA's own layers instead, docs/hf.md). The pseudo-queries start at zero,
   so every depth weight is uniform and each sublayer reads the mean of its sources, which its
   RMSNorm rescales: the logits match the LLaMA's (up to the RMSNorm eps effect, see
   attnres/hf/convert.py) and so does the validation loss.
3. Training continues with a plain AdamW loop over the same batches, through the Hugging Face
   interface (``model(input_ids, labels=...)``). The depth weights move away from uniform.
4. The result is saved with ``save_pretrained``, reloaded with ``AutoModelForCausalLM`` and
   samples text with ``generate()`` and a Hugging Face tokenizer equivalent to the byte tokenizer.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers.utils import logging as hf_logging

from attnres.analysis.depth import depth_weight_matrix
from attnres.data import batch_seed, eval_batches, prepare_data, sample_batch
from attnres.hf import convert_to_attnres, hf_tokenizer
from attnres.hf.convert import conversion_error


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pretrain-steps", type=int, default=50, help="AdamW steps of the LLaMA before conversion")
    p.add_argument("--steps", type=int, default=50, help="AdamW steps of the converted model")
    p.add_argument("--residual", choices=("block", "full"), default="block")
    p.add_argument("--blocks", type=int, default=4, help="depth blocks N for --residual block")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument(
        "--depth-lr",
        type=float,
        default=2e-2,
        help="learning rate of the AttnRes pseudo-queries and key norms (they start at zero / one)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="save the trained model here (default: a temporary directory)")
    return p.parse_args()


def train(model, data, steps, param_groups, args, offset, label):
    """A plain AdamW loop on HF-style (input_ids, labels) batches; returns the losses."""
    opt = torch.optim.AdamW(param_groups, betas=(0.9, 0.95), weight_decay=0.0)
    model.train()
    losses, start = [], time.time()
    for step in range(steps):
        x, _ = sample_batch(
            data.train.tokens, args.batch_size, args.seq_len, seed=batch_seed(args.seed, offset + step, 0)
        )
        loss = model(input_ids=x, labels=x).loss  # labels are shifted inside, HF style
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if (step + 1) % 20 == 0 or step + 1 == steps:
            print(f"  [{label}] step {step + 1:3d}  loss {np.mean(losses[-20:]):.3f}  ({time.time() - start:.0f}s)")
    model.eval()
    return losses


@torch.no_grad()
def val_loss(model, data, args, batches=4) -> float:
    total, n = 0.0, 0
    for x, _ in eval_batches(data.val.tokens, args.batch_size, args.seq_len, max_batches=batches):
        total += model(input_ids=x, labels=x).loss.item()
        n += 1
    return total / n


@torch.no_grad()
def depth_weight_deviation(model, x) -> tuple[float, np.ndarray]:
    """Max |mean depth weight - 1/K| over every consumer and source it reads (0 = uniform)."""
    record = model.model(x, return_record=True).record
    matrix = depth_weight_matrix(record)
    deviation = 0.0
    for row in matrix:
        read = row[~np.isnan(row)]
        deviation = max(deviation, float(np.abs(read - 1.0 / read.size).max()))
    return deviation, matrix


def main():
    args = parse_args()
    torch.manual_seed(args.seed)
    hf_logging.set_verbosity_error()
    data = prepare_data(tokenizer="byte")
    vocab = data.tokenizer.vocab_size
    print(
        f"data: bundled Shakespeare, byte tokens, {len(data.train.tokens):,} train / "
        f"{len(data.val.tokens):,} validation tokens"
    )

    # 1. a small "pretrained" LLaMA
    llama = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=vocab,
            hidden_size=128,
            intermediate_size=352,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=args.seq_len,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
        )
    )
    print(
        f"\n1. pretraining a LLaMA ({sum(p.numel() for p in llama.parameters()):,} parameters) "
        f"for {args.pretrain_steps} steps"
    )
    train(llama, data, args.pretrain_steps, [{"params": llama.parameters(), "lr": args.lr}], args, 0, "llama")
    llama_val = val_loss(llama, data, args)

    # 2. conversion
    model = convert_to_attnres(  # our own model (the native layout), whose depth weights step 3 reads
        llama, residual=args.residual, attnres_blocks=args.blocks if args.residual == "block" else None,
        layout="native"
    )
    mc = model.config.model_config()
    x, _ = next(iter(eval_batches(data.val.tokens, 4, args.seq_len, max_batches=1)))
    err = conversion_error(llama, model, x)
    scale = llama(x).logits.abs().max().item()
    before, _ = depth_weight_deviation(model, x)
    converted_val = val_loss(model, data, args)
    blocks = f" with {mc.num_blocks} depth blocks of {mc.block_size} sublayers" if args.residual == "block" else ""
    print(f"\n2. converted to {args.residual} AttnRes{blocks}")
    print(f"  max |logit difference| vs the LLaMA: {err:.2e} (logits up to {scale:.1f})")
    print(f"  validation loss: LLaMA {llama_val:.4f}, converted {converted_val:.4f} nats/token")
    print(f"  max deviation of the mean depth weights from uniform: {before:.2e}")

    # 3. continued training: the depth parameters get their own (larger) learning rate
    depth = [p for n, p in model.named_parameters() if n.startswith("model.residual.")]
    rest = [p for n, p in model.named_parameters() if not n.startswith("model.residual.")]
    print(f"\n3. training the AttnRes model for {args.steps} steps")
    train(
        model,
        data,
        args.steps,
        [{"params": rest, "lr": args.lr}, {"params": depth, "lr": args.depth_lr}],
        args,
        args.pretrain_steps,
        "attnres",
    )
    after, matrix = depth_weight_deviation(model, x)
    print(
        f"  validation loss: {val_loss(model, data, args):.4f} nats/token (LLaMA before conversion: "
        f"{llama_val:.4f}; more steps would help the LLaMA too: this shows the mechanics, not a comparison)"
    )
    print(f"  max deviation of the mean depth weights from uniform: {before:.2e} -> {after:.3f}")
    sources = "blocks" if args.residual == "block" else "sublayer outputs"
    print(f"  mean depth weights (rows: sublayers 0..L-1, then the output; columns: embedding, {sources}):")
    for i, row in enumerate(matrix):
        name = f"sublayer {i:2d}" if i < len(matrix) - 1 else "output    "
        print("   ", name, " ".join("  .  " if math.isnan(v) else f"{v:.3f}" for v in row))

    # 4. save, reload through the Auto classes, generate (into a temporary directory, removed at the
    # end, unless --out names one to keep)
    if args.out:
        save_and_sample(model, data, args.out)
    else:
        with tempfile.TemporaryDirectory(prefix="attnres-retrofit-") as out:
            save_and_sample(model, data, out)


def save_and_sample(model, data, out):
    model.save_pretrained(out)
    tokenizer = hf_tokenizer(data.tokenizer)
    tokenizer.save_pretrained(out)
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    prompt = tokenizer("ROMEO:\n", return_tensors="pt")
    sample = reloaded.generate(**prompt, max_new_tokens=80, do_sample=True, top_k=20, temperature=0.8)
    print(f"\n4. saved to {out}; AutoModelForCausalLM sample:\n")
    print(tokenizer.decode(sample[0]))


if __name__ == "__main__":
    main()
