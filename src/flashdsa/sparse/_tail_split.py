"""The pair forward's last, partial round of CTAs as split-KV chunks over every SM.

Why: the pair forward runs one CTA per (token, 64-head group) item, one CTA per SM (its shared memory), in rounds
of ``n_sm`` items. Where ``I = T * G`` items (G = H / 64) leave a last round of ``r = I mod n_sm`` items with r
small, those r CTAs run a whole item time while the other SMs idle: session 53 (H100, H 64, topk 2048) measured
S 4096 (31 rounds + 4 items) 77 us (median of five passes) slower than S 4092 (31 rounds) and as slow as S 4224
(32 rounds), ~3% of the call.

What: with ``tail_plan``'s (t_main, n_split, chunk), the forward runs its dispatched grid over the first
``t_main`` tokens (whole rounds); the last ``T - t_main = ceil(r / G)`` tokens run as the split-KV decode's
(token, chunk) rows (``decode/kernel_split.py``: ``split_inputs``, the pair kernel's fp32-partial build
``kernel_fwd_pair.OUT_F32_KW``), about one chunk CTA per SM, merged by the split combine (``with_max``: the
max logits too) straight into the last rows of out / lse / max_logits, the sink applied there. Three kernels
(and ``split_inputs``' few element-wise ops where it pads or cuts ``topk_length``), no host sync: the plan depends
on shapes only, so a forward keeps capturing in a CUDA graph (the side stream's
fork and join included).
Numerics: the tail tokens' out is the fp32 merge of fp32 partials (as split decode; not bitwise equal to the
unsplit forward), lse and max_logits as the forward's contract (empty rows: out 0, lse +inf, max_logits -inf).

Where: the chunks run first, on a side stream (forked from and joined back into the caller's stream), so the
block scheduler places their CTAs on some SMs while the main grid's CTAs fill the others and then the SMs the
chunks free: the chunks' time overlaps the main grid's. Session 54, H100, paired calls (``scripts/tail_probe.py
--ab``), split minus unsplit at S 4096 / 4100: H 64 topk 2048 -15.6 / -17.6 us (+0.7-0.8%), H 128 -9.0 / -17.1
(+0.2-0.4%), the V4 row (topk 640, persistent grid) -1.1 / -3.3 (even); run after the main grid instead
("serial"): H 64 about the same, H 128 within 7 us, V4 +22..+25 us slower.  A chunk CTA's fixed part is most of
its time (V4's chunk grid, 20 CTAs of 2 blocks, took 26.8 us in torch.profiler, about a whole V4 item), so the
split gives back only part of the last round.  Not split: the 656-byte cache's dequantize-once path
(``kernel_fwd_fp8cache``), which launches ``kernel_fwd_pair`` directly.  The persistent grid's CTAs have fixed items
(one delayed by a chunk ends late), and it
gained nothing measurable, so by default (``TAIL_DEFAULT``) only the one-CTA-per-item grid splits.

``$FLASHDSA_PAIR_TAIL`` (``TAIL_ENV``): unset = "auto" (the one-CTA-per-item grid, topk above the persistent
bound), "1" wherever ``tail_plan``'s shape rules allow (at least ``TAIL_MIN_BLOCKS`` blocks), "serial" as "1" with
the chunks after the main grid on the caller's stream, "0" never (for timing).
"""

import functools
import os

import torch

from .._tilelang import direct_launcher
from .._validate import check_choice
from ..decode import kernel_split
from ._tl_common import BLOCK_H, BLOCK_I

TAIL_ENV = "FLASHDSA_PAIR_TAIL"
TAIL_DEFAULT = "auto"  # where $FLASHDSA_PAIR_TAIL is unset
TAIL_MODES = ("auto", "1", "serial", "0")
# the last round is split where it holds at most 1 / TAIL_MAX_SHARE of the SMs' items (its chunks then fit in
# about one round of chunk CTAs of at least ``kernel_split.MIN_SPLIT_BLOCKS`` blocks)
TAIL_MAX_SHARE = 8
# and where a token's list has at least this many 64-slot blocks: a chunk CTA's fixed part (Q, prologue, partial
# store) and the merge must stay under the item time it saves (at 10 blocks, the V4 row, the split came out even)
TAIL_MIN_BLOCKS = 8


def tail_mode() -> str:
    """``$FLASHDSA_PAIR_TAIL`` (one of ``TAIL_MODES``), ``TAIL_DEFAULT`` where unset."""
    return check_choice(f"${TAIL_ENV}", os.environ.get(TAIL_ENV) or TAIL_DEFAULT, TAIL_MODES)


@functools.cache
def _side_stream(device_index: int):
    """The stream the chunks run on beside the main grid (one per device)."""
    return torch.cuda.Stream(device=device_index)


