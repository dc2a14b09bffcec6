"""Compile, on a CPU host, the TileLang kernels the GPU tests build, into a cache the GPU host then reuses.

    TILELANG_CACHE_DIR=/tmp/tlc python scripts/precompile.py [--log F] [pytest args, e.g. tests/decode]
    TILELANG_CACHE_DIR=/tmp/tlc python scripts/precompile.py --run scripts/memcheck_small.py decode_pair
    TILELANG_CACHE_DIR=/tmp/tlc python scripts/precompile.py --run -m flashdsa bench --op decode
    python scripts/precompile.py --pack /tmp/tlc .tlc/A.tar.xz     # the tarball a GPU call unpacks
    python scripts/precompile.py --mark /tmp/tlc                   # before the runs: record which entries they use
    python scripts/precompile.py --pack-used /tmp/tlc .tlc/G.tar.xz  # after: only those (a seeded cache's subset)

Why: every GPU host starts with a cold cache, and compiling (nvcc / ptxas) takes most of a GPU call's test time
while the device minutes are few. TileLang's kernel cache key is the prim_func's TVM script, the target string,
the pass configs and the TileLang version: nothing of the host. So a kernel compiled here for
``{"kind": "cuda", "arch": "sm_90a"}`` (what ``target="cuda"`` becomes on an H200) is a cache hit there.

How: the GPU tests themselves say which kernels they build. They run here with CUDA tensors fake (FakeTensors:
shapes, strides and dtypes, no memory; CPU tensors stay real, so the seeded input set-up runs as written) and
``torch.cuda`` answering as one H200 (capability 9.0, 132 SMs), so the library's validation and dispatch run as on
the GPU host and reach ``tilelang.compile`` with the same prim_funcs. The real compile runs (into
``TILELANG_CACHE_DIR``); the kernel handed back launches nothing. A value read from a fake tensor is 1 (``.item()``)
or True (``torch.equal``), a boolean mask selects everything, timing events say 1 ms and CUDA-graph captures run
their body once. A test that still stops early (or reads a value its kernel choice depends on) misses kernels:
the GPU call reports how many it still compiled (cache entries newer than the unpacked tarball).

Honest about what it is: no test result here means anything; pytest's own pass / fail lines are not shown. Only
the tests marked ``gpu`` run (``-m`` is overridden); ``--log F`` lists each test's compiles and why a test that
compiled nothing stopped.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import types

ARCH = "sm_90a"
H200 = dict(name="NVIDIA H200", major=9, minor=0, multi_processor_count=132, total_memory=150_754_820_096,
            max_shared_memory_per_block_optin=232_448, L2_cache_size=62_914_560, warp_size=32)


def _patch_torch_cuda():
    """Make torch.cuda answer as one H200 (the device queries the library and the tests make)."""
    import torch

    props = types.SimpleNamespace(**H200)
    stream = types.SimpleNamespace(cuda_stream=0, synchronize=lambda: None, wait_stream=lambda s: None,
                                   query=lambda: True)
    c = torch.cuda
    c.is_available = lambda: True
    c.device_count = lambda: 1
    c.current_device = lambda: 0
    c.get_device_capability = lambda device=None: (9, 0)
    c.get_device_properties = lambda device=None: props
    c.get_device_name = lambda device=None: props.name
    c.synchronize = lambda device=None: None
    c.current_stream = lambda device=None: stream
    c.manual_seed = c.manual_seed_all = lambda seed: None
    c.empty_cache = c.reset_peak_memory_stats = lambda device=None: None
    c.is_current_stream_capturing = lambda: False
    c._sleep = lambda cycles: None
    c.memory_allocated = c.max_memory_allocated = lambda device=None: 0

    class Event:  # timing code runs on (every interval 1 ms); nothing is measured here
        def __init__(self, *args, **kwargs):
            pass

        record = synchronize = wait = lambda self, *a, **k: None
        query = lambda self: True  # noqa: E731
        elapsed_time = lambda self, other: 1.0  # noqa: E731

    class CUDAGraph:  # a capture runs its body once (which compiles); a replay launches nothing
        def __init__(self, *args, **kwargs):
            pass

        replay = reset = capture_begin = capture_end = lambda self, *a, **k: None

    c.Event, c.CUDAGraph, c.Stream = Event, CUDAGraph, lambda *a, **k: stream
    c.graph = c.stream = lambda *a, **k: contextlib.nullcontext()

    class Profile:  # torch.profiler with CUDA activity (scripts/bench_overhead.py): runs its body, records nothing
        def __init__(self, *args, **kwargs):
            pass

        __enter__ = lambda self: self  # noqa: E731
        __exit__ = lambda self, *exc: False  # noqa: E731
        key_averages = events = lambda self, *a, **k: []  # noqa: E731
        step = lambda self: None  # noqa: E731

    import torch.profiler

    torch.profiler.profile = Profile


class _Inert:
    """What ``tilelang.compile`` returns here: the compile has happened (and is cached); a launch does nothing."""

    def __call__(self, *args, **kwargs):
        return None


COMPILED: list = []  # (test id, kernel name, seconds)
_current = {"test": "?"}


def _patch_tilelang():
    import tilelang
    import tilelang.cuda.target as cuda_target

    cuda_target._detect_torch_cuda_arch = lambda: ARCH  # target="cuda" -> sm_90a, as on the H200
    real = tilelang.compile

    def compile_and_keep(func, *args, **kwargs):
        t0 = time.time()
        real(func, *args, **kwargs)  # compiled and written to the cache
        name = str(func.attrs["global_symbol"]) if func.attrs and "global_symbol" in func.attrs else "?"
        COMPILED.append((_current["test"], name, time.time() - t0))
        return _Inert()

    tilelang.compile = compile_and_keep


_GUARD_SRC = """
#include <torch/extension.h>
#include <c10/core/impl/FakeGuardImpl.h>
// A CPU-only PyTorch has no device guard for CUDA; view and copy ops on fake CUDA tensors construct one.
C10_REGISTER_GUARD_IMPL(CUDA, c10::impl::FakeGuardImpl<c10::DeviceType::CUDA>);
int registered() { return 1; }
"""


def _register_fake_cuda_guard():
    """c10's FakeGuardImpl for CUDA (built once, ~20 s, under the torch extensions dir)."""
    from torch.utils.cpp_extension import load_inline

    load_inline("flashdsa_fake_cuda_guard", cpp_sources=_GUARD_SRC, functions=["registered"])


