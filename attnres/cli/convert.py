"""attnres convert: retrofit a Hugging Face causal LM into AttnRes, or native <-> HF
(attnres.hf.convert_directory)."""

from __future__ import annotations

from attnres.cli.options import CLIError, add_set_option, examples, parse_set
from attnres.files import nested_paths

# retrofit options with a flag of their own (attnres.hf.convert_to_attnres's keyword arguments)
RETROFIT_ARGS = ("residual", "attnres_blocks", "attnres_block_size", "max_seq_len")


def add_parser(sub) -> None:
    p = sub.add_parser(
        "convert",
        help="retrofit a HF LLaMA/Mistral/Qwen2/Kimi Linear into AttnRes; native <-> HF; GGUF / MLX for serving",
        description=(
            "SOURCE is a Hugging Face causal-LM directory of any family docs/hf.md lists (Llama, Mistral, Qwen, "
            "Gemma, Phi, GPT-2, GPT-NeoX, MoEs, ...) or Kimi Linear, retrofitted into AttnRes with zero-initialised "
            "queries and eps scaled so that its logits are unchanged (the family and the measured difference are "
            "printed; it wraps the source's own layers, or with --set layout=native or --to native becomes our own "
            "model, LLaMA / Mistral / Qwen2 only; --set rescale_reads=true for OLMo/OLMo-2; a Kimi Linear "
            "checkpoint in the released AttnRes layout, docs/method.md §10, loads as the Block AttnRes it is), an "
            "AttnRes Hugging Face directory, or a run/checkpoint directory of attnres train. --to kimi_linear "
            "writes a model with the Kimi Linear backbone as a Kimi Linear checkpoint (the §10 layout for Block "
            "AttnRes). Needs transformers (pip install 'attnres[hf]')."
        ),
        epilog=examples(
            "attnres convert ./llama ./llama-attnres --residual block --attnres-blocks 8",
            "attnres convert ./kimi-linear ./k3-layout --to kimi_linear --set attnres_scale_norm_eps=false",
            "attnres convert runs/block out/block-hf                  # native -> Hugging Face",
            "attnres convert out/block-hf runs/block-native           # and back: eval / sample take it",
            "attnres convert runs/kimi out/kimi.gguf --to gguf        # llama.cpp (kimi-k3), docs/serving.md",
        ),
    )
    p.add_argument("source", help="model directory (config.json + weights) or attnres run/checkpoint directory")
    p.add_argument("out", help="output directory")
    p.add_argument(
        "--to",
        choices=("hf", "native", "kimi_linear", "gguf", "mlx"),
        default=None,
        help="output format (default: hf, or native for an AttnRes HF source); kimi_linear: a Kimi "
        "Linear checkpoint (docs/method.md §10 layout for Block AttnRes); gguf: OUT is a .gguf file for "
        "llama.cpp's kimi-k3 (Kimi Linear backbone; --dtype float32 default, float16, bfloat16; docs/serving.md); "
        "mlx: a kimi_k3 directory for mlx-lm",
    )
    p.add_argument(
        "--residual",
        choices=("block", "full", "prenorm"),
        default=None,
        help="retrofit: residual scheme (default block)",
    )
    p.add_argument(
        "--attnres-blocks",
        dest="attnres_blocks",
        type=int,
        default=None,
        help="retrofit: number of depth blocks N for --residual block",
    )
    p.add_argument(
        "--attnres-block-size",
        dest="attnres_block_size",
        type=int,
        default=None,
        help="retrofit: sublayers per depth block S (instead of N)",
    )
    p.add_argument(
        "--max-seq-len",
        dest="max_seq_len",
        type=int,
        default=None,
        help="retrofit: longest input (default: the source's max_position_embeddings)",
    )
    add_set_option(p, "retrofit: another ModelConfig option, e.g. --set attnres_impl=fused")
    p.add_argument(
        "--dtype",
        choices=("auto", "float32", "float64", "bfloat16", "float16"),
        default="auto",
        help="weight dtype of the result (default: the source's; gguf: float32; mlx: float32, float16 or bfloat16)",
    )
    p.add_argument("--no-verify", action="store_true", help="retrofit: skip loading the source model to compare logits")
    p.add_argument(
        "--force",
        action="store_true",
        help="replace an existing output (a model directory or .gguf file written earlier) once the new one is "
        "complete; a run directory of attnres train is never replaced",
    )
    p.set_defaults(func=run)


def run(args) -> int:
    try:
        import attnres.hf as hf
    except ImportError as e:
        missing = (e.name or "").split(".")[0]
        # the hf extra absent (transformers, accelerate, or what they import) or too old: install it; an
        # attnres module that fails to import is a fault of its own and keeps its traceback
        if missing != "attnres" and (e.name or "transformers" in str(e)):
            raise CLIError(f"attnres convert needs transformers: pip install 'attnres[hf]' ({e})") from e
        raise
    nested = nested_paths(args.source, args.out)
    if nested is not None:  # --force would replace the source's own files (config.json, tokenizer.json)
        raise CLIError(f"{nested}; write the converted model to a directory outside {args.source}")
    if args.to in ("gguf", "mlx"):
        return _to_serving(args)
    retrofit = {
        **parse_set(args.set),
        **{key: getattr(args, key) for key in RETROFIT_ARGS if getattr(args, key) is not None},
    }
    hf.convert_directory(
        args.source,
        args.out,
        to=args.to,
        retrofit=retrofit,
        dtype=args.dtype,
        verify=not args.no_verify,
        force=args.force,
    )
    return 0


def _to_serving(args) -> int:
    """--to gguf / mlx: attnres.serving's convert_to_gguf / convert_to_mlx (no retrofit options: the
    source is one model)."""
    from attnres.serving.gguf import ServingError, convert_to_gguf
    from attnres.serving.mlx import convert_to_mlx

    given = [
        flag
        for flag, on in (
            ("--residual", args.residual),
            ("--attnres-blocks", args.attnres_blocks),
            ("--attnres-block-size", args.attnres_block_size),
            ("--max-seq-len", args.max_seq_len),
            ("--set", args.set),
        )
        if on
    ]
    if given:
        raise CLIError(
            f"{', '.join(given)} do not apply to --to {args.to}: it writes the model as it is; convert or "
            "retrofit first (attnres convert SOURCE OUT --to hf ...), then export that directory"
        )
    try:
        if args.to == "gguf":
            convert_to_gguf(args.source, args.out, dtype=args.dtype, force=args.force)
        else:
            convert_to_mlx(args.source, args.out, dtype=args.dtype, force=args.force)
    except ServingError as e:
        raise CLIError(str(e)) from None
    return 0
