"""Public sparse MLA API: ``sparse_mla_fwd``, ``sparse_mla`` (differentiable) and DeepSeek-V4's ``sparse_attn``.

All three reduce to one flat custom op ``flashdsa::sparse_mla_fwd`` (q `[T, H, Dqk]`, kv `[Tkv, Dqk]`, indices
`[T, topk]`) and its backward ``flashdsa::sparse_mla_bwd``. Conventions: docs/conventions.md.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Optional

import torch
from torch._subclasses.fake_tensor import FakeTensor

from .. import _dispatch
from .._library import _needs_dispatcher, custom_op
from .._tilelang import pad_heads
from .._validate import check_float, check_same_device, check_tensor
from . import fp8, reference

_FLOATS = (torch.bfloat16, torch.float16, torch.float32, torch.float64)  # kernels: bf16; others run the reference
_INT32 = (torch.int32,)


def _kernel_check(q, kv, indices, d_v, topk_length, attn_sink):
    def check():
        return _dispatch.kernel_module("sparse_mla_fwd").kernel_unsupported(q, kv, indices, d_v=d_v,
                                                                            topk_length=topk_length,
                                                                            attn_sink=attn_sink)

    return check


@custom_op("sparse_mla_fwd")
def _fwd_op(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float, d_v: int,
            attn_sink: Optional[torch.Tensor], topk_length: Optional[torch.Tensor], deterministic: bool,
            backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    path = _dispatch.resolve_backend("sparse_mla_fwd", backend, q.device,
                                     _kernel_check(q, kv, indices, d_v, topk_length, attn_sink))
    if path == "kernel":
        return _dispatch.kernel_module("sparse_mla_fwd").run_sparse_mla_fwd(
            q, kv, indices, sm_scale=sm_scale, d_v=d_v, topk_length=topk_length, attn_sink=attn_sink, checked=True)
    out, lse, mx = reference.sparse_mla_fwd_reference(q, kv, indices, sm_scale=sm_scale, d_v=d_v,
                                                      attn_sink=attn_sink, topk_length=topk_length)
    ld = torch.float64 if q.dtype == torch.float64 else torch.float32
    return out.to(q.dtype), lse.to(ld), mx.to(ld)


@_fwd_op.register_fake
def _(q, kv, indices, sm_scale, d_v, attn_sink, topk_length, deterministic, backend):
    T, H, _ = q.shape
    ld = torch.float64 if q.dtype == torch.float64 else torch.float32
    return q.new_empty(T, H, d_v), q.new_empty(T, H, dtype=ld), q.new_empty(T, H, dtype=ld)


def _bwd_kernel(q, kv, indices, out, lse, dout, dlse, sm_scale, d_v, attn_sink, topk_length, deterministic,
                check_only=False):
    """Run (or, with check_only, vet) the backward kernel with H padded to a multiple of 64.

    Padded heads have q = 0, dout = 0, out = 0 and lse = 0, so dP = dout.V = 0, delta = 0 and dS = P * (dP - delta)
    = 0: they add nothing to dkv, and their dq rows are dropped. A padded sink is -inf (gate 1, no gradient).
    """
    heads = q.shape[1]
    hp = -(-heads // 64) * 64
    args = (pad_heads(q, hp), kv, indices, pad_heads(out, hp), pad_heads(lse, hp), pad_heads(dout, hp))
    sink = None if attn_sink is None else torch.cat([attn_sink, attn_sink.new_full((hp - heads,), -math.inf)])
    dl = None if dlse is None else pad_heads(dlse, hp)
    mod = _dispatch.kernel_module("sparse_mla_bwd")
    if check_only:
        return mod.kernel_unsupported(*args, d_v=d_v, topk_length=topk_length, attn_sink=sink, dlse=dl)
    dq, dkv, ds = mod.run_sparse_mla_bwd(*args, sm_scale=sm_scale, d_v=d_v, topk_length=topk_length,
                                         attn_sink=sink, deterministic=deterministic, dlse=dl)
    return dq[:, :heads], dkv, (None if ds is None else ds[:heads])


@custom_op("sparse_mla_bwd")
def _bwd_op(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
            dout: torch.Tensor, dlse: Optional[torch.Tensor], sm_scale: float, d_v: int,
            attn_sink: Optional[torch.Tensor], topk_length: Optional[torch.Tensor], deterministic: bool,
            backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    args = (q, kv, indices, out, lse, dout, dlse, sm_scale, d_v, attn_sink, topk_length, deterministic)
    path = _dispatch.resolve_backend("sparse_mla_bwd", backend, q.device,
                                     lambda: _bwd_kernel(*args, check_only=True))
    if path == "kernel":
        dq, dkv, ds = _bwd_kernel(*args)
    else:
        dq, dkv, ds = reference.sparse_mla_bwd_reference(q, kv, indices, out, lse, dout, sm_scale=sm_scale,
                                                         d_v=d_v, attn_sink=attn_sink, topk_length=topk_length,
                                                         dlse=dlse, deterministic=deterministic)
    if ds is None:
        ds = q.new_zeros(0, dtype=torch.float32)
    sink_dtype = attn_sink.dtype if attn_sink is not None else torch.float32
    return dq.to(q.dtype), dkv.to(kv.dtype), ds.to(sink_dtype)


@_bwd_op.register_fake
def _(q, kv, indices, out, lse, dout, dlse, sm_scale, d_v, attn_sink, topk_length, deterministic, backend):
    ds = attn_sink.new_empty(attn_sink.shape) if attn_sink is not None else q.new_empty(0, dtype=torch.float32)
    return q.new_empty(q.shape), kv.new_empty(kv.shape), ds


def _setup_context(ctx, inputs, output):
    q, kv, indices, sm_scale, d_v, attn_sink, topk_length, deterministic, backend = inputs
    out, lse, _ = output
    ctx.save_for_backward(q, kv, indices, out, lse, attn_sink, topk_length)
    ctx.sm_scale, ctx.d_v, ctx.deterministic, ctx.backend = sm_scale, d_v, deterministic, backend
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, dlse, dmax):
    q, kv, indices, out, lse, attn_sink, topk_length = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dkv, ds = _bwd_op(q, kv, indices, out, lse, dout.contiguous(), dlse, ctx.sm_scale, ctx.d_v, attn_sink,
                          topk_length, ctx.deterministic, ctx.backend)
    return dq, dkv, None, None, None, (ds if attn_sink is not None else None), None, None, None


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------- validation
def _flatten(q, kv, indices, topk_length, sm_scale, d_v, attn_sink, *, dqk_allowed, names=("q", "kv", "indices"),
             q_dtypes=_FLOATS, kv_dtypes=None, kv_dim=None, backend="auto", scale_name="sm_scale"):
    """Validate and reduce the flat / batched forms to the flat form. Returns (q, kv, idx, tl, scale, lead).

    kv must have q's dtype and last dim Dqk unless ``kv_dtypes`` / ``kv_dim`` say otherwise (FP8 forms)."""
    qn, kvn, ixn = names
    check_tensor(qn, q, ndim=(3, 4), dtypes=q_dtypes)
    batched = q.dim() == 4
    dqk = q.shape[-1]
    if dqk_allowed is not None and dqk not in dqk_allowed:
        raise ValueError(f"{qn}: expected a last dim (Dqk) in {sorted(dqk_allowed)}, got {dqk}")
    if dqk % 8 != 0 or dqk == 0:
        raise ValueError(f"{qn}: expected a last dim that is a positive multiple of 8, got {dqk}")
    H = q.shape[-2]
    kv_dtypes = (q.dtype,) if kv_dtypes is None else kv_dtypes
    kd = dqk if kv_dim is None else kv_dim
    if batched:
        B, S = q.shape[:2]
        check_tensor(kvn, kv, shape=(B, None, kd), dtypes=kv_dtypes)
        check_tensor(ixn, indices, shape=(B, S, None), dtypes=_INT32)
        lead = (B, S)
    else:
        T = q.shape[0]
        check_tensor(kvn, kv, ndim=(2, 3), dtypes=kv_dtypes)
        if kv.dim() == 3:
            check_tensor(kvn, kv, shape=(None, 1, kd))
            kv = kv.squeeze(1)
        check_tensor(kvn, kv, shape=(None, kd))
        check_tensor(ixn, indices, ndim=(2, 3), dtypes=_INT32)
        if indices.dim() == 3:
            check_tensor(ixn, indices, shape=(T, 1, None))
            indices = indices.squeeze(1)
        check_tensor(ixn, indices, shape=(T, None))
        lead = (T,)
    if indices.shape[-1] < 1:
        raise ValueError(f"{ixn}: expected at least one index per query (topk >= 1), got shape {list(indices.shape)}")
    if not isinstance(d_v, int) or isinstance(d_v, bool):
        raise TypeError(f"d_v: expected an int, got {type(d_v).__name__}")
    if not 0 < d_v <= dqk:
        raise ValueError(f"d_v: expected 0 < d_v <= Dqk={dqk}, got {d_v}")
    check_tensor("attn_sink", attn_sink, shape=(H,), dtypes=(torch.float32, torch.float64), optional=True)
    check_tensor("topk_length", topk_length, shape=lead, dtypes=_INT32, optional=True,
                 last_dim_contiguous=False)
    check_same_device(**{qn: q, kvn: kv, ixn: indices, "attn_sink": attn_sink, "topk_length": topk_length})
    scale = check_float(scale_name, sm_scale)
    scale = dqk ** -0.5 if scale is None else scale
    if batched:
        B, S = lead
        skv = kv.shape[1]
        if B * skv >= 2**31:
            raise ValueError(f"{kvn}: B * S_kv must be < 2**31 for int32 indices, got {B} * {skv}")
        indices = _offset_batched_indices(indices, skv, backend)
        q, kv = q.reshape(B * S, H, dqk), kv.reshape(B * skv, kd)
        if topk_length is not None:
            topk_length = topk_length.reshape(B * S)
    return q, kv, indices, topk_length, scale, lead