def _patch_fake_scalars():
    """A fake tensor's ``.item()`` / ``.tolist()`` answers 1 (1.0, True) instead of raising, so a test runs on
    past a value it reads (values only: the library's validation and dispatch read shapes and dtypes)."""
    import torch
    from torch._subclasses import fake_impls
    from torch._subclasses.fake_tensor import FakeTensor

    def plausible(fake_mode, func, arg):
        return 1.0 if arg.dtype.is_floating_point else (True if arg.dtype == torch.bool else 1)

    for op in (torch.ops.aten.item.default, torch.ops.aten._local_scalar_dense.default):
        fake_impls.op_implementations_dict[op] = plausible

    # data-dependent shapes (boolean-mask indexing in the tests' input set-up): as if every element were selected
    def nonzero(fake_mode, func, arg):
        return FakeTensor(fake_mode, torch.empty(arg.numel(), arg.dim(), dtype=torch.int64, device="meta"),
                          arg.device)

    def masked_select(fake_mode, func, arg, mask):
        n = torch.broadcast_shapes(arg.shape, mask.shape).numel()
        return FakeTensor(fake_mode, torch.empty(n, dtype=arg.dtype, device="meta"), arg.device)

    def unique2(fake_mode, func, arg, sorted=True, return_inverse=False, return_counts=False):
        def fake(*shape, dtype=torch.int64):
            return FakeTensor(fake_mode, torch.empty(*shape, dtype=dtype, device="meta"), arg.device)

        n = arg.numel()
        return (fake(n, dtype=arg.dtype), fake(*(arg.shape if return_inverse else (0,))),
                fake(n if return_counts else 0))

    def bool_answer(fake_mode, func, *args, **kwargs):  # torch.equal and the like: "yes"
        return True

    def returns_bool(func):
        rets = func._schema.returns
        return (torch.Tag.data_dependent_output in func.tags and len(rets) == 1
                and str(rets[0].type) == "bool")

    fake_impls.op_implementations_checks.insert(0, (returns_bool, bool_answer))
    fake_impls.op_implementations_dict[torch.ops.aten.nonzero.default] = nonzero
    fake_impls.op_implementations_dict[torch.ops.aten._unique2.default] = unique2
    fake_impls.op_implementations_dict[torch.ops.aten.masked_select.default] = masked_select


