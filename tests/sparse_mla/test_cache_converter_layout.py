"""CPU: the data movement of ``kernel_fwd_pair_cache``'s "converter_contig" staging, emulated on the byte image of
one 128B-swizzled half tile [64 rows, 256 bf16 dims] (4 chunks of 8 KiB, 128-byte rows, 16-byte piece q of row r
at chunk * 8192 + r * 128 + (q ^ (r & 7)) * 16), with the index formulas of ``fdsa_gather_raw656<1>`` and
``fdsa_convert_half_contig`` transcribed.  The tile starts as garbage; the raw rows land in order; then the
converter's phases run.  Checked: every raw chunk a phase loads is still the cache's bytes (no earlier phase
overwrote it), phases 1 and 2 write no byte that any thread of the same phase reads (so any interleaving of the
128 threads is safe), phase 3 writes only its own row (the two lanes of a row are ordered by the warp barrier), and
the final bf16 slots equal ``dequantize_kv_fp8`` of the rows, for both halves of a row (scale tiles 0 / 1 and 2 / 3)
and for invalid rows (zero bytes, scale 0)."""

import numpy as np
import pytest
import torch

from flashdsa.quant import dequantize_kv_fp8, quantize_kv_fp8

ROWS = 64


def _piece(r, c, q):
    return c * 8192 + r * 128 + ((q ^ (r & 7)) << 4)


def _cvt(raw16: bytes, s: float) -> bytes:
    # 16 e4m3 -> 16 bf16 of float(e4m3) * s (the kernel's conversion, exact for power-of-two scales)
    x = torch.frombuffer(bytearray(raw16), dtype=torch.uint8).view(torch.float8_e4m3fn).float() * s
    return x.to(torch.bfloat16).view(torch.uint8).numpy().tobytes()