def _offset_batched_indices(indices: torch.Tensor, skv: int, backend: str = "auto") -> torch.Tensor:
    """``[B, S, topk]`` positions within each batch's kv -> ``[B * S, topk]`` rows of the flat kv (-1 if invalid).

    One TileLang launch where kernels run (``kernel_index``; host time matters for decode-sized calls), else the
    same map in PyTorch (CPU, ``FLASHDSA_BACKEND=reference``, and tracing under ``torch.compile``)."""
    B, S, k = indices.shape
    if (indices.is_cuda and not torch.compiler.is_compiling() and not isinstance(indices, FakeTensor)
            and _dispatch.requested_backend(backend) != "reference"
            and _dispatch.kernel_unavailable_reason("sparse_mla_fwd", indices.device) is None):
        from . import kernel_index

        return kernel_index.offset_batched_indices(indices, skv)
    offset = (torch.arange(B, device=indices.device, dtype=torch.int32) * skv).view(B, 1, 1)
    ok = (indices >= 0) & (indices < skv)
    return torch.where(ok, indices + offset, torch.full_like(indices, -1)).reshape(B * S, k)


def _unflatten(t: torch.Tensor, lead):
    return t.reshape(*lead, *t.shape[1:])


# ------------------------------------------------------------------------------------------- eager fast path
_PLANS = _dispatch.PlanCache()


