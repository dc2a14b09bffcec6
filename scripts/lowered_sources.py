"""Check that a refactor leaves the generated kernels alone: lower every kernel module's ``lowering_cases()`` (the
cases ``tests/test_lowering.py`` lowers, with each module's pass configs) to CUDA source, before and after.

    python scripts/lowered_sources.py dump /tmp/src_before [-j 2]     # on the old tree
    PYTHONPATH=$PWD/src python scripts/lowered_sources.py dump /tmp/src_after   # on the new tree
    python scripts/lowered_sources.py compare /tmp/src_before /tmp/src_after

No GPU needed (~6 minutes on two cores for the 86 cases). ``compare`` lists the cases whose sources differ, first
byte for byte, then after renaming every ``name_<n>`` identifier to ``name``. TileLang 0.1.15 does not lower one
prim_func to one source: the numbered suffixes of same-sized buffers (``workspace`` / ``workspace_1``, a buffer
allocated in two macros) come out permuted from run to run, even with ``PYTHONHASHSEED`` fixed (session 64). A case
that differs only byte for byte therefore says nothing; one that differs after the renaming is a real change.
"""

from __future__ import annotations

import argparse
import importlib
import multiprocessing
import pathlib
import re

_MODULES: dict = {}


def _cases() -> list[tuple[str, str]]:
    import flashdsa

    pkg = pathlib.Path(flashdsa.__file__).parent
    out = []
    for p in sorted(pkg.glob("*/kernel*.py")):
        mod = importlib.import_module(f"flashdsa.{p.parent.name}.{p.stem}")
        out += [(mod.__name__, name) for name, _ in mod.lowering_cases()]
        out += [(mod.__name__, "combine-" + name) for name, _ in getattr(mod, "combine_lowering_cases", list)()]
    return out


def _lower(args) -> str:
    from flashdsa._tilelang import lower_to_cuda_source

    (modname, name), outdir = args
    if modname not in _MODULES:  # one build of each module's cases per worker
        mod = importlib.import_module(modname)
        cases = dict(mod.lowering_cases())
        cases.update({"combine-" + n: f for n, f in getattr(mod, "combine_lowering_cases", list)()})
        _MODULES[modname] = (mod, cases)
    mod, cases = _MODULES[modname]
    configs = mod._pass_configs() if hasattr(mod, "_pass_configs") else None
    path = pathlib.Path(outdir) / f"{modname.removeprefix('flashdsa.')}-{name}.cu"
    path.write_text(lower_to_cuda_source(cases[name], configs, "sm_90a"))
    return path.name


def _renumbered(text: str) -> str:
    return re.sub(r"\b([A-Za-z][A-Za-z0-9]*(?:_[A-Za-z][A-Za-z0-9]*)*)(?:_[0-9]+)+\b", r"\1", text)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump")
    d.add_argument("outdir")
    d.add_argument("-j", type=int, default=2)
    c = sub.add_parser("compare")
    c.add_argument("a")
    c.add_argument("b")
    args = ap.parse_args()
    if args.cmd == "dump":
        pathlib.Path(args.outdir).mkdir(parents=True, exist_ok=True)
        cases = _cases()
        with multiprocessing.Pool(args.j) as pool:
            for i, name in enumerate(pool.imap_unordered(_lower, [(c, args.outdir) for c in cases]), 1):
                print(f"[{i}/{len(cases)}] {name}", flush=True)
        return 0
    a, b = pathlib.Path(args.a), pathlib.Path(args.b)
    names = sorted({p.name for p in a.glob("*.cu")} | {p.name for p in b.glob("*.cu")})
    real = 0
    for n in names:
        if not (a / n).exists() or not (b / n).exists():
            print(f"only in one: {n}")
            real += 1
            continue
        ta, tb = (a / n).read_text(), (b / n).read_text()
        if ta != tb:
            same = _renumbered(ta) == _renumbered(tb)
            real += not same
            print(f"{'renumbered only' if same else 'DIFFERENT'}: {n}")
    print(f"{len(names)} cases, {real} with a real difference")
    return 1 if real else 0


if __name__ == "__main__":
    raise SystemExit(main())
