"""attnres sample: text from a trained run, streamed to stdout."""

from __future__ import annotations

import sys

from attnres.checkpoint import load_model
from attnres.cli.options import CLIError, add_compile_option, examples, unescape
from attnres.files import TOKENIZER_FILE
from attnres.inference.sampling import check_sampling, stream_text


def add_parser(sub) -> None:
    p = sub.add_parser(
        "sample",
        help="generate text from a trained run",
        description=("Generate text from a run's checkpoint, streaming it to stdout."),
        epilog=examples(
            'attnres sample runs/block --prompt "ROMEO:" --temperature 0.8 --top-p 0.9 --stop "\\n\\n"',
            "attnres sample runs/block --temperature 0 --max-new-tokens 50     # greedy",
        ),
    )
    p.add_argument("run", help="run directory")
    p.add_argument("--prompt", type=unescape, default="ROMEO:\n", help="text to continue (\\n, \\t: newline, tab)")
    p.add_argument("--max-new-tokens", dest="max_new_tokens", type=int, default=200, help="tokens to generate")
    p.add_argument("--temperature", type=float, default=0.8, help="sampling temperature; 0 = greedy")
    p.add_argument("--top-k", dest="top_k", type=int, default=None, help="sample among the k likeliest tokens")
    p.add_argument(
        "--top-p",
        dest="top_p",
        type=float,
        default=None,
        help="sample among the likeliest tokens holding this probability mass (nucleus)",
    )
    p.add_argument("--seed", type=int, default=0, help="random seed of the sampler")
    p.add_argument(
        "--stop",
        type=unescape,
        default=None,
        help='stop after this text appears (\\n, \\t: newline, tab; e.g. --stop "\\n\\n")',
    )
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N")
    add_compile_option(p, "the decoding step (over a static KV cache)")
    p.set_defaults(func=run)


def run(args) -> int:
    check_sampling(args.max_new_tokens, args.temperature, args.top_k, args.top_p)  # before the model loads
    model, tokenizer, _ = load_model(args.run, device=args.device)
    if tokenizer is None:
        raise CLIError(f"{args.run} has no {TOKENIZER_FILE}; pass the run directory written by attnres train")
    pieces = stream_text(
        model,
        tokenizer,
        args.prompt,
        args.max_new_tokens,
        stop=args.stop,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        compile=args.compile,
    )
    sys.stdout.write(args.prompt)  # only once the options are known to be valid
    sys.stdout.flush()
    for piece in pieces:
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0
