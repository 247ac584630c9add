"""The ``attnres`` command: train, eval, sample, demo."""
from __future__ import annotations

import argparse
import ast
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from attnres.parallel import PIPELINE_SCHEDULES

DEMO_SCHEMES = ("prenorm", "block", "full")


class CLIError(Exception):
    """A user error: printed as one line, no traceback."""


# ----------------------------------------------------------------------------- option parsing


def _parse_value(text: str) -> Any:
    lowered = text.lower()
    if lowered in ("none", "null"):
        return None
    if lowered in ("true", "false"):
        return lowered == "true"
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def _collect_overrides(args) -> Dict[str, Any]:
    overrides: Dict[str, Any] = {}
    if getattr(args, "config", None):
        from attnres.train.config import load_toml

        overrides.update(load_toml(args.config))
    for item in getattr(args, "set", None) or []:
        if "=" not in item:
            raise CLIError(f"--set {item!r}: expected KEY=VALUE, e.g. --set d_model=256")
        key, value = item.split("=", 1)
        overrides[key.strip().replace("-", "_")] = _parse_value(value.strip())
    for key in ("preset", "residual", "steps", "data", "lr", "optimizer", "device", "precision", "seed",
                "batch_size", "seq_len", "tokenizer", "schedule", "dp", "pp", "vpp", "microbatches",
                "pp_schedule"):
        value = getattr(args, key, None)
        if value is not None:
            overrides[key] = value
    if overrides.get("schedule") in PIPELINE_SCHEDULES:  # --schedule names either kind of schedule
        overrides["pp_schedule"] = overrides.pop("schedule")
    if getattr(args, "fsdp", False):
        overrides["fsdp"] = True
    if getattr(args, "no_pp_cache", False):
        overrides["pp_cache"] = False
    if getattr(args, "out", None):
        overrides["out_dir"] = args.out
    if getattr(args, "no_progress", False):
        overrides["progress"] = False
    return overrides