def _cuda_to_fake_mode():
    """A TorchFunctionMode under which CUDA tensors are fake (shapes, strides and dtypes, no memory) and CPU
    tensors stay real: a factory call with a CUDA ``device`` and a ``.to`` / ``.cuda`` of a CPU tensor to CUDA
    give FakeTensors on cuda:0; any op with a fake argument runs under the FakeTensorMode; the rest runs as is
    (so the tests' input set-up on the CPU, seeded generators included, runs for real)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.overrides import TorchFunctionMode
    from torch.utils._pytree import tree_flatten

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    cuda0 = torch.device("cuda", 0)

    def is_cuda(d):
        return (isinstance(d, str) and d.startswith("cuda")) or (isinstance(d, torch.device) and d.type == "cuda")

    def fake(meta):
        return FakeTensor(fake_mode, meta, cuda0) if isinstance(meta, torch.Tensor) else meta

    def meta_for(a):
        return "meta" if is_cuda(a) else a

    class CudaToFake(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func in (torch.Tensor.to, torch.Tensor.cuda) and args and type(args[0]) is torch.Tensor:
                if func is torch.Tensor.cuda:
                    return fake(args[0].to("meta"))
                if any(is_cuda(a) for a in (*args[1:], *kwargs.values())):
                    return fake(args[0].to("meta").to(*map(meta_for, args[1:]),
                                                      **{k: meta_for(v) for k, v in kwargs.items()}))
            if is_cuda(kwargs.get("device")):
                kw = {k: v for k, v in kwargs.items() if k not in ("generator", "pin_memory")}
                return fake(func(*args, **dict(kw, device="meta")))
            if any(isinstance(a, FakeTensor) for a in tree_flatten((args, kwargs))[0]):
                with fake_mode:
                    return func(*args, **kwargs)
            return func(*args, **kwargs)

    real_generator = torch.Generator

    class CudaGenerator(real_generator):  # a CPU generator that says cuda: its draws only feed fake tensors
        @property
        def device(self):
            return cuda0

    torch.Generator = lambda device="cpu": CudaGenerator() if is_cuda(device) else real_generator(device)
    return CudaToFake


class _Ctx:
    """The autograd context an op's setup_context / backward see, when precompile calls them itself."""

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors

    def set_materialize_grads(self, value):
        pass

    def mark_non_differentiable(self, *tensors):
        pass


def _patch_flashdsa():
    """Every op runs its real implementation directly (the eager path; fake tensors would send the dispatcher to
    the shape-only fake implementation), and when an input requires grad its backward runs at once on all-ones
    output grads: the autograd engine cannot run over fake CUDA tensors without a device, and this way the
    backward kernels compile too; where the backend refuses grads for every output, again with out's alone. (The
    test's own ``.backward()`` then fails; nothing here reads test results.)"""
    import torch

    from flashdsa import _library

    def call(self, *args):
        out = self.impl(*args)
        needs = tuple(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
        backward, setup_context = self.op._backward_fn, self.op._setup_context_fn  # torch's CustomOpDef
        if torch.is_grad_enabled() and any(needs) and backward is not None:
            ctx = _Ctx()
            ctx.needs_input_grad = needs
            setup_context(ctx, args, out)
            outs = out if isinstance(out, tuple) else (out,)
            grads = [torch.ones_like(o) if isinstance(o, torch.Tensor) and o.is_floating_point() else None
                     for o in outs]
            try:
                backward(ctx, *grads)
            except NotImplementedError:  # e.g. the backward kernel takes no dlse with a sink: the grad of out only,
                backward(ctx, grads[0], *(None for _ in grads[1:]))  # what a loss on out alone gives
        return out

    _library.Op.__call__ = call


class Plugin:
    """Runs every test with CUDA tensors fake and records the kernels each one compiled."""

    def __init__(self, mode):
        self.mode = mode
        self.ran = 0
        self.without = []  # tests that compiled nothing: (id, first error)

    def pytest_configure(self, config):
        config.option.markexpr = "gpu"

    def pytest_runtest_protocol(self, item, nextitem):
        from _pytest.runner import runtestprotocol

        _current["test"] = item.nodeid
        before = len(COMPILED)
        with self.mode():
            reports = runtestprotocol(item, nextitem=nextitem, log=False)
        self.ran += 1
        if len(COMPILED) == before:
            err = next((r.longrepr for r in reports if r.failed or r.skipped), None)
            msg = str(err).strip().splitlines()[-1][:160] if err else "passed without compiling"
            self.without.append((item.nodeid, msg))
        return True  # reported here: pytest's pass / fail is meaningless under fake tensors


def _report(plugin, log):
    n = len(COMPILED)
    secs = sum(s for _, _, s in COMPILED)
    lines = [f"precompile: {plugin.ran} tests, {n} compile calls ({secs:.0f} s), "
             f"{len(plugin.without)} tests compiled nothing"]
    lines += [f"  no compile: {t}: {m}" for t, m in plugin.without]
    lines += [f"  {s:6.1f} s {name} <- {t}" for t, name, s in COMPILED]
    text = "\n".join(lines) + "\n"
    if log:
        with open(log, "a") as f:
            f.write(text)
    print(lines[0])


_USED_MARK = ".used-mark"


def _kernel_dirs(cache_dir: str):
    """(path relative to ``cache_dir``, [file paths]) of every kernel entry (not TileLang's staging dirs, not the
    nvcc-level binary cache, whose keys hold this host's include paths and so never hit on the GPU host)."""
    for root, dirs, files in os.walk(cache_dir):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d != "cuda-binaries"]
        if "manifest.json" in files:
            yield os.path.relpath(root, cache_dir), [os.path.join(root, f) for f in files]