class _FwdPlan:
    """The kernel forward that one call signature was validated and dispatched to (``_dispatch.PlanCache``):
    flat views, the batched-index offset, three outputs and one launch; no validation, no dispatch."""

    __slots__ = ("launch", "offset", "extra", "tokens", "heads", "dqk", "kv_rows", "topk", "d_v", "lead",
                 "tl_dummy", "sink_dummy")

    def __call__(self, q, kv, indices, topk_length, attn_sink):
        _dispatch.record_choice("sparse_mla_fwd", "kernel")
        n, dev = self.tokens, q.device
        qf = q.view(n, self.heads, self.dqk)
        kvf = kv.view(self.kv_rows, self.dqk)
        # flat forms and the fused batched build take the indices as they are; else one offset launch
        idx = indices.view(n, self.topk) if self.offset is None else self.offset(indices)
        out = torch.empty((n, self.heads, self.d_v), dtype=torch.bfloat16, device=dev)
        lse = torch.empty((n, self.heads), dtype=torch.float32, device=dev)
        mx = torch.empty((n, self.heads), dtype=torch.float32, device=dev)
        self.launch(qf, kvf, idx, self.tl_dummy if topk_length is None else topk_length.view(n),
                    self.sink_dummy if attn_sink is None else attn_sink, out, lse, mx, *self.extra)
        return out, lse, mx


