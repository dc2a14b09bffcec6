"""Shared test setup: GPU skipping, seeds, hypothesis profiles, a clean backend environment.

The ``gpu`` marker is declared in pyproject.toml; tests marked with it skip themselves where CUDA is absent.
Hypothesis profiles: ``ci`` (default; modest example counts so the CPU suite stays within minutes on 2 cores) and
``dev`` (more examples). Pick one with ``HYPOTHESIS_PROFILE=dev pytest``.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

# The CPU tests use tiny tensors: intra-op threads only add spin-waits (badly so on a loaded 2-core CI machine).
torch.set_num_threads(1)

try:
    from hypothesis import HealthCheck, settings

    _common = dict(deadline=None, derandomize=False, print_blob=True,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                          HealthCheck.data_too_large])
    settings.register_profile("ci", max_examples=25, **_common)
    settings.register_profile("dev", max_examples=200, **_common)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
except ImportError:  # pragma: no cover - hypothesis is in the [test] extra
    pass


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (marked gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed_and_clean_env(monkeypatch):
    """Every test starts from seed 0 and without a FLASHDSA_BACKEND override leaking in from the shell."""
    monkeypatch.delenv("FLASHDSA_BACKEND", raising=False)
    torch.manual_seed(0)
    random.seed(0)
    yield


@pytest.fixture(autouse=True)
def _poison_gpu_allocations(request):
    """GPU tests run with every CUDA torch.empty / empty_like / new_empty filled with 0xFF bytes, or the module's
    ``POISON_BYTE`` (tests/poison.py). ``FLASHDSA_TEST_POISON``: "0" off, "all" every test and every device (the
    CPU paths too: a reference or host path that reads memory it never wrote shows up on the CPU as well)."""
    mode = os.environ.get("FLASHDSA_TEST_POISON", "1")
    byte = getattr(request.module, "POISON_BYTE", 0xFF)
    if byte is None or mode == "0" or (mode != "all" and "gpu" not in request.keywords):
        yield
        return
    from poison import poisoned_allocations  # tests/ is on sys.path, as for oracles

    with poisoned_allocations(byte, **({"where": lambda t: True} if mode == "all" else {})):
        yield


@pytest.fixture
def gen():
    """A seeded CPU torch.Generator for explicit randomness."""
    return torch.Generator().manual_seed(1234)
