"""CPU: the FP8 forms of ``sparse_mla_fwd`` (656-byte cache; FP8 compute with scales) against a float64 oracle
that dequantizes independently (tests/oracles.py), plus their argument checks."""

import math

import pytest
import torch

import flashdsa
from oracles import kv_fp8_unpack_oracle, sparse_mla_oracle, sparse_mla_oracle_batched

E4M3 = torch.float8_e4m3fn


def _cache_inputs(T=5, H=3, Tkv=9, topk=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, 576, generator=g).bfloat16()
    kv = flashdsa.quantize_kv_fp8(torch.randn(Tkv, 576, generator=g))
    idx = torch.randint(-2, Tkv + 2, (T, topk), generator=g, dtype=torch.int32)
    idx[1] = -1  # an empty row
    return q, kv, idx


def _unpack_all(kv):
    return torch.stack([kv_fp8_unpack_oracle(bytes(r.tolist())) for r in kv.reshape(-1, kv.shape[-1])]).reshape(
        *kv.shape[:-1], 576)


def _close(out, lse, ref_out, ref_lse):
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-2, atol=1e-2)
    fin = torch.isfinite(ref_lse)
    assert torch.equal(fin, torch.isfinite(lse.double()))
    torch.testing.assert_close(lse.double()[fin], ref_lse[fin], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sink", [False, True])
def test_cache656_matches_oracle(sink):
    q, kv, idx = _cache_inputs()
    s = torch.tensor([0.3, -math.inf, math.inf]) if sink else None
    tl = torch.tensor([6, 6, 2, 0, 5], dtype=torch.int32)
    out, lse = flashdsa.sparse_mla_fwd(q, kv, idx, attn_sink=s, topk_length=tl)
    ref_out, ref_lse, _ = sparse_mla_oracle(q, _unpack_all(kv), idx, attn_sink=s, topk_length=tl)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    _close(out, lse, ref_out, ref_lse)


def test_cache656_batched_and_3d_kv():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 2, 576, generator=g).bfloat16()
    kv = flashdsa.quantize_kv_fp8(torch.randn(2, 7, 576, generator=g))
    idx = torch.randint(-1, 8, (2, 4, 5), generator=g, dtype=torch.int32)
    out, lse = flashdsa.sparse_mla_fwd(q, kv, idx)
    ref_out, ref_lse, _ = sparse_mla_oracle_batched(q, _unpack_all(kv), idx)
    _close(out, lse, ref_out, ref_lse)
    q2, kv2, idx2 = _cache_inputs()
    a = flashdsa.sparse_mla_fwd(q2, kv2.unsqueeze(1), idx2)
    b = flashdsa.sparse_mla_fwd(q2, kv2, idx2)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_fp8_compute_matches_oracle_on_dequantized_inputs():
    g = torch.Generator().manual_seed(1)
    T, H, Tkv, topk = 4, 2, 8, 5
    q8, qs = flashdsa.quantize_fp8(torch.randn(T, H, 576, generator=g), block=576)
    k8, ks = flashdsa.quantize_fp8(torch.randn(Tkv, 576, generator=g), block=576)
    idx = torch.randint(-1, Tkv, (T, topk), generator=g, dtype=torch.int32)
    qs, ks = qs[..., 0].contiguous(), ks[..., 0].contiguous()
    out, lse, mx = flashdsa.sparse_mla_fwd(q8, k8, idx, q_scale=qs, kv_scale=ks, return_max_logits=True)
    qd = q8.double() * qs.double().unsqueeze(-1)
    kd = k8.double() * ks.double().unsqueeze(-1)
    ref_out, ref_lse, ref_mx = sparse_mla_oracle(qd, kd, idx)
    _close(out, lse, ref_out, ref_lse)
    fin = torch.isfinite(ref_mx)
    torch.testing.assert_close(mx.double()[fin], ref_mx[fin], rtol=1e-5, atol=1e-5)


