"""CPU: the data movement of ``kernel_fwd_pair_cache``'s "converter_contig" and "converter_rows" stagings, emulated on the byte image of
one 128B-swizzled half tile [64 rows, 256 bf16 dims] (4 chunks of 8 KiB, 128-byte rows, 16-byte piece q of row r
at chunk * 8192 + r * 128 + (q ^ (r & 7)) * 16), with the index formulas of ``fdsa_gather_raw656<1>`` and
``fdsa_convert_half_contig`` transcribed.  The tile starts as garbage; the raw rows land in order; every
converter thread loads its raw chunks and scales (all before the named barrier), then the stores run in a random
thread order.  Checked: each load finds the cache's bytes, every store stays inside its thread's row, no two
stores write the same byte and together they cover the half tile, and the final bf16 slots equal
``dequantize_kv_fp8`` of the rows, for both halves of a row (scale tiles 0 / 1 and 2 / 3) and for invalid rows
(zero bytes, scale 0)."""

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


def _converter_phases(mapping: str):
    """The converter threads' work as phases of (thread, row, steps); a step is (raw chunk k, the piece address it
    is loaded from, its scale tile 0 / 1 of the half, (address of dims 16k..16k+7, address of dims 16k+8..16k+15))
    in the order the thread issues them.  "contig": ``fdsa_convert_half_contig`` (one phase, thread t: row t / 2);
    "rows": ``fdsa_convert_rows16_contig`` (phase j: rows 16 j .. 16 j + 15, the 8 lanes of a quarter warp on one
    row, lanes q >= 4 converting the other scale tile first and storing the upper 8 dims first)."""
    if mapping == "contig":
        phase = []
        for t in range(128):
            r, p = t >> 1, t & 1
            steps = []
            for j in range(8):
                c, m = j >> 2, (j + 2 * p) & 3
                lo = _piece(r, 2 * c + p, 2 * m)
                steps.append((8 * c + 4 * p + m, _piece(r, c, 4 * p + m), c, (lo, lo ^ 16)))
            phase.append((t, r, steps))
        return [phase]
    phases = []
    for j in range(4):
        phase = []
        for t in range(128):
            r, q = 16 * j + (t >> 3), t & 7
            hi = q >> 2
            steps = []
            for i in range(2):
                c = i ^ hi
                lo = _piece(r, 2 * c + hi, 2 * (q & 3))
                steps.append((8 * c + q, _piece(r, c, q), c, (lo, lo ^ 16)))
            phase.append((t, r, steps))
        phases.append(phase)
    return phases


def _emulate_half(cache: np.ndarray, rows, chunk0: int, tile0: int, rng, mapping: str) -> np.ndarray:
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

    # the converter: per phase, every thread of the phase loads its scales and raw chunks (before the barrier that
    # ends the phase's loads: the named barrier, or __syncwarp for the rows of one warp), then the stores in any order
    written = set()
    for phase in _converter_phases(mapping):
        loaded = []
        for t, r, steps in phase:
            a = _piece(r, 2, 0) + 4 * tile0
            s = np.frombuffer(tile[a:a + 8].tobytes(), dtype=np.float32)
            for k, src, c, stores in steps:
                got = tile[src:src + 16].copy()
                assert np.array_equal(got, raw_of(r, k)), f"row {r} raw chunk {k} not where it is loaded from"
                loaded.append((r, got, float(s[c]), stores))
        for i in rng.permutation(len(loaded)):
            r, raw, s, stores = loaded[i]
            out = np.frombuffer(_cvt(raw.tobytes(), s), dtype=np.uint8)
            for addr, part in ((stores[0], out[:16]), (stores[1], out[16:])):
                span = set(range(addr, addr + 16))
                assert (addr % 8192) // 128 == r, "a store leaves its row"
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


@pytest.mark.parametrize("mapping", ["contig", "rows"])
def test_converter_bank_groups(mapping):
    """Each shared-memory access instruction of the converter (a 16-byte load or store per lane) touches 8
    different 16-byte bank groups in every quarter warp (8 lanes): one wavefront per quarter warp."""
    for phase in _converter_phases(mapping):
        by_t = {t: steps for t, _, steps in phase}
        n_steps = len(phase[0][2])
        for i in range(n_steps):
            for which in ("load", "store0", "store1"):
                for w in range(0, 128, 8):
                    addrs = []
                    for t in range(w, w + 8):
                        k, src, c, stores = by_t[t][i]
                        hi = (t & 7) >> 2 if mapping == "rows" else 0
                        first = stores[hi]  # "rows": lanes q >= 4 store the upper 8 dims first
                        a = {"load": src, "store0": first, "store1": first ^ 16}[which]
                        addrs.append((a % 128) // 16)
                    assert len(set(addrs)) == 8, (mapping, which, i, w, addrs)


@pytest.mark.parametrize("mapping", ["contig", "rows"])
@pytest.mark.parametrize("seed", [0, 1])
def test_converter_contig_emulation(seed, mapping):
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    kv = (torch.randn(100, 576, generator=gen) * torch.logspace(-3, 3, 100)[:, None]).to(torch.bfloat16)
    cache = quantize_kv_fp8(kv)  # [100, 656] uint8, power-of-two scales per 128-dim tile
    ref = dequantize_kv_fp8(cache)
    rows = rng.integers(0, 100, ROWS)
    rows[rng.random(ROWS) < 0.15] = -1  # invalid slots: zero bytes, scale 0 -> zeros
    cache_np = cache.numpy()
    for chunk0, tile0 in ((0, 0), (16, 2)):  # the L half (dims 0..255) and the R half (256..511)
        tile = _emulate_half(cache_np, rows, chunk0, tile0, rng, mapping)
        for r in range(ROWS):
            want = (ref[rows[r], chunk0 * 16:chunk0 * 16 + 256] if rows[r] >= 0
                    else torch.zeros(256, dtype=torch.bfloat16))
            got = _bf16_of(tile, r)
            assert torch.equal(got.view(torch.int16), want.contiguous().view(torch.int16)), (chunk0, r, rows[r])