def _emulate_half(cache: np.ndarray, rows, chunk0: int, tile0: int, rng) -> np.ndarray:
    tile = rng.integers(0, 256, 4 * 8192, dtype=np.uint8)  # stale shared memory
    # fdsa_gather_raw656<1>: raw chunk k -> chunk k / 8, piece k % 8; the scales -> chunk 2, piece 0;
    # invalid rows (-1) zero-filled
    for r in range(ROWS):
        src = cache[rows[r]] if rows[r] >= 0 else np.zeros(cache.shape[1], np.uint8)
        for k in range(16):
            a = _piece(r, k // 8, k % 8)
            tile[a:a + 16] = src[(chunk0 + k) * 16:(chunk0 + k + 1) * 16]
        a = _piece(r, 2, 0)
        tile[a:a + 16] = src[512:528]

    def raw_of(r, k):  # what raw chunk k of row r must hold when a phase loads it
        src = cache[rows[r]] if rows[r] >= 0 else np.zeros(cache.shape[1], np.uint8)
        return src[(chunk0 + k) * 16:(chunk0 + k + 1) * 16]

    # phase 0: the scales
    scales = {}
    for t in range(128):
        r = t >> 1
        a = _piece(r, 2, 0) + 4 * tile0
        scales[t] = tuple(np.frombuffer(tile[a:a + 8].tobytes(), dtype=np.float32))

    def run_phase(jobs):
        # jobs: per thread, a list of (load address, raw chunk k, store address lo, scale); every load checked against
        # the cache, then the stores (the device code loads each chunk before storing it; phases 1 / 2: no write of
        # the phase hits a byte any thread of the phase reads, so their order does not matter)
        reads, writes = set(), set()
        for t, lst in jobs.items():
            for la, k, sa, _ in lst:
                reads.update(range(la, la + 16))
                writes.update(range(sa, sa + 16))
                writes.update(range(sa ^ 16, (sa ^ 16) + 16))
        loaded = {}
        for t, lst in jobs.items():
            r = t >> 1
            for la, k, sa, s in lst:
                got = tile[la:la + 16].copy()
                assert np.array_equal(got, raw_of(r, k)), f"row {r} raw chunk {k} overwritten before its load"
                loaded[(t, k)] = got
        order = list(jobs)
        rng.shuffle(order)
        for t in order:
            for la, k, sa, s in jobs[t]:
                out = np.frombuffer(_cvt(loaded[(t, k)].tobytes(), s), dtype=np.uint8)
                tile[sa:sa + 16] = out[:16]
                tile[(sa ^ 16):(sa ^ 16) + 16] = out[16:]
        return reads, writes

    # phase 1: k = 8..15 (part 0: 8..11, part 1: 14, 15, 12, 13), scale s1
    jobs = {}
    for t in range(128):
        r, p = t >> 1, t & 1
        jobs[t] = []
        for i in range(4):
            k = 8 + 4 * p + ((i + 2 * p) & 3)
            jobs[t].append((_piece(r, 1, k - 8), k, _piece(r, k >> 2, 2 * (k & 3)), scales[t][1]))
    reads, writes = run_phase(jobs)
    assert not reads & writes, "phase 1 writes bytes that phase 1 reads"
    # phase 2: k = 4..7 (part 0: 4, 5, part 1: 6, 7), scale s0
    jobs = {t: [(_piece(t >> 1, 0, 4 + 2 * (t & 1) + i), 4 + 2 * (t & 1) + i,
                 _piece(t >> 1, 1, 2 * (2 * (t & 1) + i)), scales[t][0]) for i in range(2)] for t in range(128)}
    reads, writes = run_phase(jobs)
    assert not reads & writes, "phase 2 writes bytes that phase 2 reads"
    # phase 3: k = 0..3 (part 0: 0, 1, part 1: 2, 3): both lanes of a row load, warp barrier, both store; a row's
    # stores must stay inside the row (the other rows' lanes are not ordered with it)
    for r in rng.permutation(ROWS):
        jobs = {t: [(_piece(r, 0, 2 * (t & 1) + i), 2 * (t & 1) + i, _piece(r, 0, 2 * (2 * (t & 1) + i)),
                     scales[t][0]) for i in range(2)] for t in (2 * r, 2 * r + 1)}
        _, writes = run_phase(jobs)
        assert all((a % 8192) // 128 == r for a in writes), "phase 3 writes outside its row"
    return tile


def _bf16_of(tile: np.ndarray, r: int) -> torch.Tensor:
    # the 256 bf16 dims of row r of the half tile
    out = bytearray()
    for d in range(0, 256, 8):
        a = _piece(r, d // 64, (d % 64) // 8)
        out += tile[a:a + 16].tobytes()
    return torch.frombuffer(out, dtype=torch.bfloat16)


@pytest.mark.parametrize("seed", [0, 1])
def test_converter_contig_emulation(seed):
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    kv = (torch.randn(100, 576, generator=gen) * torch.logspace(-3, 3, 100)[:, None]).to(torch.bfloat16)
    cache = quantize_kv_fp8(kv)  # [100, 656] uint8, power-of-two scales per 128-dim tile
    ref = dequantize_kv_fp8(cache)
    rows = rng.integers(0, 100, ROWS)
    rows[rng.random(ROWS) < 0.15] = -1  # invalid slots: zero bytes, scale 0 -> zeros
    cache_np = cache.numpy()
    for chunk0, tile0 in ((0, 0), (16, 2)):  # the L half (dims 0..255) and the R half (256..511)
        tile = _emulate_half(cache_np, rows, chunk0, tile0, rng)
        for r in range(ROWS):
            want = (ref[rows[r], chunk0 * 16:chunk0 * 16 + 256] if rows[r] >= 0
                    else torch.zeros(256, dtype=torch.bfloat16))
            got = _bf16_of(tile, r)
            assert torch.equal(got.view(torch.int16), want.contiguous().view(torch.int16)), (chunk0, r, rows[r])
