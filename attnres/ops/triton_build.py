"""A build check of every Triton kernel in ``attnres.ops`` for a GPU architecture, without a GPU.

Interpret mode (how the tests run the kernels on a CPU) executes them as numpy code and never
reaches the compiler; ``compile_check`` runs the real pipeline (front end, LLVM, ptxas) on the
variants the launchers would pick, and reports registers and spills.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import triton

from attnres.ops.depth_attention import triton as da
from attnres.ops.two_phase import triton as tp
from attnres.ops.two_phase import triton_backward as tpb
from attnres.ops.two_phase import triton_merge_norm as tmn

# pointers in the sources' dtype; every other pointer is in the compute dtype
_DEPTH_ATTENTION_SOURCE_POINTERS = frozenset({"v0_ptr", "v1_ptr", "v2_ptr", "h_ptr", "gh_ptr", "dv_ptr"})
_PHASE1_SOURCE_POINTERS = frozenset({"v_ptr"})


def _aot_signature(fn, dtype: str, constexprs: Mapping[str, object], source_pointers) -> dict[str, str]:
    """Argument types for ``triton.compile``: source/compute-dtype pointers, i32, fp32 eps (any ``*eps``)."""
    compute = "fp64" if dtype == "fp64" else "fp32"
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = f"*{dtype if name in source_pointers else compute}"
        else:
            sig[name] = "fp32" if name.endswith("eps") else "i32"
    return sig


def compile_check(arch: int = 90, d: int = 1024, heads: int = 1) -> dict[str, tuple[int, int]]:
    """Compile the kernels for ``sm_{arch}`` without a GPU (front end, LLVM and ptxas).

    Interpret mode runs the kernels as numpy code and cannot see compiler errors;
    this builds a representative set of variants with the tile sizes the launchers
    would pick for width ``d``. Returns {variant: (registers, spill stack bytes)}
    (-1 when cuobjdump is not found). Needs the ptxas that ships in the triton wheel,
    and must run in a process without TRITON_INTERPRET=1.
    """
    import re
    import subprocess
    import tempfile

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if da.INTERPRETED:
        raise RuntimeError("compile_check needs a process without TRITON_INTERPRET=1")
    target = GPUTarget("cuda", arch, 32)
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    fwd_tile = da.tile_shape(heads, d, per_thread=16, max_warps=8)
    bwd_tile = da.tile_shape(heads, d, per_thread=8, max_warps=16)
    bh, bdh = da.pow2(heads), da.pow2(d // heads)
    variants = []
    for dtype, softmax, norm, per_token in (
        ("bf16", True, True, False),
        ("fp32", False, False, True),
        ("fp64", True, True, True),
    ):
        bt, _, _, warps = fwd_tile
        variants.append(
            (
                f"fwd {dtype} softmax={softmax} norm={norm} per_token={per_token}",
                da._depth_attn_fwd_kernel,
                dtype,
                warps,
                _DEPTH_ATTENTION_SOURCE_POINTERS,
                dict(D=d, SOFTMAX=softmax, NORM=norm, PER_TOKEN=per_token, BLOCK_T=bt, BLOCK_H=bh, BLOCK_DH=bdh),
            )
        )
        bt, _, _, warps = bwd_tile
        variants.append(
            (
                f"bwd {dtype} softmax={softmax} norm={norm} per_token={per_token}",
                da._depth_attn_bwd_kernel,
                dtype,
                warps,
                _DEPTH_ATTENTION_SOURCE_POINTERS,
                dict(
                    D=d,
                    SOFTMAX=softmax,
                    NORM=norm,
                    PER_TOKEN=per_token,
                    DELTA_FROM_H=dtype != "bf16",
                    BLOCK_T=bt,
                    BLOCK_H=bh,
                    BLOCK_DH=bdh,
                ),
            )
        )
    bt, bs, _, _, warps = tp._phase1_tile(heads, d, 4)
    variants.append(
        (
            "phase1 bf16 S=4",
            tp._phase1_kernel,
            "bf16",
            warps,
            _PHASE1_SOURCE_POINTERS,
            dict(D=d, SOFTMAX=True, NORM=True, BLOCK_T=bt, BLOCK_S=bs, BLOCK_H=bh, BLOCK_DH=bdh),
        )
    )
    bt, bs, _, _, warps = tpb._backward_tile(heads, d, 4)
    variants.append(
        (
            "phase1 backward bf16 S=4",
            tpb._phase1_bwd_kernel,
            "bf16",
            warps,
            _PHASE1_SOURCE_POINTERS,
            dict(
                D=d,
                SOFTMAX=True,
                NORM=True,
                GRAD_LSE=True,
                NEEDS_DU=True,
                BLOCK_T=bt,
                BLOCK_S=bs,
                BLOCK_H=bh,
                BLOCK_DH=bdh,
            ),
        )
    )
    variants.append(
        (
            "merge fp32",
            tp._merge_kernel,
            "fp32",
            fwd_tile[3],
            frozenset(),
            dict(D=d, SOFTMAX=True, BLOCK_T=fwd_tile[0], BLOCK_H=bh, BLOCK_DH=bdh),
        )
    )
    bt, bd, warps = tmn._tile(d)
    for fn in (tmn._merge_norm_fwd_kernel, tmn._merge_norm_bwd_kernel):
        direction = "forward" if fn is tmn._merge_norm_fwd_kernel else "backward"
        variants.append(
            (
                f"merge_norm {direction} fp32",
                fn,
                "fp32",
                warps,
                frozenset(),
                dict(D=d, NORM=True, WEIGHT=True, BLOCK_T=bt, BLOCK_D=bd),
            )
        )
    report = {}
    for name, fn, dtype, warps, source_pointers, constexprs in variants:
        src = ASTSource(fn, _aot_signature(fn, dtype, constexprs, source_pointers), constexprs)
        kernel = triton.compile(src, target=target, options={"num_warps": warps})
        regs = stack = -1
        if os.path.exists(cuobjdump):
            with tempfile.TemporaryDirectory() as tmp:
                path = os.path.join(tmp, "kernel.cubin")
                with open(path, "wb") as f:
                    f.write(kernel.asm["cubin"])
                out = subprocess.run([cuobjdump, "-res-usage", path], capture_output=True, text=True).stdout
            found = re.search(r"REG:(\d+).*?STACK:(\d+)", out, re.S)
            if found:
                regs, stack = int(found.group(1)), int(found.group(2))
        report[name] = (regs, stack)
    return report
