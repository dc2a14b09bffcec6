"""CPU: the data movement of ``kernel_fwd_pair_cache``'s "converter_contig" staging, emulated on the byte image of
one 128B-swizzled half tile [64 rows, 256 bf16 dims] (4 chunks of 8 KiB, 128-byte rows, 16-byte piece q of row r
at chunk * 8192 + r * 128 + (q ^ (r & 7)) * 16), with the index formulas of ``fdsa_gather_raw656<1>`` and
``fdsa_convert_half_contig`` transcribed.  The tile starts as garbage; the raw rows land in order; every
converter thread loads its raw chunks and scales (all before the __syncwarp: a store stays in its row, whose two
threads are lanes of one warp), then the stores run in a random thread order.  Checked: each load finds the
cache's bytes, every store stays inside its thread's row, no two stores write the same byte and together they
cover the half tile, and the final bf16 slots equal ``dequantize_kv_fp8`` of the rows, for both halves of a row
(scale tiles 0 / 1 and 2 / 3) and for invalid rows (zero bytes, scale 0)."""

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

    def raw_of(r, k):  # what raw chunk k of row r must hold when it is loaded
        src = cache[rows[r]] if rows[r] >= 0 else np.zeros(cache.shape[1], np.uint8)
        return src[(chunk0 + k) * 16:(chunk0 + k + 1) * 16]

    # fdsa_convert_half_contig: every thread loads its scales and eight raw chunks (before the __syncwarp,
    # i.e. before any store to the same row), then the stores in any order
    loaded, written = {}, set()
    for t in range(128):
        r, p = t >> 1, t & 1
        a = _piece(r, 2, 0) + 4 * tile0
        s = np.frombuffer(tile[a:a + 8].tobytes(), dtype=np.float32)
        for j in range(8):
            c, m = j >> 2, (j + 2 * p) & 3
            k = 8 * c + 4 * p + m
            got = tile[_piece(r, c, 4 * p + m):_piece(r, c, 4 * p + m) + 16].copy()
            assert np.array_equal(got, raw_of(r, k)), f"row {r} raw chunk {k} not where it is loaded from"
            loaded[(t, j)] = (got, float(s[c]), _piece(r, 2 * c + p, 2 * m))
    for t in rng.permutation(128):
        for j in range(8):
            raw, s, lo = loaded[(t, j)]
            out = np.frombuffer(_cvt(raw.tobytes(), s), dtype=np.uint8)
            for addr, part in ((lo, out[:16]), (lo ^ 16, out[16:])):
                span = set(range(addr, addr + 16))
                assert (addr % 8192) // 128 == t >> 1, "a store leaves its row"
                assert not span & written, "two stores write the same bytes"
                written |= span
                tile[addr:addr + 16] = part
    assert len(written) == 4 * 8192, "the stores do not cover the half tile"
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