def mark(cache_dir: str) -> None:
    """Start recording which entries of ``cache_dir`` are used: every file's access time goes back to 2000 (so
    that the next read updates it, also under ``relatime``) and ``.used-mark`` is written now; after the
    precompile runs, ``--pack-used`` packs the entries read or written since.  (A tar or copy of the whole
    directory reads every entry: pack from it only after ``--pack-used``.)"""
    old = 946684800  # 2000-01-01
    n = 0
    for _, paths in _kernel_dirs(cache_dir):
        for f in paths:
            os.utime(f, (old, os.stat(f).st_mtime))
        n += 1
    with open(os.path.join(cache_dir, _USED_MARK), "w") as f:
        f.write("used-entries mark\n")
    print(f"marked {n} kernels in {cache_dir}")


def used(cache_dir: str) -> list[str]:
    """The kernel entries of ``cache_dir`` read or written since ``mark``."""
    since = os.stat(os.path.join(cache_dir, _USED_MARK)).st_mtime
    return sorted(rel for rel, paths in _kernel_dirs(cache_dir)
                  if any(max(os.stat(f).st_atime, os.stat(f).st_mtime) > since for f in paths))


def pack(cache_dir: str, out: str, names: list[str] | None = None) -> None:
    """xz-tar the kernel entries ``names`` of ``cache_dir`` (None: every entry, ``_kernel_dirs``)."""
    import subprocess

    if names is None:
        names = [rel for rel, _ in _kernel_dirs(cache_dir)]
    # xz -9e: the entries are near copies of each other, and the large dictionary finds that (session 45: 415
    # kernels in 7.4 MB against 11.9 at the default level, which decides whether a call's carry fits 64 MiB)
    subprocess.run(["tar", "-C", cache_dir, "-cJf", out, *sorted(names)], check=True,
                   env=dict(os.environ, XZ_OPT="-9e"))
    print(f"packed {len(names)} kernels into {out} ({os.path.getsize(out) / 2**20:.1f} MiB)")


def run_program(argv: list[str], mode) -> int:
    """Run a script (``path args``) or a module (``-m name args``) as ``__main__`` with CUDA tensors fake, up to
    its first data-dependent step or error; print what it compiled."""
    import runpy
    import tempfile
    import traceback

    _current["test"] = " ".join(argv)
    if argv[:3] == ["-m", "flashdsa", "bench"]:
        # its timings here are fake (1 ms): its JSON goes to a temp folder, not benchmarks/results/ (right after
        # "bench", so a folder the caller names, in any spelling, comes later and wins)
        argv = [*argv[:3], "--results-dir", tempfile.mkdtemp(prefix="precompile-bench-"), *argv[3:]]
    sys.argv = argv[1:] if argv[0] == "-m" else argv
    try:
        with mode():
            if argv[0] == "-m":
                runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(argv[0], run_name="__main__")
    except (Exception, SystemExit) as e:
        last = traceback.format_exception_only(type(e), e)[-1].strip()
        print(f"precompile: stopped at {last[:200]}")
    print(f"precompile: {len(COMPILED)} compile calls ({sum(s for _, _, s in COMPILED):.0f} s): "
          + ", ".join(name for _, name, _ in COMPILED))
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["--pack"]:
        pack(argv[1], argv[2])
        return 0
    if argv[:1] == ["--mark"]:
        mark(argv[1])
        return 0
    if argv[:1] == ["--pack-used"]:
        pack(argv[1], argv[2], used(argv[1]))
        return 0
    log = None
    if argv[:1] == ["--log"]:
        log, argv = argv[1], argv[2:]
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    sys.path[:0] = [os.path.join(root, "src"), os.path.join(root, "tests")]
    _patch_torch_cuda()
    _patch_tilelang()
    _register_fake_cuda_guard()
    _patch_fake_scalars()
    _patch_flashdsa()
    mode = _cuda_to_fake_mode()
    if argv[:1] == ["--run"]:
        return run_program(argv[1:], mode)
    import pytest

    plugin = Plugin(mode)
    pytest.main(["-q", "-p", "no:cacheprovider", "-p", "no:randomly", "--no-header", "-o", "addopts=",
                 "--capture=sys", *argv], plugins=[plugin])
    _report(plugin, log)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