def _plan_key(form, q, kv, indices, topk_length, attn_sink, *scalars):
    """``_dispatch.call_signature`` of a forward call, or None where the plain path must run (tracing, fake
    tensors, an input that needs a gradient).  The environment switches the kernel choice reads are part of it."""
    tensors = (q, kv, indices, topk_length, attn_sink)
    if not all(isinstance(t, torch.Tensor) for t in tensors[:3]) or _needs_dispatcher(tensors):
        return None
    return _dispatch.call_signature(form, q, kv, indices, topk_length, attn_sink, *scalars,
                                    tuple(map(os.environ.get, _switches())))


@functools.cache
def _switches() -> tuple:
    """The environment switches the forward kernels' choices read (names; the kernel modules imported once)."""
    from ..decode import kernel_split
    from . import _tail_split, kernel_dequant656, kernel_fwd_fp8cache, kernel_fwd_pair, kernel_fwd_pair_cache

    return (kernel_fwd_pair.QTMA_ENV, kernel_fwd_pair.QNEXT_ENV, kernel_fwd_pair.PERSISTENT_MAX_ENV,
            _tail_split.TAIL_ENV, kernel_split.SPLIT_ENV,
            kernel_fwd_fp8cache.NARROW_ENV, kernel_fwd_pair_cache.STAGING_ENV,
            kernel_fwd_pair_cache.PERSISTENT_ENV, kernel_fwd_pair_cache.QGATE_ENV, kernel_dequant656.DEQUANT_ONCE_ENV)


def _replay(form, q, kv, indices, topk_length, attn_sink, *scalars):
    """(key, hit): the call's ``_plan_key`` and, where a plan is stored under it, ((out, lse, max_logits) flat,
    lead dims) from replaying it; hit None otherwise (run the plain path, then ``_store_plan(key, ...)``)."""
    key = _plan_key(form, q, kv, indices, topk_length, attn_sink, *scalars)
    plan = None if key is None else _PLANS.get(key)
    return key, (None if plan is None else (plan(q, kv, indices, topk_length, attn_sink), plan.lead))


