"""Parity of our model with llama.cpp's kimi-k3 on a GGUF we export (docs/serving.md). Not in CI.

Builds nothing: it needs ``llama-cpp-python`` importable (it compiles llama.cpp from source; see
docs/serving.md for the command and its time), and exits 2 with the reason when it is not or when
its llama.cpp lacks the ``kimi-k3`` architecture. By default it makes a tiny random Kimi Linear
Block AttnRes model (seeded; non-zero depth queries and key norms; KDA + MLA + MoE with a shared
expert; byte tokenizer) in float32; ``--source RUN_OR_HF_DIR`` takes a trained model instead. It
writes the model with ``attnres.serving.gguf.write_gguf`` (float32), loads the file in llama.cpp and
compares, on fixed prompts, the next-token logits of every prompt position (max |diff| <= 1e-3) and
32 greedy tokens (equal).

    PYTHONPATH=/tmp/llamacpp-venv/lib/python3.11/site-packages .venv/bin/python scripts/llama_cpp_parity.py
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

PROMPTS = [b"ROMEO: ", b"JULIET: O Romeo, Romeo!", b"The depth attention reads", b"\x00\x01 bytes 0-9"]
TOLERANCE = 1e-3
STEPS = 32


def tiny_model(seed: int, pattern: str = "KKKM", experts: int = 4, residual: str = "block"):
    from attnres.data import ByteTokenizer
    from attnres.hf.tokenizer import hf_tokenizer, special_token_ids
    from attnres.model import AttnResLM, ModelConfig

    torch.manual_seed(seed)
    config = ModelConfig(
        backbone="kimi_linear",
        vocab_size=256,
        d_model=64,
        n_layers=4,
        n_heads=2,
        d_ff=128,
        max_seq_len=128,
        moe_experts=experts,
        moe_top_k=2,
        moe_shared_experts=1,
        init_std=0.08,
        kimi_layer_pattern=pattern,
        residual=residual,
        **({"attnres_block_size": 4} if residual == "block" else {}),
    )
    lm = AttnResLM(config).eval()
    with torch.no_grad():
        if residual == "block":
            lm.residual.queries.normal_(0.0, 0.5)
            lm.residual.key_norm_weight.uniform_(0.5, 1.5)
        for block in lm.blocks:
            if block.is_moe:
                block.mlp.gate.e_score_correction_bias.normal_(0.0, 0.05)
    native = ByteTokenizer()
    return lm, hf_tokenizer(native).backend_tokenizer, special_token_ids(native)


@torch.no_grad()
def our_logits(lm, ids: list[int]) -> np.ndarray:
    out = lm(torch.tensor([ids]))
    out = out if torch.is_tensor(out) else out[0]
    return out[0].float().numpy()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--source", default=None, help="a run / AttnRes HF / Kimi Linear directory (default: tiny random)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--pattern", default="KKKM", help="tiny model: kimi_layer_pattern (K = KDA, M = MLA)")
    p.add_argument("--experts", type=int, default=4, help="tiny model: routed experts (0: dense MLPs)")
    p.add_argument("--residual", choices=("block", "prenorm"), default="block", help="tiny model: residual")
    p.add_argument(
        "--dtype",
        choices=("float32", "float16", "bfloat16"),
        default="float32",
        help="GGUF weights (the tolerance applies to float32 only)",
    )
    args = p.parse_args(argv)
    try:
        import llama_cpp
    except ImportError as e:
        print(f"cannot run: llama-cpp-python is not importable ({e}); see docs/serving.md", file=sys.stderr)
        return 2
    from attnres.serving.gguf import load_for_serving, write_gguf

    if args.source:
        model, tokenizer, special = load_for_serving(args.source)
        lm = model.model.float()
    else:
        lm, tokenizer, special = tiny_model(args.seed, args.pattern, args.experts, args.residual)
    lm = lm.float().eval()
    vocab = lm.config.vocab_size
    with tempfile.TemporaryDirectory() as tmp:
        path = write_gguf(lm, Path(tmp) / "model.gguf", dtype=args.dtype, tokenizer=tokenizer, special=special)
        try:
            llm = llama_cpp.Llama(
                model_path=str(path),
                n_ctx=lm.config.max_seq_len,
                n_batch=lm.config.max_seq_len,
                logits_all=True,
                n_threads=args.threads,
                verbose=False,
                # float32 caches: the default float16 KV cache rounds MLA's latents
                type_k=llama_cpp.GGML_TYPE_F32,
                type_v=llama_cpp.GGML_TYPE_F32,
            )
        except Exception as e:  # llama.cpp reports an unknown architecture as a failed load
            print(f"cannot run: llama.cpp {llama_cpp.__version__} did not load the kimi-k3 GGUF ({e})", file=sys.stderr)
            return 2
        worst, own, theirs_exact, greedy_ok = 0.0, 0.0, 0.0, True
        for prompt in PROMPTS:
            ids = list(prompt)
            ids = [i % vocab for i in ids]
            llm.reset()
            llm.eval(ids)
            theirs = np.array(llm.scores[: len(ids)], dtype=np.float32)[:, :vocab]
            diff = float(np.abs(theirs - our_logits(lm, ids)).max())
            worst = max(worst, diff)
            exact = our_logits(lm.double(), ids)
            lm.float()
            own = max(own, float(np.abs(our_logits(lm, ids) - exact).max()))
            theirs_exact = max(theirs_exact, float(np.abs(theirs - exact).max()))
            ours_seq, theirs_seq = list(ids), []
            steps = min(STEPS, lm.config.max_seq_len - len(ids))  # a trained model's context may be shorter
            for _ in range(steps):
                theirs_seq.append(int(np.argmax(llm.scores[llm.n_tokens - 1][:vocab])))
                llm.eval([theirs_seq[-1]])
                ours_seq.append(int(np.argmax(our_logits(lm, ours_seq)[-1])))
            same = ours_seq[len(ids) :] == theirs_seq
            greedy_ok &= same
            print(
                f"prompt {prompt!r}: {len(ids)} tokens, max |logit diff| {diff:.2e}, greedy {steps} tokens "
                f"{'equal' if same else 'DIFFER'}"
            )
        scale = float(np.abs(our_logits(lm, list(PROMPTS[0]))).max())
        print(
            f"llama.cpp (llama-cpp-python {llama_cpp.__version__}) vs attnres, {args.dtype} GGUF: max |logit diff| "
            f"{worst:.2e} (max |logit| {scale:.2f}; tolerance {TOLERANCE:g}); greedy (up to {STEPS} tokens) "
            f"{'equal' if greedy_ok else 'differ'}"
        )
        print(f"against our float64 forward: attnres float32 {own:.2e}, llama.cpp {theirs_exact:.2e}")
        if args.dtype != "float32":
            print(f"{args.dtype} weights: informational (the tolerance is for float32)")
            return 0
        return 0 if worst <= TOLERANCE and greedy_ok else 1


if __name__ == "__main__":
    sys.exit(main())
