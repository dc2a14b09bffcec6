"""Every public op rejects bad input up front with the right exception type and a message naming the argument."""

from __future__ import annotations

import re

import pytest
import torch

import flashdsa

I32 = torch.int32
BF16 = torch.bfloat16
FP8 = torch.float8_e4m3fn


def _strided_last(x):
    """Same shape and dtype as x, but stride 2 in the last dim."""
    return torch.zeros(*x.shape[:-1], 2 * x.shape[-1], dtype=x.dtype)[..., ::2]


# Valid arguments for every op: (function, positional args, keyword args).
def base_cases():
    M, H, D, N = 3, 2, 32, 7
    B, next_n, nb, bs = 2, 2, 4, 8
    T, Tkv, topk = 3, 9, 4
    return {
        "indexer_logits": (flashdsa.indexer_logits,
                           dict(q=torch.randn(M, H, D).to(BF16), k=torch.randn(N, D).to(BF16), weights=torch.rand(M, H)),
                           dict(k_start=torch.zeros(M, dtype=I32), k_end=torch.full((M,), N, dtype=I32))),
        "indexer_logits_paged": (flashdsa.indexer_logits_paged,
                                 dict(q=torch.randn(B, next_n, H, D).to(BF16), k_cache=torch.randn(nb, bs, D).to(BF16),
                                      weights=torch.rand(B * next_n, H), context_lens=torch.tensor([5, 9], dtype=I32),
                                      block_table=torch.tensor([[0, 1], [2, 3]], dtype=I32)),
                                 dict(max_context=9)),
        "topk_indices": (flashdsa.topk_indices, dict(scores=torch.randn(M, N), k=3),
                         dict(starts=torch.zeros(M, dtype=I32), ends=torch.full((M,), N, dtype=I32))),
        "dsa_topk": (flashdsa.dsa_topk,
                     dict(q=torch.randn(M, H, D).to(BF16), k=torch.randn(N, D).to(BF16), weights=torch.rand(M, H),
                          topk=3), dict(k_start=torch.zeros(M, dtype=I32), k_end=torch.full((M,), N, dtype=I32))),
        "sparse_mla_fwd": (flashdsa.sparse_mla_fwd,
                           dict(q=torch.randn(T, H, 576).to(BF16), kv=torch.randn(Tkv, 576).to(BF16),
                                indices=torch.zeros(T, topk, dtype=I32)),
                           dict(attn_sink=torch.zeros(H), topk_length=torch.full((T,), topk, dtype=I32))),
        "sparse_mla": (flashdsa.sparse_mla,
                       dict(q=torch.randn(T, H, 512).to(BF16), kv=torch.randn(Tkv, 512).to(BF16),
                            indices=torch.zeros(T, topk, dtype=I32)),
                       dict(attn_sink=torch.zeros(H), topk_length=torch.full((T,), topk, dtype=I32))),
        "sparse_attn": (flashdsa.sparse_attn,
                        dict(q=torch.randn(1, T, H, 64).to(BF16), kv=torch.randn(1, Tkv, 64).to(BF16),
                             attn_sink=torch.zeros(H), topk_idxs=torch.zeros(1, T, topk, dtype=I32)), {}),
        "mla_decode": (flashdsa.mla_decode,
                       dict(q=torch.randn(B, 1, H, 576).to(BF16), kv_cache=torch.randn(nb, bs, 576).to(BF16),
                            block_table=torch.tensor([[0, 1], [2, 3]], dtype=I32),
                            cache_seqlens=torch.tensor([5, 16], dtype=I32)), dict(attn_sink=torch.zeros(H))),
        "quantize_fp8": (flashdsa.quantize_fp8, dict(x=torch.randn(4, 128)), {}),
        "quantize_kv_fp8": (flashdsa.quantize_kv_fp8, dict(kv=torch.randn(4, 576).to(BF16)), {}),
        "dequantize_kv_fp8": (flashdsa.dequantize_kv_fp8, dict(x=torch.zeros(4, 656, dtype=torch.uint8)), {}),
    }