def _store_plan(key, q, kv, indices, topk_length, attn_sink, flat, d_v, backend):
    """After the plain path accepted a call (``flat``: what ``_flatten`` returned): store its kernel launch under
    ``key`` if the kernel ran and the call can be replayed as views of its inputs (all contiguous, T and Tkv > 0;
    other calls keep taking the plain path)."""
    qf, kvf, idx, tl, scale, lead = flat
    if key is None or q.device.type != "cuda" or qf.shape[0] == 0 or kvf.shape[0] == 0:
        return
    if not all(t is None or t.is_contiguous() for t in (q, kv, indices, topk_length, attn_sink)):
        return
    from .._tilelang import any_misaligned, dummy

    if any_misaligned(qf, kvf, idx, topk_length, attn_sink):
        return
    if _dispatch.resolve_backend("sparse_mla_fwd", backend, qf.device,
                                 _kernel_check(qf, kvf, idx, d_v, tl, attn_sink)) != "kernel":
        return
    from . import kernel_index

    batched = q.dim() == 4
    plan = _FwdPlan()
    plan.launch, fused = _dispatch.kernel_module("sparse_mla_fwd").launcher(
        qf, kvf, idx, sm_scale=scale, d_v=d_v, topk_length=tl, attn_sink=attn_sink, batched=batched)
    skv = kv.shape[1] if batched else None
    plan.offset = (lambda i: kernel_index.offset_batched_indices(i, skv)) if batched and not fused else None
    plan.extra = (q.shape[1], skv) if fused else ()
    plan.tokens, plan.heads, plan.dqk = qf.shape
    plan.kv_rows, plan.topk, plan.d_v, plan.lead = kvf.shape[0], idx.shape[1], d_v, lead
    plan.tl_dummy, plan.sink_dummy = dummy(torch.int32, q.device), dummy(torch.float32, q.device)
    _PLANS.put(key, plan)


def sparse_mla_fwd(q, kv, indices, *, sm_scale=None, d_v=512, attn_sink=None, topk_length=None,
                   return_max_logits=False, q_scale=None, kv_scale=None, backend="auto"):
    """Sparse MLA forward: each query row attends only the KV rows its indices select (MQA, shared latent KV).

    Math:
        ``s_j = sm_scale * q[t, h] . kv[indices[t, j]]`` over valid j; ``lse = log(sum_j exp(s_j))``;
        ``out = sum_j exp(s_j - lse) kv[indices[t, j], :d_v] / (1 + exp(attn_sink[h] - lse))``.
        Invalid indices (< 0 or >= rows of kv) are skipped, never read; duplicates count twice.

    Args:
        q: `[T, H, Dqk]` or batched `[B, S, H, Dqk]`, bfloat16, Dqk in {576, 512}; last dim contiguous.
        kv: `[Tkv, Dqk]` or `[Tkv, 1, Dqk]` (batched: `[B, S_kv, Dqk]`), same dtype as q.
        indices: `[T, topk]` or `[T, 1, topk]` (batched: `[B, S, topk]`, positions within each batch's kv), int32.
        sm_scale: float, softmax scale; default ``Dqk ** -0.5``.
        d_v: int, V is ``kv[..., :d_v]`` (default 512).
        attn_sink: `[H]` float32 or None; +inf zeroes the output, -inf has no effect; lse excludes it.
        topk_length: `[T]` (batched `[B, S]`) int32 or None: only ``indices[t, :topk_length[t]]`` are used.
        return_max_logits: bool, also return the max scaled logit per row (-inf for empty rows).
        q_scale: FP8 compute form only (q, kv float8_e4m3fn): float32 `[T, H]` (batched `[B, S, H]`); the op
            computes on ``q * q_scale[..., None]``.
        kv_scale: FP8 compute form only: float32 `[Tkv]` (batched `[B, S_kv]`), kv is ``kv * kv_scale[..., None]``.
        backend: "auto" | "kernel" | "reference" (see docs/conventions.md#backends).

    FP8 forms (see :mod:`flashdsa.sparse.fp8`): ``kv`` uint8 `[Tkv, 656]` (the :func:`quantize_kv_fp8` cache,
    q bf16 with Dqk 576) gives the bf16 forward of the dequantized cache (at H 64 / 128, where every cache row is
    gathered many times, as in prefill, through a temporary bf16 copy of the whole cache, ``Tkv * 1152`` bytes, at
    most 1 GiB: ``flashdsa.sparse.kernel_dequant656``); q and kv float8_e4m3fn with ``q_scale``/``kv_scale`` give
    the forward of the dequantized tensors on FP8 tensor cores.

    Returns:
        out `[T, H, d_v]` bfloat16 and lse `[T, H]` float32 (natural log; empty rows: out 0, lse +inf)
        [, max_logits `[T, H]` float32]; batched forms have leading `[B, S]`.

    Raises:
        TypeError / ValueError naming the argument for wrong dtypes, shapes or devices.

    Supported:
        Kernel: Hopper sm_90a, bf16, Dqk 576 (d_v 512) or 512 (d_v 512), H 1..128. Elsewhere: the reference.

    Example:
        >>> q = torch.randn(2, 4, 576, dtype=torch.bfloat16)
        >>> kv = torch.randn(16, 576, dtype=torch.bfloat16)
        >>> idx = torch.tensor([[0, 3, -1], [5, 5, 99]], dtype=torch.int32)
        >>> out, lse = sparse_mla_fwd(q, kv, idx)
        >>> out.shape, lse.shape
        (torch.Size([2, 4, 512]), torch.Size([2, 4]))
    """
    if not isinstance(return_max_logits, bool):
        raise TypeError(f"return_max_logits: expected a bool, got {type(return_max_logits).__name__}")
    key, hit = None, None
    if q_scale is None and kv_scale is None:
        key, hit = _replay("fwd", q, kv, indices, topk_length, attn_sink, sm_scale, d_v, backend)
    if hit is not None:
        (out, lse, mx), lead = hit
        res = (_unflatten(out, lead), _unflatten(lse, lead))
        return res + (_unflatten(mx, lead),) if return_max_logits else res
    _dispatch.requested_backend(backend)
    if fp8.is_fp8_form(q, kv, q_scale, kv_scale):
        (out, lse, mx), lead = fp8.sparse_mla_fwd_fp8_forms(q, kv, indices, q_scale=q_scale, kv_scale=kv_scale,
                                                            sm_scale=sm_scale, d_v=d_v, attn_sink=attn_sink,
                                                            topk_length=topk_length, backend=backend)
    else:
        flat = _flatten(q, kv, indices, topk_length, sm_scale, d_v, attn_sink, dqk_allowed=(512, 576),
                        backend=backend)
        qf, kvf, idx, tl, scale, lead = flat
        out, lse, mx = _fwd_op(qf, kvf, idx, scale, d_v, attn_sink, tl, False, backend)
        _store_plan(key, q, kv, indices, topk_length, attn_sink, flat, d_v, backend)
    res = (_unflatten(out, lead), _unflatten(lse, lead))
    return res + (_unflatten(mx, lead),) if return_max_logits else res


