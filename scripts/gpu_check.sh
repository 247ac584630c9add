#!/usr/bin/env bash
# The GPU check, one prepared script (docs/performance.md, "On a GPU"). On a CUDA machine (one H100/H200):
#   1. env       torch, CUDA, the device, this checkout's commit                          -> env.json
#   2. tests     the CUDA tests: Triton kernels against the reference (fp32 and bf16), the default
#                (Triton) path through whole Block / Full models, a compiled training step vs eager,
#                the Phase-1 custom op (attnres::phase1: reference, gradcheck, opcheck, fullgraph) -> tests.xml
#   3. op        attnres bench op: depth attention (and the Phase-1 custom op) against the device's
#                copy bandwidth                                                          -> op.json
#   4. train     attnres bench train, eager and compiled, bf16 autocast, PreNorm / Block / Full -> train.json
#   5. decode    attnres bench decode: prefill and per-token decoding                       -> decode.json
# at a GPU-sized config (d_model 1024, 24 layers, 4096 tokens), all results in one folder. Each step
# that finished leaves its file there and is skipped when the script runs again (a cut run resumes;
# --force runs everything again). Nothing is installed or downloaded: attnres runs from this checkout
# (PYTHONPATH) with the machine's torch and triton.
#
#   scripts/gpu_check.sh [--out DIR] [--force]      on the GPU machine (about 6-8 minutes on an H200)
#   scripts/gpu_check.sh --dry-run [--out DIR]       every step on the CPU at a tiny config (CI runs it;
#                                                    the tests step only collects, the suite runs them)
#
# PYTHON selects the interpreter (default: python3). A step that fails stops the script with its
# name; the files of the steps before it stay.
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
out="$here/gpu_check"
dry_run=0
force=0
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) dry_run=1 ;;
        --force) force=1 ;;
        --out) out="$2"; shift ;;
        -h|--help) awk 'NR > 1 && !/^#/ { exit } NR > 1' "$0"; exit 0 ;;  # the comment block above
        *) echo "gpu_check.sh: error: unknown argument '$1' (--dry-run, --force, --out DIR)" >&2; exit 2 ;;
    esac
    shift
done
py=${PYTHON:-python3}
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$out"
cd "$here"

if [ "$dry_run" = 1 ]; then
    device=cpu
    # the interpreter runs the Triton kernels on the CPU; the CUDA-only tests skip themselves
    export TRITON_INTERPRET=1
    # the test suite runs these files in the interpreter already: the dry run only checks that the step
    # finds and imports them (a renamed file or a broken import would cost a GPU session)
    test_mode=(--collect-only)
    op=(--quick --set repeats=2)
    sizes=(--set d_model=64 --set n_layers=2 --set seq_len=32 --set batch_size=2 --set blocks=2)
    train=("${sizes[@]}" --set repeats=2 --set warmup=1 --set profile_rounds=0 --no-memory)
    decode=(--set d_model=64 --set n_layers=2 --set blocks=2 --set prompt_len=16 --set decode_tokens=4
            --set repeats=1 --set profile_rounds=0)
else
    device=cuda
    test_mode=()
    if ! "$py" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
        echo "gpu_check.sh: error: no CUDA device visible to $py (use --dry-run on a CPU machine)" >&2
        exit 1
    fi
    op=(--set dtype=bfloat16 --set d_model=1024 --set seq_len=4096 --set batch_size=4)
    sizes=(--set d_model=1024 --set n_layers=24 --set n_heads=16 --set seq_len=4096 --set batch_size=1)
    train=("${sizes[@]}" --set dtype=bfloat16 --set repeats=5 --set warmup=2 --compile)
    decode=(--set d_model=1024 --set n_layers=24 --set n_heads=16 --set prompt_len=4096 --set decode_tokens=64
            --set repeats=3 --compile)
fi

step() {  # step NAME FILE COMMAND...: run unless FILE exists (or --force)
    local name=$1 file=$out/$2
    shift 2
    if [ -s "$file" ] && [ "$force" = 0 ]; then
        echo "== $name: done before ($file)"
        return
    fi
    echo "== $name"
    local start=$SECONDS
    if ! "$@"; then
        echo "gpu_check.sh: error: step '$name' failed; the results before it are in $out" >&2
        exit 1
    fi
    echo "== $name: $((SECONDS - start)) s"
}

env_json() {
    "$py" - "$out/env.json" "$device" <<'EOF'
import json, platform, subprocess, sys

import torch

path, device = sys.argv[1], sys.argv[2]
commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
info = {"device": device, "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
        "commit": commit or None, "gpu": torch.cuda.get_device_name() if device == "cuda" else None}
try:
    import triton
    info["triton"] = triton.__version__
except ImportError:
    info["triton"] = None
json.dump(info, open(path, "w"), indent=1)
print(info)
EOF
}

tests() {
    "$py" -m pytest -p no:cacheprovider -q -o addopts="" "${test_mode[@]}" --junitxml="$out/tests.xml" \
        tests/ops/depth_attention/test_depth_attention_triton.py tests/ops/two_phase/test_two_phase_triton.py \
        tests/ops/two_phase/test_two_phase_library.py tests/model/test_cuda.py
}

step env env.json env_json
step tests tests.xml tests
step "bench op" op.json "$py" -m attnres bench op --device "$device" "${op[@]}" --json "$out/op.json"
step "bench train" train.json "$py" -m attnres bench train --device "$device" --variants prenorm,block,full \
    "${train[@]}" --json "$out/train.json"
step "bench decode" decode.json "$py" -m attnres bench decode --device "$device" --variants prenorm,block,full \
    "${decode[@]}" --json "$out/decode.json"
echo "gpu_check.sh: all steps done; results in $out"
