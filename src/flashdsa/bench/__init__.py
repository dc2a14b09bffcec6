"""The benchmark harness behind ``flashdsa bench``.

* :mod:`.harness`: timing (CUDA events after warm-up, L2 flush, rotating inputs, median/p10/p90), the
  environment record (GPU, clocks, versions, commit), running one suite into a JSON document.
* :mod:`.flops`: every FLOP/byte formula, each quoted from its issue.
* :mod:`.suites`: the case lists, one suite per op family, one case per workload of the issues' Speed tables.
* :mod:`.report`: the README performance table rendered from the newest H200 JSON per suite in
  ``benchmarks/results``.

Nothing here imports tilelang; the ops pick their backend at call time.
"""

from .suites import SUITES, get_cases

__all__ = ["SUITES", "get_cases"]