OPS = list(base_cases())
BACKEND_OPS = [op for op in OPS if not op.endswith("fp8")]


def call(op, **changes):
    fn, args, kwargs = base_cases()[op]
    merged = {**args, **kwargs, **changes}
    return fn(**merged)


def raises(exc, arg, op, **changes):
    with pytest.raises(exc, match=rf"^{re.escape(arg)}\b") as info:
        call(op, **changes)
    return str(info.value)


@pytest.mark.parametrize("op", OPS)
def test_valid_base_case_runs(op):
    kw = {"backend": "reference"} if op in BACKEND_OPS else {}
    call(op, **kw)


# --------------------------------------------------------------------------------------------- dtypes
WRONG_DTYPE = [
    ("indexer_logits", "q", lambda a: a.to(torch.int32)),
    ("indexer_logits", "k", lambda a: a.float()),  # not q's dtype
    ("indexer_logits", "weights", lambda a: a.to(BF16)),
    ("indexer_logits", "k_start", lambda a: a.long()),
    ("indexer_logits", "k_end", lambda a: a.float()),
    ("indexer_logits_paged", "q", lambda a: a.to(torch.int8)),
    ("indexer_logits_paged", "k_cache", lambda a: a.to(FP8)),
    ("indexer_logits_paged", "weights", lambda a: a.half()),
    ("indexer_logits_paged", "context_lens", lambda a: a.long()),
    ("indexer_logits_paged", "block_table", lambda a: a.long()),
    ("topk_indices", "scores", lambda a: a.to(BF16)),
    ("topk_indices", "starts", lambda a: a.long()),
    ("topk_indices", "ends", lambda a: a.to(torch.int16)),
    ("dsa_topk", "k", lambda a: a.float()),
    ("dsa_topk", "weights", lambda a: a.to(BF16)),
    ("sparse_mla_fwd", "q", lambda a: a.to(torch.int32)),
    ("sparse_mla_fwd", "kv", lambda a: a.float()),
    ("sparse_mla_fwd", "indices", lambda a: a.long()),
    ("sparse_mla_fwd", "attn_sink", lambda a: a.to(BF16)),
    ("sparse_mla_fwd", "topk_length", lambda a: a.long()),
    ("sparse_mla", "kv", lambda a: a.half()),
    ("sparse_mla", "indices", lambda a: a.float()),
    ("sparse_attn", "q", lambda a: a.to(torch.uint8)),
    ("sparse_attn", "kv", lambda a: a.float()),
    ("sparse_attn", "attn_sink", lambda a: a.half()),
    ("sparse_attn", "topk_idxs", lambda a: a.long()),
    ("mla_decode", "q", lambda a: a.to(torch.int32)),
    ("mla_decode", "kv_cache", lambda a: a.float()),
    ("mla_decode", "block_table", lambda a: a.long()),
    ("mla_decode", "cache_seqlens", lambda a: a.long()),
    ("mla_decode", "attn_sink", lambda a: a.to(BF16)),
    ("quantize_fp8", "x", lambda a: a.to(torch.int32)),
    ("quantize_kv_fp8", "kv", lambda a: a.to(torch.uint8)),
    ("dequantize_kv_fp8", "x", lambda a: a.to(torch.int8)),
]


def _base_arg(op, arg):
    _, args, kwargs = base_cases()[op]
    return {**args, **kwargs}[arg]


@pytest.mark.parametrize("op,arg,mutate", WRONG_DTYPE, ids=[f"{o}-{a}" for o, a, _ in WRONG_DTYPE])
def test_wrong_dtype_is_type_error(op, arg, mutate):
    msg = raises(TypeError, arg, op, **{arg: mutate(_base_arg(op, arg))})
    assert "dtype" in msg and "expected" in msg


@pytest.mark.parametrize("op,arg", [("indexer_logits", "q"), ("topk_indices", "scores"), ("sparse_mla_fwd", "q"),
                                    ("mla_decode", "q"), ("quantize_kv_fp8", "kv"), ("sparse_attn", "kv")])
