"""FP8 forms of the sparse MLA forward (issue #7), reached through :func:`flashdsa.sparse_mla_fwd`.

Two forms, both with the bf16 forward's contract (bf16 out, fp32 natural-log lse, invalid indices skipped):

* **656-byte cache** (``kv`` uint8 `[Tkv, 656]`, the :func:`flashdsa.quantize_kv_fp8` format, q bf16 `[T, H, 576]`):
  FP8 storage, bf16 compute. Same result as the bf16 forward on ``dequantize_kv_fp8(kv)`` (dequantization is exact).
* **FP8 compute** (q, kv float8_e4m3fn with ``q_scale`` `[T, H]` and ``kv_scale`` `[Tkv]` float32): the forward of
  ``q * q_scale[..., None]`` and ``kv * kv_scale[:, None]``; the kernel runs both products on FP8 tensor cores.

Each form is one ``flashdsa::`` custom op dispatched like every other op (``sparse_mla_fwd_cache656`` and
``sparse_mla_fwd_fp8`` in :mod:`flashdsa._dispatch`); the reference dequantizes and runs the bf16 reference.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import _dispatch
from .._library import custom_op
from .._validate import check_tensor
from ..quant import KV_FP8_BYTES, dequantize_kv_fp8
from . import reference

_FP8 = (torch.float8_e4m3fn,)


def _reference_fwd(q, kv, indices, sm_scale, d_v, attn_sink, topk_length):
    out, lse, mx = reference.sparse_mla_fwd_reference(q, kv, indices, sm_scale=sm_scale, d_v=d_v,
                                                      attn_sink=attn_sink, topk_length=topk_length)
    return out.to(torch.bfloat16), lse.float(), mx.float()


def _fake(q, indices, d_v):
    T, H = q.shape[:2]
    f32 = dict(dtype=torch.float32, device=q.device)
    return q.new_empty(T, H, d_v, dtype=torch.bfloat16), torch.empty(T, H, **f32), torch.empty(T, H, **f32)


@custom_op("sparse_mla_fwd_cache656")
def _cache656_op(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float, d_v: int,
                 attn_sink: Optional[torch.Tensor], topk_length: Optional[torch.Tensor],
                 backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    op = "sparse_mla_fwd_cache656"

    def check():
        return _dispatch.kernel_module(op).kernel_unsupported(q, kv, indices, d_v=d_v, topk_length=topk_length,
                                                              attn_sink=attn_sink)

    if _dispatch.resolve_backend(op, backend, q.device, check) == "kernel":
        return _dispatch.kernel_module(op).run_sparse_mla_fwd(q, kv, indices, sm_scale=sm_scale, d_v=d_v,
                                                              topk_length=topk_length, attn_sink=attn_sink,
                                                              checked=True)
    return _reference_fwd(q, dequantize_kv_fp8(kv), indices, sm_scale, d_v, attn_sink, topk_length)


@_cache656_op.register_fake
def _(q, kv, indices, sm_scale, d_v, attn_sink, topk_length, backend):
    return _fake(q, indices, d_v)


@custom_op("sparse_mla_fwd_fp8")
def _fp8_op(q: torch.Tensor, q_scale: torch.Tensor, kv: torch.Tensor, kv_scale: torch.Tensor, indices: torch.Tensor,
            sm_scale: float, d_v: int, attn_sink: Optional[torch.Tensor], topk_length: Optional[torch.Tensor],
            backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    op = "sparse_mla_fwd_fp8"
    kw = dict(q_scale=q_scale, kv_scale=kv_scale, d_v=d_v, topk_length=topk_length, attn_sink=attn_sink)

    def check():
        return _dispatch.kernel_module(op).kernel_unsupported(q, kv, indices, **kw)

    if _dispatch.resolve_backend(op, backend, q.device, check) == "kernel":
        return _dispatch.kernel_module(op).run_sparse_mla_fwd_fp8(q, kv, indices, sm_scale=sm_scale, **kw)
    qd = q.float() * q_scale.unsqueeze(-1)
    kvd = kv.float() * kv_scale.unsqueeze(-1)
    return _reference_fwd(qd, kvd, indices, sm_scale, d_v, attn_sink, topk_length)


@_fp8_op.register_fake
def _(q, q_scale, kv, kv_scale, indices, sm_scale, d_v, attn_sink, topk_length, backend):
    return _fake(q, indices, d_v)


def is_fp8_form(q, kv, q_scale, kv_scale) -> bool:
    """True when the arguments ask for one of the FP8 forms (routing in ``sparse_mla_fwd``)."""
    dt = lambda x: getattr(x, "dtype", None)  # noqa: E731
    return (dt(kv) == torch.uint8 or dt(q) in _FP8 or dt(kv) in _FP8 or q_scale is not None
            or kv_scale is not None)


def sparse_mla_fwd_fp8_forms(q, kv, indices, *, q_scale, kv_scale, sm_scale, d_v, attn_sink, topk_length, backend):
    """Validate an FP8 form, flatten batched inputs, run its op. Returns flat (out, lse, max_logits) and ``lead``."""
    from .api import _flatten  # api imports this module lazily; no cycle at import time

    if getattr(kv, "dtype", None) == torch.uint8:
        for name, x in (("q_scale", q_scale), ("kv_scale", kv_scale)):
            if x is not None:
                raise ValueError(f"{name}: must be None with the 656-byte FP8 cache (its scales are in each row), "
                                 f"got a tensor")
        qf, kvf, idx, tl, scale, lead = _flatten(q, kv, indices, topk_length, sm_scale, d_v, attn_sink,
                                                dqk_allowed=(576,), q_dtypes=(torch.bfloat16,),
                                                kv_dtypes=(torch.uint8,), kv_dim=KV_FP8_BYTES, backend=backend)
        if d_v > 512:
            raise ValueError(f"d_v: expected <= 512 with the 656-byte FP8 cache (V is the FP8 latent), got {d_v}")
        return _cache656_op(qf, kvf, idx, scale, d_v, attn_sink, tl, backend), lead

    qf, kvf, idx, tl, scale, lead = _flatten(q, kv, indices, topk_length, sm_scale, d_v, attn_sink,
                                            dqk_allowed=(512, 576), q_dtypes=_FP8, kv_dtypes=_FP8, backend=backend)
    H = qf.shape[1]
    check_tensor("q_scale", q_scale, shape=(*lead, H), dtypes=(torch.float32,), last_dim_contiguous=False)
    n_kv = kv.shape[-2]
    kv_scale_shape = (lead[0], n_kv) if q.dim() == 4 else (kvf.shape[0],)
    check_tensor("kv_scale", kv_scale, shape=kv_scale_shape, dtypes=(torch.float32,), last_dim_contiguous=False)
    for name, x in (("q_scale", q_scale), ("kv_scale", kv_scale)):
        if x.device != qf.device:
            raise ValueError(f"{name}: expected device {qf.device} (q's), got {x.device}")
    qs = q_scale.reshape(qf.shape[0], H).contiguous()  # not -1: H = 0 leaves it ambiguous
    ks = kv_scale.reshape(-1).contiguous()
    return _fp8_op(qf, qs, kvf, ks, idx, scale, d_v, attn_sink, tl, backend), lead
