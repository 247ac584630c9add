"""MXFP4 weights (OCP microscaling: 4-bit e2m1 values in groups of 32 sharing an e8m0 scale), as Kimi
K3's routed experts are released (compressed-tensors' ``weight_packed`` / ``weight_scale`` pairs),
dequantised to float32 on loading. Every MXFP4 number, e2m1 (at most two significant bits) times a power
of two, is a float32 (and, but for exponents below 2^-133, a bfloat16) exactly, so nothing is rounded.

Layout (mlx's ``mode="mxfp4"`` reads the same bytes; ``tests/kimi/test_k3.py`` checks ours against it):
``packed`` uint8 [..., n/2], element 2j in the low nibble of byte j and 2j+1 in the high one;
``scales`` uint8 [..., n/32], the group's scale 2^(s - 127).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from attnres.hf.convert import ConversionError

GROUP = 32
PACKED, SCALE = ".weight_packed", ".weight_scale"
# e2m1: sign bit, two exponent bits, one mantissa bit
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 [..., n] of MXFP4 ``packed`` uint8 [..., n/2] with ``scales`` uint8 [..., n/32]."""
    if packed.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ConversionError(f"MXFP4 weights are uint8 bytes and uint8 scales, not {packed.dtype} / {scales.dtype}")
    n = 2 * packed.shape[-1]
    if n % GROUP or tuple(scales.shape) != (*packed.shape[:-1], n // GROUP):
        raise ConversionError(
            f"MXFP4 weight of {n} columns in groups of {GROUP} needs scales {(*packed.shape[:-1], n // GROUP)}, "
            f"not {tuple(scales.shape)}"
        )
    nibbles = torch.stack([packed & 15, packed >> 4], dim=-1).reshape(*packed.shape[:-1], n).long()
    values = torch.tensor(E2M1, dtype=torch.float32)[nibbles]
    scale = torch.exp2(scales.to(torch.float32) - 127.0).repeat_interleave(GROUP, dim=-1)
    return values * scale


def dequantize_packed(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` with every ``X.weight_packed`` / ``X.weight_scale`` pair replaced by ``X.weight``
    (float32); a packed weight without its scale is a ConversionError naming it."""
    out = {k: v for k, v in tensors.items() if not k.endswith((PACKED, SCALE))}
    for name in (k for k in tensors if k.endswith(PACKED)):
        base = name[: -len(PACKED)]
        if base + SCALE not in tensors:
            raise ConversionError(f"cannot convert: {name} (MXFP4) has no {base + SCALE}")
        out[base + ".weight"] = dequantize_mxfp4(tensors[name], tensors[base + SCALE])
    orphans = [k for k in tensors if k.endswith(SCALE) and k[: -len(SCALE)] + PACKED not in tensors]
    if orphans:
        raise ConversionError(f"cannot convert: scales without packed weights: {orphans[:4]}")
    return out
