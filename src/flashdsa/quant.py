"""FP8 e4m3 formats (pure PyTorch; see docs/conventions.md#fp8).

* ``quantize_fp8``: per-row, per-``block`` scaling of the last dim, used for the indexer's q and k.
* ``quantize_kv_fp8`` / ``dequantize_kv_fp8``: the DeepSeek-V3.2 656-byte MLA KV cache row::

      bytes [  0, 512)  e4m3 of dims 0..511, four tiles of 128 dims
      bytes [512, 528)  four float32 scales, one per tile, each a power of two
      bytes [528, 656)  dims 512..575 (rope) as bfloat16

  tile scale = 2**ceil(log2(max(amax / 448, 1e-4))). Dequantization (e4m3 * power of two -> bf16) is exact.
"""

from __future__ import annotations

import torch

from ._validate import check_positive_int, check_tensor

FP8_MAX = 448.0  # largest finite float8_e4m3fn
KV_LATENT = 512
KV_ROPE = 64
KV_DIM = KV_LATENT + KV_ROPE  # 576
KV_TILE = 128
KV_FP8_BYTES = KV_LATENT + 4 * (KV_LATENT // KV_TILE) + 2 * KV_ROPE  # 656
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

__all__ = ["quantize_fp8", "quantize_kv_fp8", "dequantize_kv_fp8", "KV_FP8_BYTES", "FP8_MAX"]


def _pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= x (x > 0), exact in float32."""
    m, e = torch.frexp(x)  # x = m * 2**e, m in [0.5, 1)
    return torch.ldexp(torch.ones_like(x), torch.where(m == 0.5, e - 1, e))


def quantize_fp8(x: torch.Tensor, block: int = 128, pow2_scale: bool = True):
    """Per-row, per-block e4m3 quantization of the last dim.

    Math:
        ``scale[..., j] = amax(|x[..., j*block:(j+1)*block]|) / 448`` (clamped below by 1e-10, rounded up to a power
        of two when ``pow2_scale``); ``x_fp8 = e4m3(x / scale)``, so ``x ~= x_fp8.float() * scale``.

    Args:
        x: `[..., D]` bfloat16, float16 or float32; ``D`` a multiple of ``block``.
        block: int, elements per scale (default 128).
        pow2_scale: bool, round scales up to powers of two (exact dequantization multiply).

    Returns:
        (x_fp8 `[..., D]` float8_e4m3fn, scale `[..., D // block]` float32).

    Raises:
        TypeError / ValueError for a wrong dtype, or a last dim that is not a multiple of ``block``.

    Example:
        >>> k_fp8, k_scale = quantize_fp8(torch.randn(16, 128))
        >>> k_fp8.shape, k_scale.shape
        (torch.Size([16, 128]), torch.Size([16, 1]))
    """
    check_tensor("x", x, dtypes=_FLOAT_DTYPES, last_dim_contiguous=False)
    check_positive_int("block", block)
    if not isinstance(pow2_scale, bool):
        raise TypeError(f"pow2_scale: expected a bool, got {type(pow2_scale).__name__}")
    if x.dim() == 0 or x.shape[-1] % block != 0:
        raise ValueError(f"x: expected a last dim that is a multiple of block={block}, got shape {list(x.shape)}")
    xf = x.float().unflatten(-1, (x.shape[-1] // block, block))
    amax = xf.abs().amax(dim=-1).clamp_min(1e-10)
    scale = amax / FP8_MAX
    if pow2_scale:
        scale = _pow2_ceil(scale)
    q = (xf / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.flatten(-2), scale


def quantize_kv_fp8(kv: torch.Tensor) -> torch.Tensor:
    """Pack MLA KV rows into the 656-byte FP8 format (see module docstring).

    Args:
        kv: `[..., 576]` bfloat16 (float16/float32 accepted): 512 latent dims then 64 rope dims.

    Returns:
        `[..., 656]` uint8.

    Raises:
        TypeError for a non-float kv; ValueError when the last dim is not 576.

    Example:
        >>> quantize_kv_fp8(torch.randn(4, 576, dtype=torch.bfloat16)).shape
        torch.Size([4, 656])
    """
    check_tensor("kv", kv, dtypes=_FLOAT_DTYPES, last_dim_contiguous=False)
    if kv.dim() == 0 or kv.shape[-1] != KV_DIM:
        raise ValueError(f"kv: expected a last dim of {KV_DIM} (512 latent + 64 rope), got shape {list(kv.shape)}")
    lead = kv.shape[:-1]
    latent = kv[..., :KV_LATENT].float().unflatten(-1, (KV_LATENT // KV_TILE, KV_TILE))
    amax = latent.abs().amax(dim=-1)
    scale = _pow2_ceil((amax / FP8_MAX).clamp_min(1e-4))
    fp8 = (latent / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    rope = kv[..., KV_LATENT:].to(torch.bfloat16).contiguous()
    out = torch.empty(*lead, KV_FP8_BYTES, dtype=torch.uint8, device=kv.device)
    out[..., :KV_LATENT] = fp8.flatten(-2).view(torch.uint8)
    out[..., KV_LATENT:528] = scale.contiguous().view(torch.uint8).reshape(*lead, 16)
    out[..., 528:] = rope.view(torch.uint8).reshape(*lead, 2 * KV_ROPE)
    return out


def dequantize_kv_fp8(x: torch.Tensor) -> torch.Tensor:
    """Unpack 656-byte FP8 KV rows to bfloat16 `[..., 576]` (exact).

    Args:
        x: `[..., 656]` uint8 in the format of :func:`quantize_kv_fp8`.

    Returns:
        `[..., 576]` bfloat16.

    Raises:
        TypeError for a non-uint8 x; ValueError when the last dim is not 656.

    Example:
        >>> kv = torch.randn(4, 576, dtype=torch.bfloat16)
        >>> dequantize_kv_fp8(quantize_kv_fp8(kv)).shape
        torch.Size([4, 576])
    """
    check_tensor("x", x, dtypes=(torch.uint8,), last_dim_contiguous=False)
    if x.dim() == 0 or x.shape[-1] != KV_FP8_BYTES:
        raise ValueError(f"x: expected a last dim of {KV_FP8_BYTES} bytes (the FP8 KV format), "
                         f"got shape {list(x.shape)}")
    x = x.contiguous()
    lead = x.shape[:-1]
    fp8 = x[..., :KV_LATENT].contiguous().view(torch.float8_e4m3fn).float()
    scale = x[..., KV_LATENT:528].contiguous().view(torch.float32)  # [..., 4]
    latent = (fp8.unflatten(-1, (KV_LATENT // KV_TILE, KV_TILE)) * scale.unsqueeze(-1)).flatten(-2)
    rope = x[..., 528:].contiguous().view(torch.bfloat16).reshape(*lead, KV_ROPE)
    return torch.cat([latent.to(torch.bfloat16), rope], dim=-1)
