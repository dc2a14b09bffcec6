"""CPU: the raw-row ring protocol of ``kernel_fwd_narrow656_dual`` ("ring" and "ringx") as a discrete-event model.

Two warpgroups convert alternate 64-row blocks; each chunk of ``QR`` rows lands in a ring stage through bulk
copies that complete an mbarrier phase; the warpgroup that converts chunk c refills its stage with chunk c + NS.
The model runs random interleavings of the two warpgroups and the copies' landings with the mbarrier's parity-wait
rule (``try_wait.parity(p)`` passes iff the barrier's completed-phase count has the other parity) and checks that
every wait passes only once its own chunk has landed, that a stage is refilled only after its chunk was converted,
that a barrier never has two chunks outstanding, and that nothing deadlocks.  The shared-barrier ring of the first
GPU run (one barrier per stage for both warpgroups, parity b % 2) must fail it.
"""

import random

import pytest

from flashdsa.sparse import kernel_fwd_narrow656_dual as dual


def _ring(cpb):  # "ring": NS = chunks per block, per-warpgroup barriers, parity j % 2 of the warpgroup's j-th block
    return dict(ns=cpb, issue_bar=lambda c: ((c // cpb) % 2) * cpb + c % cpb,
                wait_bar=lambda w, c: w * cpb + c % cpb, parity=lambda w, c, ph: ((c // cpb) // 2) % 2)


def _ring_shared(cpb):  # the first GPU build: one barrier per stage for both warpgroups, parity b % 2
    return dict(ns=cpb, issue_bar=lambda c: c % cpb, wait_bar=lambda w, c: c % cpb,
                parity=lambda w, c, ph: (c // cpb) % 2)


def _ringx(cpb, ns):  # "ringx": NS stages not tied to blocks, per-warpgroup barriers, parity from a phase mask
    return dict(ns=ns, issue_bar=lambda c: dual.ringx_barrier(c, cpb, ns), wait_bar=lambda w, c: w * ns + c % ns,
                parity=lambda w, c, ph: (ph >> (c % ns)) & 1)


def simulate(proto, cpb, n_blocks, rng):
    """Run one random interleaving; raise AssertionError on a protocol violation."""
    ns, total = proto["ns"], n_blocks * cpb
    done_phases = {}  # barrier -> completed phases
    outstanding = {}  # barrier -> chunk issued on it and not yet landed
    stage = [None] * ns  # chunk whose rows the stage holds (or is receiving)
    landed, converted, in_flight = set(), set(), []

    def issue(c):
        s, bar = c % ns, proto["issue_bar"](c)
        assert stage[s] is None or stage[s] in converted, f"chunk {c} overwrites unconverted chunk {stage[s]}"
        assert outstanding.get(bar) is None, f"barrier {bar}: chunk {c} issued while {outstanding[bar]} in flight"
        stage[s] = c
        outstanding[bar] = c
        in_flight.append(c)

    for c in range(min(ns, total)):  # prologue (warpgroup 0)
        issue(c)
    progs = []
    for w in (0, 1):
        chunks = [b * cpb + k for b in range(w, n_blocks, 2) for k in range(cpb)]
        progs.append({"w": w, "todo": chunks, "ph": 0})
    while any(p["todo"] for p in progs) or in_flight:
        moves = [("land", c) for c in in_flight]
        for p in progs:
            if p["todo"]:
                c = p["todo"][0]
                bar = proto["wait_bar"](p["w"], c)
                if done_phases.get(bar, 0) % 2 != proto["parity"](p["w"], c, p["ph"]):
                    moves.append(("step", p))
        assert moves, "deadlock"
        kind, x = rng.choice(moves)
        if kind == "land":
            in_flight.remove(x)
            landed.add(x)
            bar = proto["issue_bar"](x)
            outstanding[bar] = None
            done_phases[bar] = done_phases.get(bar, 0) + 1
            continue
        c = x["todo"].pop(0)
        assert c in landed and stage[c % ns] == c, f"warpgroup {x['w']} passed its wait for chunk {c} early"
        x["ph"] ^= 1 << (c % ns)
        converted.add(c)
        if c + ns < total:
            issue(c + ns)
    assert converted == set(range(total))


@pytest.mark.parametrize("name,cpb,ns", [("ring", 2, 2), ("ring16", 4, 4), ("ring64", 1, 1),
                                          ("ringx", 4, dual.RINGX_STAGES), ("ringx_3", 4, 3), ("ringx_7", 4, 7)])
@pytest.mark.parametrize("n_blocks", [1, 2, 3, 7, 32])
def test_ring_protocol_holds(name, cpb, ns, n_blocks):
    proto = _ringx(cpb, ns) if name.startswith("ringx") else _ring(cpb)
    for seed in range(60):
        simulate(proto, cpb, n_blocks, random.Random(seed))


def test_shared_barrier_ring_is_caught():
    fails = 0
    for seed in range(200):
        try:
            simulate(_ring_shared(2), 2, 8, random.Random(seed))
        except AssertionError as e:
            assert "early" in str(e)
            fails += 1
    assert fails > 0
