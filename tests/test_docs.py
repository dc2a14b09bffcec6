"""Every public function's docstring follows the template (STYLE.md): Args / Returns / Raises / Example sections,
Args lists exactly the signature's parameters, and the Example runs (doctest)."""

from __future__ import annotations

import doctest
import inspect
import re

import pytest
import torch

import flashdsa

PUBLIC = [name for name in flashdsa.__all__ if callable(getattr(flashdsa, name))]
REQUIRED = ("Args", "Returns", "Raises", "Example")
_SECTION = re.compile(r"^([A-Z][A-Za-z ]*):\s*$")


def sections(doc: str) -> dict[str, list[str]]:
    """Top-level ``Name:`` headers (no indentation) of a cleaned docstring -> their indented body lines."""
    out: dict[str, list[str]] = {}
    cur = None
    for line in doc.splitlines():
        m = _SECTION.match(line)
        if m:
            cur = m.group(1)
            out[cur] = []
        elif cur is not None:
            if line.strip() and not line.startswith(" "):
                cur = None  # back to unindented prose
            else:
                out[cur].append(line)
    return out


def documented_args(body: list[str]) -> list[str]:
    """Names of the entries at the first indentation level of an Args: section (``name: ...`` lines)."""
    indents = [len(ln) - len(ln.lstrip()) for ln in body if ln.strip()]
    if not indents:
        return []
    base = min(indents)
    names = []
    for ln in body:
        if ln.strip() and len(ln) - len(ln.lstrip()) == base:
            m = re.match(r"\s*\*{0,2}(\w+)\s*(\(.*\))?:", ln)
            assert m, f"unparseable Args entry: {ln!r}"
            names.append(m.group(1))
    return names


def test_public_api_is_not_empty():
    assert {"indexer_logits", "topk_indices", "sparse_mla_fwd", "mla_decode", "quantize_kv_fp8"} <= set(PUBLIC)


# Known gaps, reported to the lead (remove the marks once src/flashdsa/quant.py gains the sections).
_MISSING_RAISES: set = set()


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.xfail(reason="BUG: docstring has no Raises: section (src/flashdsa/quant.py)"))
    if n in _MISSING_RAISES else n for n in PUBLIC])
def test_docstring_sections(name):
    doc = inspect.getdoc(getattr(flashdsa, name))
    assert doc, f"{name} has no docstring"
    secs = sections(doc)
    missing = [s for s in REQUIRED if s not in secs]
    assert not missing, f"{name}: missing sections {missing}"
    for s in REQUIRED:
        assert any(ln.strip() for ln in secs[s]), f"{name}: empty {s}: section"


@pytest.mark.parametrize("name", PUBLIC)
def test_args_match_signature(name):
    fn = getattr(flashdsa, name)
    params = [p for p in inspect.signature(fn).parameters]
    secs = sections(inspect.getdoc(fn) or "")
    assert "Args" in secs, f"{name}: no Args: section"
    doc_args = documented_args(secs["Args"])
    assert len(doc_args) == len(set(doc_args)), f"{name}: an argument is documented twice: {doc_args}"
    assert set(doc_args) == set(params), (f"{name}: undocumented {sorted(set(params) - set(doc_args))}, "
                                          f"documented but not parameters {sorted(set(doc_args) - set(params))}")
    assert doc_args == params, f"{name}: Args order {doc_args} differs from the signature {params}"


@pytest.mark.parametrize("name", PUBLIC)
def test_docstring_example_runs(name):
    fn = getattr(flashdsa, name)
    finder = doctest.DocTestFinder(recurse=False)
    globs = {"torch": torch, "flashdsa": flashdsa, **{n: getattr(flashdsa, n) for n in PUBLIC}}
    tests = [t for t in finder.find(fn, name, globs=globs) if t.examples]
    assert tests, f"{name}: the Example: section has no >>> lines"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    torch.manual_seed(0)
    for t in tests:
        runner.run(t)
    res = runner.summarize(verbose=False)
    assert res.failed == 0, f"{name}: {res.failed} of {res.attempted} doctest examples failed (see captured stdout)"
