"""One dense decode call split into its decisions (``prepare_dense``: shapes, flags and the per-step work on
``block_table`` / ``cache_seqlens``) and its launch (``DenseStep.__call__``: q and one layer's cache), so that
``run_mla_decode_dense`` (both at once) and ``mla_decode_plan`` (decide once, launch per layer) share one path."""

import math

import torch

from . import _pair_path
from . import kernel_dense as _kd
from ._tl_common import D_V, DQK
from .._tilelang import aligned, direct_launcher, dummy


class DenseStep:
    """One dense decode step's decisions and per-step state (``prepare_dense``); calling it with ``(q [B, s_q, H,
    576], kv_cache [num_blocks, block_size, 576], attn_sink)`` of those shapes launches the kernels and returns
    ``(out [B, s_q, H, 512] bf16, lse [B, s_q, H] f32)``.  ``path``: "empty" (B = 0), "no_cache" (nothing can be
    attended), "pair", "fused" or "split" (plan + partial + combine, with ``partial`` the partial kernel)."""

    def __init__(self, path, *, B, s_q, H, block_table, cache_seqlens, sm_scale, causal, num_sms, prepared=None,
                 workspace=None, partial=None):
        self.path, self.B, self.s_q, self.H = path, B, s_q, H
        self.block_table, self.cache_seqlens = block_table, cache_seqlens
        self.sm_scale, self.causal, self.num_sms = sm_scale, causal, num_sms
        self.prepared, self.workspace, self.partial = prepared, workspace, partial

    def __call__(self, q, kv_cache, attn_sink=None):
        B, s_q, H = self.B, self.s_q, self.H
        M = s_q * H
        dev = q.device
        path = self.path
        if path == "pair":
            return _pair_path.run(q, kv_cache, self.block_table, self.cache_seqlens, sm_scale=self.sm_scale,
                                  causal=self.causal, attn_sink=attn_sink, prepared=self.prepared)
        out = torch.empty((B, M, D_V), dtype=torch.bfloat16, device=dev)
        lse = torch.empty((B, M), dtype=torch.float32, device=dev)
        if path == "no_cache":
            out.zero_()
            lse.fill_(math.inf)
        elif path == "fused":
            # one launch instead of "narrow"'s three (session 8, H200: 0.1586 vs 0.162 ms at B 64, H 16, cache 8192
            # in scripts/bench_decode.py); its merge counters are per (device, stream), fresh inside a capture
            from . import kernel_dense_fused as fused

            fused.run_fused(aligned(q.reshape(B, M, DQK)), aligned(kv_cache), self.block_table,
                            self.cache_seqlens, attn_sink, out, lse, heads=H, s_q=s_q, causal=self.causal,
                            sm_scale=self.sm_scale, num_sms=self.num_sms, workspace=self.workspace)
        elif path == "split":
            plan, seq_plan, o_part, lse_part = self.workspace
            sink = aligned(attn_sink) if attn_sink is not None else dummy(torch.float32, dev)
            direct_launcher(self.partial)(aligned(q.reshape(B, M, DQK)), aligned(kv_cache), self.block_table,
                                          self.cache_seqlens, plan, sink, out, lse, o_part, lse_part)
            combine = _kd._compiled_combine(H, s_q, attn_sink is not None)
            direct_launcher(combine)(seq_plan, sink, o_part, lse_part, out, lse)
        return out.view(B, s_q, H, D_V), lse.view(B, s_q, H)


def prepare_dense(B: int, s_q: int, H: int, kv_shape, block_table, cache_seqlens, *, sm_scale, causal: bool,
                  has_sink: bool, variant=None, device=None) -> DenseStep:
    """The decisions of one dense decode call from shapes and flags only (no values read on the host), and the
    work that depends on ``block_table`` / ``cache_seqlens`` alone: the pair path's slot lists, the three-launch
    paths' split plan (both on the GPU, stream-ordered) and buffers.  ``kv_shape``: (num_blocks, block_size, 576);
    the arguments must be ones ``kernel_unsupported`` accepts."""
    if not (sm_scale > 0 and math.isfinite(sm_scale)):
        raise ValueError(f"sm_scale: expected a finite positive float, got {sm_scale}")
    variant = _kd._variant(variant)
    nb, bs = int(kv_shape[0]), int(kv_shape[1])
    M = s_q * H
    dev = torch.device(device) if device is not None else block_table.device
    common = dict(B=B, s_q=s_q, H=H, block_table=block_table, cache_seqlens=cache_seqlens, sm_scale=float(sm_scale),
                  causal=bool(causal))
    if B == 0:
        return DenseStep("empty", num_sms=0, **common)
    if block_table.shape[1] == 0 or nb == 0:  # nothing can be attended
        return DenseStep("no_cache", num_sms=0, **common)
    n_mt = (M + _kd.BLOCK_M - 1) // _kd.BLOCK_M
    num_sms = _kd._num_sms(dev.index if dev.index is not None else torch.cuda.current_device())
    efficiency = _pair_path.pair_efficiency(B, s_q, H, num_sms) if _pair_path.pair_fits(
        B, s_q, block_table.shape[1] * bs, bs) else 0.0
    if (variant == "pair" and efficiency > 0) or (variant == "auto" and efficiency >= _pair_path.PAIR_MIN_EFFICIENCY):
        return DenseStep("pair", num_sms=num_sms, prepared=_pair_path.prepare(block_table, cache_seqlens, nb, bs, s_q,
                                                                              bool(causal)), **common)
    block_table, cache_seqlens = block_table.contiguous(), cache_seqlens.contiguous()
    common.update(block_table=block_table, cache_seqlens=cache_seqlens)
    if _kd._runs_fused(variant, M):
        from . import kernel_dense_fused as fused

        return DenseStep("fused", num_sms=num_sms, workspace=fused.make_workspace(B, M, num_sms, dev), **common)
    if variant != "pipelined":
        ws = _kd._ws_module(variant, M)
        plan_kw = dict(num_sms=num_sms * ws.ctas_per_sm(M), tile=ws.BLOCK_N, overhead=ws._OVERHEAD_TILES,
                       min_chunk=ws._MIN_CHUNK_TILES)
        partial = ws.compiled_partial(H, s_q, bs, bool(causal), float(sm_scale), has_sink)
    else:
        plan_kw = dict(num_sms=num_sms)
        partial = _kd._compiled_partial(H, s_q, bs, bool(causal), float(sm_scale), has_sink)
    workspace = _kd._workspace(B, M, _kd.max_items(B, n_mt, plan_kw["num_sms"]), dev)
    _kd._plan_device(cache_seqlens, max_blocks=block_table.shape[1], block_size=bs, n_mt=n_mt, out=workspace[:2],
                 **plan_kw)
    return DenseStep("split", num_sms=num_sms, workspace=workspace, partial=partial, **common)