def _add_run_options(p: argparse.ArgumentParser, *, preset_default: Optional[str]) -> None:
    from attnres.train.config import PRESETS

    p.add_argument("--preset", default=None,
                   help=f"named preset: {', '.join(PRESETS)} (default: {preset_default})")
    p.add_argument("--config", help="TOML file with model and training options ([model]/[train] tables "
                                     "or top-level keys; flags override it)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="any ModelConfig or TrainConfig field, e.g. --set d_model=256 --set attnres_blocks=4")
    p.add_argument("--data", help="text file, directory, glob, or .jsonl with a 'text' field "
                                  "(default: the bundled Shakespeare corpus)")
    p.add_argument("--steps", type=int, help="optimizer steps")
    p.add_argument("--lr", type=float, help="learning rate (AdamW and Muon)")
    p.add_argument("--optimizer", choices=("muon", "adamw"))
    p.add_argument("--schedule", choices=("wsd", "cosine", "constant") + PIPELINE_SCHEDULES,
                   help="learning-rate schedule (wsd, cosine, constant) or, with --pp, the pipeline "
                        f"schedule ({', '.join(PIPELINE_SCHEDULES)})")
    p.add_argument("--batch-size", dest="batch_size", type=int)
    p.add_argument("--seq-len", dest="seq_len", type=int)
    p.add_argument("--tokenizer", choices=("bpe", "byte"))
    p.add_argument("--seed", type=int)
    p.add_argument("--device", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--precision", choices=("fp32", "bf16"))
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


# ----------------------------------------------------------------------------- commands


def cmd_train(args) -> int:
    from attnres.train.config import build_configs
    from attnres.train.trainer import Trainer

    model_cfg, train_cfg = build_configs("demo", _collect_overrides(args))
    trainer = Trainer(model_cfg, train_cfg, resume=args.resume)
    say = print if trainer.is_main else (lambda *a, **k: None)
    layout = ""
    if train_cfg.pp > 1:
        layout = (f"; pipeline pp={train_cfg.pp} vpp={train_cfg.vpp} {train_cfg.pp_schedule}, "
                  f"{train_cfg.pipeline_microbatches} microbatches, caching {'on' if train_cfg.pp_cache else 'off'}"
                  + (f", {train_cfg.dp} replicas" if train_cfg.dp > 1 else ""))
    elif train_cfg.dp > 1:
        layout = f"; data parallel dp={train_cfg.dp} ({'FSDP2' if train_cfg.fsdp else 'DDP'})"
    say(f"model: {model_cfg.residual}, {trainer.n_params:,} parameters, "
        f"{model_cfg.n_layers} blocks x d={model_cfg.d_model}; data: "
        f"{len(trainer.data.train_names)} train / {len(trainer.data.val_names)} validation documents{layout}")
    result = trainer.run()
    if train_cfg.pp > 1:
        from attnres.parallel.report import gather_traffic, traffic_table

        pipe = trainer.strategy.pipeline
        mode = "cached" if train_cfg.pp_cache else "naive"
        measured = gather_traffic(pipe)
        if pipe.steps_run:
            say(traffic_table({mode: pipe.layout}, {mode: measured}, steps=pipe.steps_run,
                              microbatches=pipe.microbatches))
    say(f"step {result.steps}: val loss {result.val_loss:.4f} nats/token, "
        f"{result.val_bpb:.4f} bits/byte, {result.tokens_per_second:,.0f} tokens/s -> {result.out_dir}")
    return 0


def cmd_eval(args) -> int:
    from attnres.data import prepare_data
    from attnres.train.trainer import evaluate, load_model

    model, _, state = load_model(args.run, device=args.device)
    tc = state["train_config"]
    data = prepare_data(data=args.data if args.data else tc["data"], tokenizer=tc["tokenizer"],
                        vocab_size=tc["vocab_size"], val_fraction=tc["val_fraction"],
                        cache_dir=tc.get("cache_dir"))
    ev = evaluate(model, data.val, batch_size=tc["batch_size"], seq_len=tc["seq_len"],
                  max_batches=args.batches)
    print(json.dumps({"step": state["step"], **ev}))
    return 0


def cmd_sample(args) -> int:
    import torch

    from attnres.sampling import generate
    from attnres.train.trainer import load_model

    model, tokenizer, _ = load_model(args.run, device=args.device)
    if tokenizer is None:
        raise CLIError(f"{args.run} has no tokenizer.json; pass the run directory written by attnres train")
    ids = tokenizer.encode(args.prompt)
    if not ids:
        raise CLIError("--prompt encodes to no tokens; give a non-empty prompt")
    sys.stdout.write(args.prompt)
    sys.stdout.flush()
    out: List[int] = []
    text = ""
    for tok in generate(model, torch.tensor([ids]), args.max_new_tokens, temperature=args.temperature,
                        top_k=args.top_k, top_p=args.top_p, seed=args.seed):
        out.append(tok)
        new_text = tokenizer.decode(out)
        if args.stop and args.stop in new_text:
            sys.stdout.write(new_text[len(text):new_text.index(args.stop) + len(args.stop)])
            break
        sys.stdout.write(new_text[len(text):])
        sys.stdout.flush()
        text = new_text
    sys.stdout.write("\n")
    return 0


def _summary_if_complete(run_dir: Path, model_cfg, train_cfg) -> Optional[dict]:
    """A finished run with exactly these configs, or None."""
    try:
        cfg = json.loads((run_dir / "config.json").read_text())
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    same_model = {k: v for k, v in cfg["model"].items() if k != "vocab_size"} == \
        {k: v for k, v in model_cfg.to_dict().items() if k != "vocab_size"}
    ignore = {"progress", "threads"}
    same_train = {k: v for k, v in cfg["train"].items() if k not in ignore} == \
        {k: v for k, v in train_cfg.to_dict().items() if k not in ignore}
    return summary if same_model and same_train and summary.get("steps") == train_cfg.steps else None


def cmd_demo(args) -> int:
    """Train prenorm, Block AttnRes and Full AttnRes on the same data, seed and budget; report."""
    from attnres.analysis.depth import depth_weight_matrix, record_on_batch, source_labels
    from attnres.analysis.plots import plot_depth_heatmaps, plot_loss_curves
    from attnres.data import eval_batches
    from attnres.train.checkpoint import CheckpointError
    from attnres.train.config import build_configs
    from attnres.train.trainer import Trainer, load_model

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    overrides = _collect_overrides(args)
    overrides.pop("out_dir", None)
    started = time.time()
    rows, heatmaps = [], {}
    for scheme in DEMO_SCHEMES:
        run_dir = out / scheme
        model_cfg, train_cfg = build_configs("demo", {**overrides, "residual": scheme,
                                                           "out_dir": str(run_dir)})
        summary = None if args.fresh else _summary_if_complete(run_dir, model_cfg, train_cfg)
        if summary is not None:
            print(f"[{scheme}] reusing the finished run in {run_dir} (--fresh retrains)")
            model, _, _ = load_model(str(run_dir))
            from attnres.data import prepare_data

            tc = train_cfg
            val = prepare_data(data=tc.data, tokenizer=tc.tokenizer, vocab_size=tc.vocab_size,
                               val_fraction=tc.val_fraction, cache_dir=tc.cache_dir).val
        else:
            resume = (not args.fresh) and (run_dir / "checkpoint" / "state.json").exists()
            try:
                trainer = Trainer(model_cfg, train_cfg, resume=resume)
            except (CheckpointError, ValueError) as e:
                if not resume:
                    raise
                print(f"[{scheme}] cannot resume ({e}); training from scratch")
                trainer = Trainer(model_cfg, train_cfg, resume=False)
            print(f"[{scheme}] {trainer.model.num_params():,} parameters, {train_cfg.steps} steps "
                  f"of {train_cfg.batch_size}x{train_cfg.seq_len} tokens")
            summary = trainer.run().__dict__
            model, val = trainer.model, trainer.data.val
        rows.append((scheme, summary))
        if scheme != "prenorm":
            x, _ = next(iter(eval_batches(val.tokens, 4, train_cfg.seq_len, max_batches=1)))
            record = record_on_batch(model, x.to(next(model.parameters()).device))
            matrix = depth_weight_matrix(record)
            path = out / f"depth_weights_{scheme}.png"
            plot_depth_heatmaps(matrix, source_labels(record), str(path),
                                f"{scheme} AttnRes: mean depth weights on validation text")
            heatmaps[scheme] = path.name
    curves = plot_loss_curves({s: str(out / s) for s in DEMO_SCHEMES}, str(out / "loss_curves.png"),
                              "prenorm vs Block AttnRes vs Full AttnRes")
    table = _demo_table(rows)
    print()
    print(table)
    _write_demo_report(out, table, heatmaps, Path(curves).name, time.time() - started, args, train_cfg,
                       model_cfg)
    print(f"\nreport: {out / 'REPORT.md'}")
    return 0


def _demo_table(rows) -> str:
    base = dict(rows)["prenorm"]["step_seconds"]
    lines = ["| scheme | params | tokens | val loss (nats/token) | bits/byte | tokens/s | step time vs prenorm |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for scheme, s in rows:
        lines.append(f"| {scheme} | {s['params']:,} | {s['tokens']:,} | {s['val_loss']:.4f} | "
                     f"{s['val_bpb']:.4f} | {s['tokens_per_second']:,.0f} | {s['step_seconds'] / base:.2f}x |")
    return "\n".join(lines)


def _write_demo_report(out: Path, table: str, heatmaps: dict, curves: str, wall: float, args,
                       train_cfg, model_cfg) -> None:
    from attnres.experiments.env import machine

    cmd = "attnres " + " ".join(sys.argv[1:]) if sys.argv and sys.argv[0].endswith("attnres") \
        else "attnres demo"
    lines = [
        "# attnres demo",
        "",
        f"Command: `{cmd}`  ",
        f"Machine: {machine()}  ",
        f"Wall time (this invocation, including data preparation and reused runs): {wall / 60:.1f} min",
        "",
        f"Model: {model_cfg.n_layers} Transformer blocks ({model_cfg.n_sublayers} sublayers), "
        f"d_model={model_cfg.d_model}, {model_cfg.n_heads} heads; Block AttnRes with "
        f"S={build_block_size(model_cfg)} sublayers per block. Training: {train_cfg.steps} steps x "
        f"{train_cfg.batch_size} x {train_cfg.seq_len} tokens, {train_cfg.optimizer}, "
        f"{train_cfg.schedule} schedule, lr {train_cfg.lr}, seed {train_cfg.seed}; "
        f"same data order for every scheme.",
        "",
        "Validation loss is measured on whole held-out works; one seed, so differences of a few "
        "hundredths may be noise (the experiments report several seeds). Step time is the median "
        "optimizer step (forward + backward + update) measured in the same process.",
        "",
        table,
        "",
        f"![loss curves]({curves})",
        "",
    ]
    for scheme, png in heatmaps.items():
        lines += [f"### {scheme}: depth weights (pre-attention and pre-MLP inputs)", "", f"![{scheme}]({png})", ""]
    (out / "REPORT.md").write_text("\n".join(lines))


def build_block_size(model_cfg) -> int:
    from attnres.model import ModelConfig

    return ModelConfig(**{**model_cfg.to_dict(), "residual": "block"}).block_size


def cmd_bench(args) -> int:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.what == "train":
        from attnres.bench import train as bench

        cfg = bench.BenchConfig.quick() if args.quick else bench.BenchConfig()
    elif args.what == "decode":
        from attnres.bench import decode as bench

        cfg = bench.DecodeBenchConfig.quick() if args.quick else bench.DecodeBenchConfig()
    elif args.what == "pipeline":
        from attnres.bench import pipeline as bench

        cfg = bench.PipelineBenchConfig.quick() if args.quick else bench.PipelineBenchConfig()
    else:
        from attnres.bench import op as bench

        cfg = bench.OpBenchConfig.quick() if args.quick else bench.OpBenchConfig()
    for item in args.set or []:
        if "=" not in item:
            raise CLIError(f"--set {item!r}: expected KEY=VALUE, e.g. --set d_model=512")
        key, value = item.split("=", 1)
        if not hasattr(cfg, key):
            raise CLIError(f"--set {key}: unknown benchmark option; known: {sorted(cfg.__dict__)}")
        setattr(cfg, key, _parse_value(value))
    if args.variants:
        if args.what in ("op", "pipeline"):
            raise CLIError("--variants applies to `attnres bench train` and `attnres bench decode`")
        cfg.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    cfg.device = args.device
    result = bench.run(cfg, memory=not args.no_memory) if args.what == "train" else bench.run(cfg)
    if not result.get("is_main", True):  # other torchrun ranks: rank 0 reports
        return 0
    print(bench.format_table(result))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
        print(f"\nwritten: {args.json}")
    return 0


def cmd_schemes(args) -> int:
    from attnres.model import ModelConfig
    from attnres.model.schemes_table import schemes_table
    from attnres.train.config import PRESETS

    overrides = {}
    for item in args.set or []:
        if "=" not in item:
            raise CLIError(f"--set {item!r}: expected KEY=VALUE, e.g. --set d_model=256")
        key, value = item.split("=", 1)
        overrides[key.strip()] = _parse_value(value.strip())
    base = {**PRESETS["demo"]["model"], "vocab_size": 4096} if args.preset is None else \
        {**PRESETS[args.preset]["model"]}
    print(schemes_table(ModelConfig(**{**base, **overrides, "residual": "prenorm"})))
    return 0


def cmd_convert(args) -> int:
    """Retrofit a Hugging Face LLaMA / Mistral / Qwen2 model into AttnRes, or convert between the
    trainer's native checkpoints and the Hugging Face format (``attnres.hf``)."""
    import shutil

    try:
        import torch

        import attnres.hf as hf
    except ImportError as e:
        raise CLIError(f"attnres convert needs transformers: pip install 'attnres[hf]' ({e})")
    src, out = Path(args.source), Path(args.out)
    if (src / "state.json").is_file() or (src / "checkpoint" / "state.json").is_file():
        kind = "native"
    elif (src / "config.json").is_file():
        model_type = json.loads((src / "config.json").read_text()).get("model_type")
        kind = "attnres" if model_type == hf.AttnResConfig.model_type else "pretrained"
    else:
        raise CLIError(f"{src} is neither a Hugging Face model directory (config.json) nor a run or "
                       "checkpoint directory of attnres train (state.json)")
    to = args.to or ("native" if kind == "attnres" else "hf")
    retrofit_options = [flag for flag, value in (
        ("--residual", args.residual), ("--attnres-blocks", args.attnres_blocks),
        ("--attnres-block-size", args.attnres_block_size), ("--max-seq-len", args.max_seq_len),
        ("--set", args.set)) if value is not None]
    if kind != "pretrained" and retrofit_options:
        raise CLIError(f"{', '.join(retrofit_options)} apply only when retrofitting a pretrained "
                       f"LLaMA / Mistral / Qwen2 directory; {src} is {'a native checkpoint' if kind == 'native' else 'already AttnRes'}")
    if (kind, to) in (("native", "native"), ("attnres", "hf")):
        raise CLIError(f"{src} is already in the {to} format; pick --to {'hf' if to == 'native' else 'native'}")
    if to == "hf" and out.exists() and any(out.iterdir()) and not args.force:
        raise CLIError(f"{out} exists and is not empty; pass --force to write into it")
    dtype = None if args.dtype == "auto" else getattr(torch, args.dtype)

    tokenizer_json = None
    if kind == "native":
        from attnres.train.trainer import load_model

        lm, tokenizer, _ = load_model(str(src))
        model = hf.AttnResForCausalLM.from_attnres_lm(lm)
        if dtype is not None:
            model = model.to(dtype)
        model.save_pretrained(str(out))
        if tokenizer is not None:
            hf.hf_tokenizer(tokenizer).save_pretrained(str(out))
        print(f"native checkpoint {src} -> Hugging Face AttnResForCausalLM in {out}"
              f"{'' if tokenizer is None else ' (with its tokenizer)'}")
        return 0
    from transformers import AutoModelForCausalLM

    load_kw = {"local_files_only": True, **({} if dtype is None else {"dtype": dtype})}
    if kind == "attnres":
        model = AutoModelForCausalLM.from_pretrained(str(src), **load_kw)
        tokenizer_json = src / "tokenizer.json"
    else:
        options = {}
        for item in args.set or []:
            if "=" not in item:
                raise CLIError(f"--set {item!r}: expected KEY=VALUE, e.g. --set attnres_impl=fused")
            key, value = item.split("=", 1)
            options[key.strip().replace("-", "_")] = _parse_value(value.strip())
        residual = args.residual or "block"
        kwargs = dict(residual=residual, attnres_blocks=args.attnres_blocks,
                      attnres_block_size=args.attnres_block_size, max_seq_len=args.max_seq_len, **options)
        if args.no_verify:
            model = hf.convert_to_attnres(str(src), dtype=dtype, **kwargs)
        else:
            source = AutoModelForCausalLM.from_pretrained(str(src), **load_kw).eval()
            model = hf.convert_to_attnres(source, copy_weights=False, **kwargs)
            err = hf.convert.conversion_error(source, model)
            print(f"max |logit difference| source vs AttnRes on random tokens: {err:.3g} "
                  f"({model.dtype}; zero queries make them equal up to RMSNorm eps, see attnres.hf.convert)")
        c = model.config
        blocks = f", {c.model_config().num_blocks} depth blocks" if residual == "block" else ""
        print(f"{src}: {c.n_layers} layers, d_model={c.d_model} -> residual={residual}{blocks}")
        tokenizer_json = src / "tokenizer.json"
        if to == "hf":
            model.save_pretrained(str(out))
            copied = hf.convert.copy_tokenizer_files(src, out)
            print(f"written {out}{' with ' + ', '.join(copied) if copied else ''}")
            return 0
    path = hf.hf_to_native(model, out)
    if tokenizer_json is not None and tokenizer_json.is_file():
        shutil.copy2(tokenizer_json, path / "tokenizer.json")
    print(f"written native weights-only checkpoint {path} (attnres sample / load_model read it)")
    return 0


def cmd_experiment(args) -> int:
    """Run (or with --dry-run, list) the runs of a named experiment spec; finished runs are skipped."""
    from attnres.experiments import DEFAULT_RUNS_ROOT, available, format_plan, load_spec, plan_status, run_experiment
    from attnres.experiments.runner import planned_elsewhere

    if not args.name:
        print("experiments: " + (", ".join(available(args.specs)) or "none found"))
        return 0
    spec = load_spec(args.name, args.specs)
    runs = args.runs or DEFAULT_RUNS_ROOT
    if args.dry_run:
        print(format_plan(spec, plan_status(spec, runs), args.only, planned_elsewhere(spec)))
        return 0
    flags = [("--max-runs", args.max_runs), ("--only", args.only), ("--threads", args.threads),
             ("--runs", args.runs), ("--specs", args.specs)]
    command = " ".join(["attnres experiment", args.name] + [f"{k} {v}" for k, v in flags if v is not None]
                       + (["--retry-diverged"] if args.retry_diverged else []))
    counts = run_experiment(spec, runs, max_runs=args.max_runs, only=args.only,
                            retry_diverged=args.retry_diverged, progress=not args.no_progress,
                            threads=args.threads, command=command)
    print(f"{spec.name}: " + ", ".join(f"{v} {k}" for k, v in counts.items())
          + f"; report with `attnres report {args.name}`")
    return 0


def cmd_report(args) -> int:
    """Write reports/NAME/REPORT.md and its figures from the cached runs (no training)."""
    from attnres.experiments import DEFAULT_RUNS_ROOT, load_spec
    from attnres.experiments.report import write_report

    spec = load_spec(args.name, args.specs)
    flags = [("--runs", args.runs), ("--specs", args.specs), ("--out", args.out)]
    command = " ".join(["attnres report", args.name] + [f"{k} {v}" for k, v in flags if v is not None])
    print(f"report: {write_report(spec, args.runs or DEFAULT_RUNS_ROOT, args.out, command=command)}")
    return 0


# ----------------------------------------------------------------------------- entry point


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="attnres", description="Attention Residuals: train, evaluate, sample, and the demo.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("train", help="train a model", description=(
        "Train a decoder LM with a chosen residual scheme. Options come from a preset, then a TOML "
        "--config, then flags and --set KEY=VALUE. Example: attnres train --preset demo --residual "
        "block --out runs/block"))
    _add_run_options(p, preset_default="demo")
    p.add_argument("--residual", help="a residual scheme: see `attnres schemes`")
    p.add_argument("--out", help="run directory (checkpoint, metrics, tokenizer, summary)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its checkpoint")
    g = p.add_argument_group("parallelism (launch with torchrun --nproc-per-node K -m attnres train ...)")
    g.add_argument("--dp", type=int, help="data-parallel ranks (DDP; the global batch is split over them)")
    g.add_argument("--fsdp", action="store_true", help="with --dp: shard with FSDP2 instead of DDP")
    g.add_argument("--pp", type=int, help="pipeline-parallel ranks")
    g.add_argument("--vpp", type=int, help="virtual pipeline stages per rank (Interleaved1F1B, LoopedBFS)")
    g.add_argument("--pp-schedule", dest="pp_schedule", choices=PIPELINE_SCHEDULES,
                   help="pipeline schedule (also accepted as --schedule NAME)")
    g.add_argument("--microbatches", type=int, help="pipeline microbatches per batch (default pp * vpp)")
    g.add_argument("--no-pp-cache", dest="no_pp_cache", action="store_true",
                   help="send the whole block history at every stage transition (no cross-stage caching)")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("eval", help="validation loss of a trained run", description=(
        "Evaluate a run's checkpoint on its validation split (or on --data)."))
    p.add_argument("run", help="run directory or checkpoint directory")
    p.add_argument("--data", help="evaluate on this data's validation split instead")
    p.add_argument("--batches", type=int, default=None, help="number of validation batches (default: all)")
    p.add_argument("--device", default="cpu")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("sample", help="generate text from a trained run", description=(
        "Generate text from a run's checkpoint, streaming it to stdout."))
    p.add_argument("run", help="run directory")
    p.add_argument("--prompt", default="ROMEO:\n")
    p.add_argument("--max-new-tokens", dest="max_new_tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", dest="top_k", type=int, default=None)
    p.add_argument("--top-p", dest="top_p", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop", default=None, help="stop after this string appears")
    p.add_argument("--device", default="cpu")
    p.set_defaults(func=cmd_sample)

    p = sub.add_parser("demo", help="the main job: prenorm vs Block vs Full AttnRes", description=(
        "Train prenorm, Block AttnRes and Full AttnRes with the same seed, data order and budget on the "
        "bundled Shakespeare corpus, print a table and write a report (loss curves, depth-weight "
        "heatmaps). Finished runs are reused; interrupted ones resume."))
    _add_run_options(p, preset_default="demo")
    p.add_argument("--out", default="runs/demo", help="report directory (default runs/demo)")
    p.add_argument("--fresh", action="store_true", help="retrain even if finished runs exist")
    p.set_defaults(func=cmd_demo)
    p = sub.add_parser("schemes", help="the residual schemes: classification and cost", description=(
        "Print every residual scheme in the registry with its Table-5 classification (weight type, "
        "source), the parameters it adds to a model, and the depth state it keeps per token."))
    p.add_argument("--preset", default=None, help="model size to count for (default: demo)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="model option, e.g. d_model=1024")
    p.set_defaults(func=cmd_schemes)

    p = sub.add_parser("bench", help="benchmarks: train (step time, memory), op (bandwidth), decode",
                       description=(
        "bench train: step time (forward + backward + AdamW step; --set optimizer=muon for the "
        "trainer's Muon) of prenorm, Block and Full AttnRes (or any schemes in --variants) on one "
        "config in one process, with ratios to prenorm, and peak memory from a fresh process per "
        "variant. bench op: the depth-attention op alone against this machine's copy bandwidth. bench "
        "decode: KV-cached prefill throughput and per-token decode latency, and the residual I/O per "
        "sublayer beside SPEC Table 1."))
    p.add_argument("what", choices=("train", "op", "decode", "pipeline"))
    p.add_argument("--quick", action="store_true", help="a smaller config (under 2 minutes on 2 cores)")
    p.add_argument("--variants", help="comma list of NAME[:IMPL][:FIELD=VALUE]..., e.g. prenorm,block,full,"
                   "block:reference,full:attnres_weights=low_rank_query:attnres_query_rank=8")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="benchmark option, e.g. d_model=512")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", help="also write the results here")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("convert", help="retrofit a HF LLaMA/Mistral/Qwen2 into AttnRes; native <-> HF",
                       description=(
        "SOURCE is a Hugging Face LLaMA, Mistral or Qwen2 causal-LM directory (retrofitted into AttnRes "
        "with zero-initialised queries, so its logits are unchanged up to RMSNorm eps), an AttnRes "
        "Hugging Face directory, or a run/checkpoint directory of attnres train. Needs transformers "
        "(pip install 'attnres[hf]'). Example: attnres convert ./llama ./llama-attnres --residual block "
        "--attnres-blocks 8"))
    p.add_argument("source", help="model directory (config.json + weights) or attnres run/checkpoint directory")
    p.add_argument("out", help="output directory")
    p.add_argument("--to", choices=("hf", "native"), default=None,
                   help="output format (default: hf, or native for an AttnRes HF source)")
    p.add_argument("--residual", choices=("block", "full", "prenorm"), default=None,
                   help="retrofit: residual scheme (default block)")
    p.add_argument("--attnres-blocks", dest="attnres_blocks", type=int, default=None,
                   help="retrofit: number of depth blocks N for --residual block")
    p.add_argument("--attnres-block-size", dest="attnres_block_size", type=int, default=None,
                   help="retrofit: sublayers per depth block S (instead of N)")
    p.add_argument("--max-seq-len", dest="max_seq_len", type=int, default=None,
                   help="retrofit: longest input (default: the source's max_position_embeddings)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", default=None,
                   help="retrofit: another ModelConfig option, e.g. --set attnres_impl=fused")
    p.add_argument("--dtype", choices=("auto", "float32", "float64", "bfloat16", "float16"), default="auto",
                   help="weight dtype of the result (default: the source's)")
    p.add_argument("--no-verify", action="store_true",
                   help="retrofit: skip loading the source model to compare logits")
    p.add_argument("--force", action="store_true", help="write into a non-empty output directory")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("experiment", help="run a named experiment (resumable; finished runs are skipped)",
                       description=(
        "Expand experiments/NAME.toml into runs, hash each run's full config, and train the missing ones "
        "one after another into RUNS/NAME/<hash>/ (interrupted runs resume from their checkpoint). Without "
        "NAME, list the experiments. Example: attnres experiment ablations --dry-run"))
    p.add_argument("name", nargs="?", help="experiment name (a spec in experiments/) or a .toml path")
    p.add_argument("--dry-run", action="store_true", help="list the runs, their state and estimated CPU time")
    p.add_argument("--max-runs", dest="max_runs", type=int, default=None, help="train at most K runs")
    p.add_argument("--only", help="only runs whose name (e.g. scheme=full/seed=1) or hash matches this glob")
    p.add_argument("--runs", default=None, help="runs directory (default experiments/runs, where the finished runs are committed)")
    p.add_argument("--specs", default=None, help="spec directory (default ./experiments)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (not part of the run hash)")
    p.add_argument("--retry-diverged", dest="retry_diverged", action="store_true",
                   help="train diverged runs again from scratch")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_experiment)

    p = sub.add_parser("report", help="write an experiment's REPORT.md and figures from its cached runs",
                       description=(
        "Read RUNS/NAME/<hash>/ of every planned run (no training) and write OUT/REPORT.md with tables, "
        "PNG figures, statistics over seeds, the commands, machine, wall time and git commit. A partial "
        "suite gives a report marked partial."))
    p.add_argument("name", help="experiment name (a spec in experiments/) or a .toml path")
    p.add_argument("--runs", default=None, help="runs directory (default experiments/runs, where the finished runs are committed)")
    p.add_argument("--specs", default=None, help="spec directory (default ./experiments)")
    p.add_argument("--out", default=None, help="report directory (default reports/NAME)")
    p.set_defaults(func=cmd_report)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    from attnres.train.checkpoint import CheckpointError
    from attnres.train.trainer import TrainingDiverged, TrainingInterrupted

    try:
        return args.func(args)
    except TrainingInterrupted as e:
        print(f"\n{e}", file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except (CLIError, CheckpointError, TrainingDiverged, ValueError, FileNotFoundError) as e:
        if os.environ.get("ATTNRES_DEBUG"):
            raise
        print(f"attnres {args.command}: error: {e}", file=sys.stderr)
        print("(set ATTNRES_DEBUG=1 for the full traceback)", file=sys.stderr)
        return 2
    finally:
        from attnres.parallel.runtime import leave_process_group

        leave_process_group()  # a command run under torchrun joined one


if __name__ == "__main__":
    sys.exit(main())
