"""CPU: which forward kernel the launchers pick for a head count (kernels replaced by recorders; nothing runs)."""

import pytest
import torch

pytest.importorskip("tilelang")

from flashdsa.sparse import (  # noqa: E402
    kernel_fwd, kernel_fwd_fp8cache, kernel_fwd_narrow, kernel_fwd_narrow656, kernel_fwd_narrow656_dual,
    kernel_fwd_pair, kernel_fwd_pair_cache,
)


def _fake_kernel(record, name):
    def build(*key, **kw):
        record.append((name, key))
        return lambda *args: None
    return build


@pytest.fixture
def record(monkeypatch):
    calls = []
    monkeypatch.setattr(kernel_fwd, "kernel_unsupported", lambda *a, **k: None)
    monkeypatch.setattr(kernel_fwd, "_compiled", _fake_kernel(calls, "padded"))
    monkeypatch.setattr(kernel_fwd_narrow, "_compiled", _fake_kernel(calls, "narrow"))
    monkeypatch.setattr(kernel_fwd_pair, "_compiled", _fake_kernel(calls, "pair"))
    monkeypatch.setattr(kernel_fwd_fp8cache, "kernel_unsupported", lambda *a, **k: None)
    monkeypatch.setattr(kernel_fwd_fp8cache, "_compiled", _fake_kernel(calls, "padded656"))
    monkeypatch.setattr(kernel_fwd_narrow656, "compiled", _fake_kernel(calls, "narrow656"))
    monkeypatch.setattr(kernel_fwd_narrow656_dual, "compiled", _fake_kernel(calls, "narrow656_dual"))
    monkeypatch.setattr(kernel_fwd_pair_cache, "kernel_unsupported", lambda *a, **k: None)
    monkeypatch.setattr(kernel_fwd_pair_cache, "_compiled", _fake_kernel(calls, "pair656"))
    return calls


@pytest.mark.parametrize("heads,narrow,pair,expect", [
    (1, None, None, "narrow"), (16, None, None, "narrow"), (32, None, None, "narrow"), (33, None, None, "padded"),
    (96, None, None, "padded"), (127, None, None, "padded"), (128, None, None, "pair"), (64, None, None, "pair"),
    (64, False, None, "pair"), (128, None, False, "padded"), (16, False, None, "padded"), (64, True, None, "narrow"),
])
def test_bf16_forward_picks_kernel(record, heads, narrow, pair, expect):
    q = torch.zeros(3, heads, 576, dtype=torch.bfloat16)
    kv = torch.zeros(10, 576, dtype=torch.bfloat16)
    idx = torch.zeros(3, 100, dtype=torch.int32)
    kernel_fwd.run_sparse_mla_fwd(q, kv, idx, sm_scale=0.1, d_v=512, narrow=narrow, pair=pair)
    assert [name for name, _ in record] == [expect]


@pytest.mark.parametrize("env,heads,pair,expect", [
    ("", 16, None, "narrow656_dual:ring_er_f16"), ("0", 16, None, "padded656"),
    ("", 1, None, "narrow656_dual:ring_er_f16"),
    ("", 17, None, "narrow656"), ("", 32, None, "narrow656"), ("1", 16, None, "narrow656"),
    ("narrow656", 9, None, "narrow656"), ("", 33, None, "padded656"), ("", 64, None, "pair656"),
    ("", 128, None, "pair656"), ("", 96, None, "padded656"), ("", 128, False, "padded656"),
    ("regs", 9, None, "narrow656_dual:regs"), ("ring16", 16, None, "narrow656_dual:ring16"),
    ("ring", 16, None, "narrow656_dual:ring"), ("ring_er", 16, None, "narrow656_dual:ring_er"),
    ("ring", 17, None, "narrow656"), ("ring_er_f16", 3, None, "narrow656_dual:ring_er_f16"),
])
def test_cache656_forward_picks_kernel(record, monkeypatch, env, heads, pair, expect):
    monkeypatch.setenv(kernel_fwd_fp8cache.NARROW_ENV, env)
    q = torch.zeros(3, heads, 576, dtype=torch.bfloat16)
    kv = torch.zeros(10, 656, dtype=torch.uint8)
    idx = torch.zeros(3, 100, dtype=torch.int32)
    kernel_fwd_fp8cache.run_sparse_mla_fwd(q, kv, idx, sm_scale=0.1, d_v=512, pair=pair)
    assert [_named(name, key) for name, key in record] == [expect]


def _named(name, key):
    return f"{name}:{key[-1]}" if name == "narrow656_dual" else name  # the dual form's last key is its prefetch


def test_cache656_explicit_forms(record):
    q = torch.zeros(3, 16, 576, dtype=torch.bfloat16)
    kv = torch.zeros(10, 656, dtype=torch.uint8)
    idx = torch.zeros(3, 100, dtype=torch.int32)
    for narrow in (None, True, "regs", False):
        kernel_fwd_fp8cache.run_sparse_mla_fwd(q, kv, idx, sm_scale=0.1, d_v=512, narrow=narrow)
    assert [_named(n, k) for n, k in record] == ["narrow656_dual:ring_er_f16", "narrow656", "narrow656_dual:regs",
                                                  "padded656"]


def test_narrow_rejects_wide_heads():
    with pytest.raises(ValueError, match="H=33"):
        kernel_fwd_narrow.rows_tile(33)


@pytest.mark.parametrize("form", ["ring", "ring_er_f16"])
def test_cache656_few_head_forms_reject_wide_heads(record, form):
    q = torch.zeros(3, 17, 576, dtype=torch.bfloat16)
    kv = torch.zeros(10, 656, dtype=torch.uint8)
    idx = torch.zeros(3, 100, dtype=torch.int32)
    with pytest.raises(ValueError, match="H=17"):
        kernel_fwd_fp8cache.run_sparse_mla_fwd(q, kv, idx, sm_scale=0.1, d_v=512, narrow=form)