def test_not_a_tensor_is_type_error(op, arg):
    raises(TypeError, arg, op, **{arg: [[1.0, 2.0]]})


# --------------------------------------------------------------------------------------------- shapes
WRONG_SHAPE = [
    ("indexer_logits", "q", lambda a: a[0]),
    ("indexer_logits", "k", lambda a: a[:, :16]),
    ("indexer_logits", "weights", lambda a: a[:, :1]),
    ("indexer_logits", "k_start", lambda a: a[:2]),
    ("indexer_logits", "k_end", lambda a: a.view(3, 1)),
    ("indexer_logits_paged", "q", lambda a: a[0]),
    ("indexer_logits_paged", "k_cache", lambda a: a[..., :16]),
    ("indexer_logits_paged", "weights", lambda a: a[:2]),
    ("indexer_logits_paged", "context_lens", lambda a: a[:1]),
    ("indexer_logits_paged", "block_table", lambda a: a[:1]),
    ("topk_indices", "scores", lambda a: a[0]),
    ("topk_indices", "starts", lambda a: a[:1]),
    ("topk_indices", "ends", lambda a: a.view(1, 3)),
    ("dsa_topk", "q", lambda a: a[0]),
    ("dsa_topk", "k", lambda a: a[0]),
    ("dsa_topk", "weights", lambda a: a[:1]),
    ("sparse_mla_fwd", "q", lambda a: a[..., :256]),  # Dqk not in {512, 576}
    ("sparse_mla_fwd", "q", lambda a: a[0]),
    ("sparse_mla_fwd", "kv", lambda a: a[:, :512]),
    ("sparse_mla_fwd", "kv", lambda a: a.view(1, 9, 1, 576)),
    ("sparse_mla_fwd", "kv", lambda a: torch.stack([a, a], 1)),  # [Tkv, 2, Dqk]
    ("sparse_mla_fwd", "indices", lambda a: a[:2]),
    ("sparse_mla_fwd", "indices", lambda a: a[:, :0]),  # topk 0
    ("sparse_mla_fwd", "indices", lambda a: torch.stack([a, a], 1)),  # [T, 2, topk]
    ("sparse_mla_fwd", "attn_sink", lambda a: a[:1]),
    ("sparse_mla_fwd", "topk_length", lambda a: a[:1]),
    ("sparse_mla", "q", lambda a: a[None, None]),
    ("sparse_mla", "indices", lambda a: a[0]),
    ("sparse_attn", "q", lambda a: a[0]),
    ("sparse_attn", "kv", lambda a: a[0]),
    ("sparse_attn", "topk_idxs", lambda a: a[0]),
    ("sparse_attn", "attn_sink", lambda a: a[:1]),
    ("mla_decode", "q", lambda a: a[0]),
    ("mla_decode", "q", lambda a: a[..., :64]),
    ("mla_decode", "kv_cache", lambda a: a[..., :512]),
    ("mla_decode", "kv_cache", lambda a: a[0]),
    ("mla_decode", "block_table", lambda a: a[0]),
    ("mla_decode", "cache_seqlens", lambda a: a[:1]),
    ("mla_decode", "attn_sink", lambda a: a[:1]),
    ("quantize_fp8", "x", lambda a: a[:, :100]),
    ("quantize_kv_fp8", "kv", lambda a: a[:, :512]),
    ("dequantize_kv_fp8", "x", lambda a: a[:, :576]),
]


@pytest.mark.parametrize("op,arg,mutate", WRONG_SHAPE, ids=[f"{o}-{a}-{i}" for i, (o, a, _) in enumerate(WRONG_SHAPE)])
def test_wrong_shape_is_value_error(op, arg, mutate):
    msg = raises(ValueError, arg, op, **{arg: mutate(_base_arg(op, arg))})
    assert "expected" in msg and "got" in msg