def sparse_mla(q, kv, indices, *, sm_scale=None, d_v=512, attn_sink=None, topk_length=None, deterministic=False,
               backend="auto"):
    """Differentiable sparse MLA attention (w.r.t. q, kv and attn_sink); same math as :func:`sparse_mla_fwd`.

    Args:
        q: `[T, H, Dqk]` or `[B, S, H, Dqk]` bfloat16, Dqk in {576, 512}.
        kv: `[Tkv, Dqk]` / `[Tkv, 1, Dqk]` / `[B, S_kv, Dqk]`, same dtype as q.
        indices: `[T, topk]` / `[T, 1, topk]` / `[B, S, topk]` int32.
        sm_scale: float, default ``Dqk ** -0.5``.
        d_v: int, V is ``kv[..., :d_v]``.
        attn_sink: `[H]` float32 or None.
        topk_length: `[T]` / `[B, S]` int32 or None.
        deterministic: bool, bitwise-reproducible gradients (no float atomics).
        backend: "auto" | "kernel" | "reference".

    Returns:
        out `[T, H, d_v]` (batched `[B, S, H, d_v]`) bfloat16. Gradients flow to q, kv and attn_sink; empty rows
        and invalid indices give zero gradient.

    Raises:
        TypeError / ValueError naming the argument.

    Supported:
        Forward as :func:`sparse_mla_fwd`. Backward: the TileLang kernel on Hopper for bf16 inputs (any H, padded
        to a multiple of 64 inside; ``deterministic=True`` replaces the fp32 atomics by a sorted fixed-order
        reduction over fp32 partials in a workspace of at most 2 GiB, bitwise reproducible on a given GPU model),
        the reference elsewhere and for ``dlse`` together with a sink.

    Example:
        >>> q = torch.randn(2, 4, 512, dtype=torch.bfloat16, requires_grad=True)
        >>> kv = torch.randn(8, 512, dtype=torch.bfloat16, requires_grad=True)
        >>> idx = torch.tensor([[0, 1], [2, -1]], dtype=torch.int32)
        >>> sparse_mla(q, kv, idx).float().sum().backward()
        >>> q.grad.shape, kv.grad.shape
        (torch.Size([2, 4, 512]), torch.Size([8, 512]))
    """
    key, hit = _replay("mla", q, kv, indices, topk_length, attn_sink, sm_scale, d_v, deterministic, backend)
    if hit is not None:
        return _unflatten(hit[0][0], hit[1])
    flat = _flatten(q, kv, indices, topk_length, sm_scale, d_v, attn_sink, dqk_allowed=(512, 576),
                    backend=backend)
    qf, kvf, idx, tl, scale, lead = flat
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic: expected a bool, got {type(deterministic).__name__}")
    _dispatch.requested_backend(backend)
    out, _, _ = _fwd_op(qf, kvf, idx, scale, d_v, attn_sink, tl, deterministic, backend)
    _store_plan(key, q, kv, indices, topk_length, attn_sink, flat, d_v, backend)
    return _unflatten(out, lead)