def test_fp8_forms_validation():
    q, kv, idx = _cache_inputs()
    with pytest.raises(ValueError, match=r"^q_scale\b"):
        flashdsa.sparse_mla_fwd(q, kv, idx, q_scale=torch.ones(5, 3))
    with pytest.raises(ValueError, match=r"^d_v\b"):
        flashdsa.sparse_mla_fwd(q, kv, idx, d_v=576)
    with pytest.raises(ValueError, match=r"^kv\b"):
        flashdsa.sparse_mla_fwd(q, kv[:, :600], idx)
    with pytest.raises(TypeError, match=r"^q\b"):
        flashdsa.sparse_mla_fwd(q.float(), kv, idx)
    q8 = q.float().to(E4M3)
    k8 = torch.randn(9, 576).to(E4M3)
    with pytest.raises(TypeError, match=r"^q_scale\b"):
        flashdsa.sparse_mla_fwd(q8, k8, idx, kv_scale=torch.ones(9))
    with pytest.raises(ValueError, match=r"^kv_scale\b"):
        flashdsa.sparse_mla_fwd(q8, k8, idx, q_scale=torch.ones(5, 3), kv_scale=torch.ones(8))
    with pytest.raises(TypeError, match=r"^q_scale\b"):
        flashdsa.sparse_mla_fwd(q8, k8, idx, q_scale=torch.ones(5, 3, dtype=torch.float64), kv_scale=torch.ones(9))
    with pytest.raises(TypeError, match=r"^kv\b"):
        flashdsa.sparse_mla_fwd(q8, k8.bfloat16(), idx, q_scale=torch.ones(5, 3), kv_scale=torch.ones(9))


@pytest.mark.parametrize("persistent,env,error", [(-1, None, ValueError), (True, None, TypeError),
                                                  (2.0, None, TypeError), (None, "-3", ValueError),
                                                  (None, "²", ValueError), (None, "x", ValueError)])
def test_pair_cache_persistent_switch_validation(monkeypatch, persistent, env, error):
    """The pair-cache kernel's timing switch (argument or ``$FLASHDSA_CACHE656_PERSISTENT``) rejects anything but a
    non-negative int, naming it, before any build (``check_positive_int``: TypeError for a non-int)."""
    pytest.importorskip("tilelang")
    from flashdsa.sparse import kernel_fwd_pair_cache as kmod

    if env is not None:
        monkeypatch.setenv(kmod.PERSISTENT_ENV, env)
    with pytest.raises(error, match="CACHE656_PERSISTENT" if env is not None else "^persistent"):
        kmod.launcher(64, 2, 0.1, False, False, persistent=persistent)


@pytest.mark.parametrize("kw,env", [(dict(q_gate="x"), None), (dict(q_gate=""), None), (dict(), "al,ar"),
                                    (dict(q_gate="al", staging="consumer"), None),
                                    (dict(q_gate="ar", persistent=3), None), (dict(staging="consumer"), "x")])
def test_pair_cache_q_gate_switch_validation(monkeypatch, kw, env):
    """The pair-cache kernel's Q gate (argument or ``$FLASHDSA_CACHE656_QGATE``) takes one of ``QGATES`` only, and
    an explicit "al" / "ar" only where a converter stages the tiles and each CTA has one item: a ValueError naming
    it, before any build."""
    pytest.importorskip("tilelang")
    from flashdsa.sparse import kernel_fwd_pair_cache as kmod

    if env is not None:
        monkeypatch.setenv(kmod.QGATE_ENV, env)
    with pytest.raises(ValueError, match="CACHE656_QGATE" if env is not None else "^q_gate"):
        kmod.launcher(64, 2, 0.1, False, False, **kw)


def test_pair_cache_stamps_validation():
    """The timestamp build's buffer and grid are checked before any build: a ValueError naming ``stamps``."""
    pytest.importorskip("tilelang")
    from flashdsa.sparse import kernel_fwd_pair_cache as kmod

    with pytest.raises(ValueError, match="^stamps"):
        kmod.launcher(64, 2, 0.1, False, False, persistent=4, stamps=True)