def test_batched_sparse_mla_shape_errors():
    q = torch.randn(2, 3, 2, 512).to(BF16)
    kv = torch.randn(2, 5, 512).to(BF16)
    idx = torch.zeros(2, 3, 4, dtype=I32)
    with pytest.raises(ValueError, match=r"^kv\b"):
        flashdsa.sparse_mla_fwd(q, kv[:1], idx)
    with pytest.raises(ValueError, match=r"^indices\b"):
        flashdsa.sparse_mla_fwd(q, kv, idx[:, :2])
    with pytest.raises(ValueError, match=r"^topk_length\b"):
        flashdsa.sparse_mla_fwd(q, kv, idx, topk_length=torch.zeros(6, dtype=I32))


# --------------------------------------------------------------------------------------------- layout
NONCONTIG = [("indexer_logits", "q"), ("indexer_logits", "k"), ("indexer_logits", "weights"),
             ("indexer_logits_paged", "q"), ("indexer_logits_paged", "k_cache"), ("indexer_logits_paged", "block_table"),
             ("topk_indices", "scores"), ("sparse_mla_fwd", "q"), ("sparse_mla_fwd", "kv"),
             ("sparse_mla_fwd", "indices"), ("sparse_mla", "q"), ("sparse_attn", "kv"), ("sparse_attn", "topk_idxs"),
             ("mla_decode", "q"), ("mla_decode", "kv_cache"), ("mla_decode", "block_table")]


@pytest.mark.parametrize("op,arg", NONCONTIG, ids=[f"{o}-{a}" for o, a in NONCONTIG])
def test_non_contiguous_last_dim_is_value_error(op, arg):
    x = _strided_last(_base_arg(op, arg))
    msg = raises(ValueError, arg, op, **{arg: x})
    assert "contiguous" in msg


# --------------------------------------------------------------------------------------------- values
def test_bad_order():
    msg = raises(ValueError, "order", "topk_indices", order="ascending")
    assert "'index'" in msg and "'ascending'" in msg


@pytest.mark.parametrize("k", [0, -3])
def test_k_below_one(k):
    raises(ValueError, "k", "topk_indices", k=k)
    raises(ValueError, "topk", "dsa_topk", topk=k)


@pytest.mark.parametrize("k", [2.0, "3", None, True])
def test_k_not_an_int(k):
    raises(TypeError, "k", "topk_indices", k=k)


def test_dsa_topk_bad_max_chunk_bytes():
    raises(ValueError, "max_chunk_bytes", "dsa_topk", max_chunk_bytes=0)
    raises(TypeError, "max_chunk_bytes", "dsa_topk", max_chunk_bytes=1.5)


def test_fp8_k_without_scale():
    q8 = torch.randn(3, 2, 32).to(FP8)
    raises(ValueError, "k_scale", "indexer_logits", q=q8, k=torch.randn(7, 32).to(FP8))
    raises(ValueError, "k_scale", "dsa_topk", q=q8, k=torch.randn(7, 32).to(FP8))
    raises(ValueError, "k_scale_cache", "indexer_logits_paged", q=torch.randn(2, 2, 2, 32).to(FP8),
           k_cache=torch.randn(4, 8, 32).to(FP8))
    raises(ValueError, "k_scale", "indexer_logits", k_scale=torch.ones(6))  # wrong shape
    raises(TypeError, "k_scale", "indexer_logits", k_scale=torch.ones(7, dtype=BF16))


@pytest.mark.parametrize("op", ["sparse_mla_fwd", "sparse_mla"])
def test_sparse_mla_scalar_options(op):
    raises(ValueError, "d_v", op, d_v=0)
    raises(ValueError, "d_v", op, d_v=1024)
    raises(TypeError, "d_v", op, d_v=512.0)
    raises(ValueError, "sm_scale", op, sm_scale=0.0)
    raises(ValueError, "sm_scale", op, sm_scale=float("inf"))
    raises(TypeError, "sm_scale", op, sm_scale="0.1")