def sparse_attn(q, kv, attn_sink, topk_idxs, softmax_scale=None, *, backend="auto"):
    """DeepSeek-V4 sparse attention: K = V = kv, per-head attention sink; differentiable.

    Math:
        ``out[b, m, h] = sum_j softmax_j(softmax_scale * q[b, m, h] . kv[b, i_j]) kv[b, i_j]
        / (1 + exp(sink[h] - lse))`` over valid ``i_j = topk_idxs[b, m, j]`` (``-1`` and out-of-range entries
        are skipped).

    Args:
        q: `[b, m, h, d]` bfloat16 (d = 512 in V4; any multiple of 8 runs on the reference).
        kv: `[b, n, d]` bfloat16, used as both K and V.
        attn_sink: `[h]` float32 (or None for no sink).
        topk_idxs: `[b, m, topk]` int32, positions within each batch's kv.
        softmax_scale: float, default ``d ** -0.5``.
        backend: "auto" | "kernel" | "reference".

    Returns:
        out `[b, m, h, d]` bfloat16; rows with no valid index give 0.

    Raises:
        TypeError / ValueError naming the argument.

    Supported:
        Kernel: Hopper sm_90a, d = 512, h 1..128; elsewhere the reference.

    Example:
        >>> q = torch.randn(1, 3, 2, 64, dtype=torch.bfloat16)
        >>> kv = torch.randn(1, 10, 64, dtype=torch.bfloat16)
        >>> idx = torch.tensor([[[0, 1], [2, -1], [-1, -1]]], dtype=torch.int32)
        >>> sparse_attn(q, kv, torch.zeros(2), idx).shape
        torch.Size([1, 3, 2, 64])
    """
    key, hit = _replay("attn", q, kv, topk_idxs, None, attn_sink, softmax_scale, backend)
    if hit is not None:
        return _unflatten(hit[0][0], hit[1])
    check_tensor("q", q, ndim=4, dtypes=_FLOATS)
    flat = _flatten(q, kv, topk_idxs, None, softmax_scale, q.shape[-1], attn_sink, dqk_allowed=None,
                    names=("q", "kv", "topk_idxs"), backend=backend, scale_name="softmax_scale")
    qf, kvf, idx, tl, scale, lead = flat
    _dispatch.requested_backend(backend)
    out, _, _ = _fwd_op(qf, kvf, idx, scale, q.shape[-1], attn_sink, tl, False, backend)
    _store_plan(key, q, kv, topk_idxs, None, attn_sink, flat, q.shape[-1], backend)
    return _unflatten(out, lead)