def tail_plan(tokens: int, heads: int, topk: int, n_sm: int) -> tuple[int, int, int] | None:
    """(t_main, n_split, chunk) where the last round of the pair forward's ``tokens * heads / 64`` items is
    split (module docstring): at least one whole round, a last round of at most ``n_sm / TAIL_MAX_SHARE`` items,
    at least ``TAIL_MIN_BLOCKS`` blocks per list, and a list ``kernel_split.split_plan`` cuts for the ``tokens -
    t_main`` tail tokens (so ``$FLASHDSA_DECODE_SPLIT`` applies: "0" never splits); else None (also with
    ``$FLASHDSA_PAIR_TAIL`` = "0", ``n_sm`` 0 (not on a GPU) or heads not a multiple of 64); "auto" (unset) also
    asks for more blocks than ``kernel_fwd_pair.persistent_max_blocks()`` (the one-CTA-per-item grid)."""
    mode = tail_mode()
    n_blocks = -(-topk // BLOCK_I)
    if n_sm <= 0 or heads % BLOCK_H or n_blocks < TAIL_MIN_BLOCKS or mode == "0":
        return None
    if mode == "auto":
        from .kernel_fwd_pair import persistent_max_blocks

        if n_blocks <= persistent_max_blocks():
            return None
    groups = heads // BLOCK_H
    rounds, last = divmod(tokens * groups, n_sm)
    if rounds == 0 or last == 0 or last * TAIL_MAX_SHARE > n_sm:
        return None
    t_tail = -(-last // groups)
    n_split, chunk = kernel_split.split_plan(t_tail, heads, topk, n_sm)
    if n_split == 1:
        return None
    return tokens - t_tail, n_split, chunk


def tail_launcher(main, plan: tuple[int, int, int], *, heads: int, dqk: int, d_v: int, sm_scale: float,
                  has_sink: bool, has_topk_length: bool):
    """A launch with ``main``'s signature ``(q, kv, indices, topk_length or dummy, attn_sink or dummy, out, lse,
    max_logits, *extra)`` (``main``: the dispatched pair grid's launch) that runs ``main`` over the first
    ``t_main`` tokens and the rest as split-KV chunks (``plan`` = ``tail_plan``'s).  Inputs contiguous, T as
    planned.  ``extra`` = (S, S_kv): ``main`` is the batched build (indices are positions in each batch's S_kv
    rows of kv, ``kernel_fwd_pair.batched_launcher``); the chunks then read the last batch's rows (``kv[-S_kv:]``,
    where positions outside [0, S_kv) are invalid as in the batched build), and run only where every tail token
    is in the last batch (else ``main`` runs over all tokens).  The chunks run before ``main`` on
    ``_side_stream`` (module docstring), or after it on the caller's stream with ``$FLASHDSA_PAIR_TAIL`` =
    "serial" (read here)."""
    from . import kernel_fwd_pair

    t_main, n_split, chunk = plan
    part = direct_launcher(kernel_fwd_pair._compiled(heads, dqk, d_v, -(-chunk // BLOCK_I), float(sm_scale), False,
                                                     has_topk_length, kernel_fwd_pair.OUT_F32_KW))
    merge = kernel_split._compiled_combine(heads, has_sink, 0, True)
    serial = tail_mode() == "serial"

    def run(q, kv, indices, topk_length, attn_sink, out, lse, max_logits, *extra):
        t0 = t_main
        if extra and q.shape[0] - t0 > extra[0]:  # tail tokens in two batches
            return main(q, kv, indices, topk_length, attn_sink, out, lse, max_logits, *extra)

        def run_main():
            main(q[:t0], kv, indices[:t0], topk_length[:t0] if has_topk_length else topk_length, attn_sink,
                 out[:t0], lse[:t0], max_logits[:t0], *extra)

        # on the caller's stream: the partials are freed (after the merge is queued) in its order
        idx_s, tl_s = kernel_split.split_inputs(indices[t0:], topk_length[t0:] if has_topk_length else None,
                                                n_split, chunk)
        rows = idx_s.shape[0]
        out_p = torch.empty((rows, heads, d_v), dtype=torch.float32, device=q.device)
        lse_p = torch.empty((rows, heads), dtype=torch.float32, device=q.device)
        max_p = torch.empty((rows, heads), dtype=torch.float32, device=q.device)
        kv_t = kv[kv.shape[0] - extra[1]:] if extra else kv
        args = (q[t0:], kv_t, idx_s, tl_s if has_topk_length else topk_length, attn_sink, out_p, lse_p, max_p)
        if serial:
            run_main()
            part(*args)
        else:
            caller = torch.cuda.current_stream(q.device)
            side = _side_stream(q.device.index)
            side.wait_stream(caller)  # the inputs (and split_inputs' tensors) are written on the caller's stream
            try:
                with torch.cuda.stream(side):
                    part(*args)  # queued first: its CTAs are placed before the main grid's
                run_main()
            finally:  # joined even if a launch raised (a capture must not end with the side stream forked)
                caller.wait_stream(side)
        merge(out_p, lse_p, max_p, attn_sink, out[t0:], lse[t0:], max_logits[t0:], n_split)

    return run