def test_mla_decode_options():
    raises(ValueError, "d_v", "mla_decode", d_v=600)
    raises(TypeError, "causal", "mla_decode", causal=1)
    raises(ValueError, "topk_length", "mla_decode", topk_length=torch.ones(2, dtype=I32))  # without indices
    raises(ValueError, "indices", "mla_decode", indices=torch.zeros(2, 1, 0, dtype=I32))
    raises(ValueError, "indices", "mla_decode", indices=torch.zeros(2, 2, 3, dtype=I32))
    raises(TypeError, "block_table", "mla_decode", block_table=None)  # required for dense decode
    raises(TypeError, "cache_seqlens", "mla_decode", cache_seqlens=None)
    raises(ValueError, "q", "mla_decode", q=torch.randn(2, 1, 2, 512).to(BF16),  # 656-byte cache needs Dqk 576
           kv_cache=torch.zeros(4, 8, 656, dtype=torch.uint8))
    raises(ValueError, "sm_scale", "mla_decode", sm_scale=-1.0)


def test_sparse_mla_deterministic_must_be_bool():
    raises(TypeError, "deterministic", "sparse_mla", deterministic=1)


def test_quantize_fp8_bad_block():
    raises(ValueError, "block", "quantize_fp8", block=0)
    raises(ValueError, "x", "quantize_fp8", block=96)  # 128 is not a multiple of 96


# --------------------------------------------------------------------------------------------- backend
@pytest.mark.parametrize("op", BACKEND_OPS)
def test_bad_backend_string(op):
    msg = raises(ValueError, "backend", op, backend="cuda")
    assert "'reference'" in msg and "'cuda'" in msg


@pytest.mark.parametrize("op", BACKEND_OPS)
def test_backend_none_is_named(op):
    with pytest.raises(TypeError, match="^backend"):
        call(op, backend=None)


@pytest.mark.parametrize("op", BACKEND_OPS)
def test_bad_env_var(op, monkeypatch):
    monkeypatch.setenv("FLASHDSA_BACKEND", "tilelang")
    msg = raises(ValueError, "FLASHDSA_BACKEND", op)
    assert "'tilelang'" in msg


@pytest.mark.parametrize("op", BACKEND_OPS)
def test_env_var_reference_and_explicit_backend_wins(op, monkeypatch):
    monkeypatch.setenv("FLASHDSA_BACKEND", "reference")
    call(op)
    monkeypatch.setenv("FLASHDSA_BACKEND", "kernel")
    call(op, backend="reference")  # explicit backend wins over the environment
    with pytest.raises(NotImplementedError):
        call(op)  # auto defers to the env var: kernel forced on CPU


@pytest.mark.parametrize("op", BACKEND_OPS)
def test_kernel_backend_on_cpu_is_not_implemented(op):
    with pytest.raises(NotImplementedError, match=r"backend='kernel'") as info:
        call(op, backend="kernel")
    msg = str(info.value)
    assert "cpu" in msg.lower() or "no TileLang kernel" in msg, msg


# --------------------------------------------------------------------------------------------- devices
DEVICE_ARGS = [("indexer_logits", "k"), ("indexer_logits", "weights"), ("indexer_logits", "k_end"),
               ("indexer_logits_paged", "block_table"), ("topk_indices", "starts"), ("sparse_mla_fwd", "kv"),
               ("sparse_mla_fwd", "indices"), ("sparse_mla_fwd", "attn_sink"), ("sparse_attn", "topk_idxs"),
               ("mla_decode", "kv_cache"), ("mla_decode", "cache_seqlens")]


@pytest.mark.parametrize("op,arg", DEVICE_ARGS, ids=[f"{o}-{a}" for o, a in DEVICE_ARGS])
def test_mismatched_device_is_value_error(op, arg):
    """One argument on another device (the meta device stands in for CUDA on a CPU-only machine)."""
    x = _base_arg(op, arg).to("meta")
    msg = raises(ValueError, arg, op, **{arg: x})
    assert "meta" in msg and "cpu" in msg


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA for a real cross-device mismatch")
@pytest.mark.parametrize("op,arg", DEVICE_ARGS[:4], ids=[f"{o}-{a}" for o, a in DEVICE_ARGS[:4]])
def test_mismatched_cuda_device_is_value_error(op, arg):
    raises(ValueError, arg, op, **{arg: _base_arg(op, arg).cuda()})
