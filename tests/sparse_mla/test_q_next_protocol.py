"""CPU: ``pair_body``'s q_gate "next" (the persistent grid's producer loads each item's Q ahead), as a discrete-event
model.

One CTA's items (each with 0..3 pairs) run through three actors and the TMA engine: the producer waits q_dead for
the previous item (parity ``_pair_parts.q_dead_parity``), issues the item's Q copy on q_bar and arrives, then issues
the item's pair gathers, each once both consumers freed the previous pair; each consumer waits q_bar (parity
``q_load_parity``), meets the other at BAR_BOTH, reads Q for each pair's QK, arrives q_dead at the top of the
item's last pair (at the item's start when it has none), frees the pair, and in ``finish`` writes its l half,
meets the other at BAR_BOTH and reads both halves.  mbarrier waits follow ``try_wait.parity(p)``: they pass iff
the barrier's completed-phase count has the other parity.  Random interleavings check that a Q read sees its own
item's Q with no copy landing in it, that a wait passes only on its own phase, that a copy never overwrites Q
while it is read, that both l halves read belong to the item, and that nothing deadlocks.  Two broken variants
(q_dead at the first pair's top; no BAR_BOTH at an item's start) must fail it.
"""

import random

import pytest

from flashdsa.sparse._pair_parts import q_dead_parity, q_load_parity


class Violation(AssertionError):
    pass


def _check(cond, what):
    if not cond:
        raise Violation(what)


def simulate(items, rng, dead_at="last", item_sync=True):
    """One random interleaving over ``items`` (pair counts); raises Violation on a protocol error or deadlock."""
    s = dict(qb_done=0, qb_arrived=False, qb_landed=False, qd_done=0, qd_arr=0, tma=None, q_item=None,
             reading=[False, False], both=[0, 0], ls=[None, None], freed={}, gathered=0)

    def q_bar_complete():
        if s["qb_arrived"] and s["qb_landed"]:
            s["qb_done"] += 1
            s["qb_arrived"] = s["qb_landed"] = False

    def arrive_dead():
        s["qd_arr"] += 1
        if s["qd_arr"] == 2:
            s["qd_done"], s["qd_arr"] = s["qd_done"] + 1, 0

    pair_base = [sum(items[:i]) for i in range(len(items))]

    def producer():
        for it, npair in enumerate(items):
            if it > 0:
                p = q_dead_parity(it)
                yield lambda p=p: (s["qd_done"] & 1) != p
                _check(s["qd_done"] == it, f"producer passed q_dead for item {it} at phase count {s['qd_done']}")
            _check(s["tma"] is None, "two Q copies in flight")
            _check(not any(s["reading"]), f"Q({it}) copy issued while a consumer reads Q")
            s["tma"] = it
            yield lambda: True
            s["qb_arrived"] = True
            q_bar_complete()
            for j in range(npair):
                g = pair_base[it] + j
                yield lambda g=g: g == 0 or s["freed"].get(g - 1, 0) == 2
                s["gathered"] = g + 1

    def tma():
        while True:
            yield lambda: s["tma"] is not None or s.get("done_prod", False)
            if s["tma"] is None:
                return
            _check(not any(s["reading"]), "a Q copy landed while a consumer reads Q")
            s["q_item"], s["tma"], s["qb_landed"] = s["tma"], None, True
            q_bar_complete()

    def consumer(c):
        for it, npair in enumerate(items):
            p = q_load_parity(it)
            yield lambda p=p: (s["qb_done"] & 1) != p
            _check(s["qb_done"] == it + 1, f"consumer {c} passed q_bar for item {it} at phase count {s['qb_done']}")
            if item_sync:
                k = s["both"][c] = s["both"][c] + 1
                yield lambda k=k: s["both"][1 - c] >= k
            if npair == 0:
                arrive_dead()
            for j in range(npair):
                g = pair_base[it] + j
                if dead_at == "first" and j == 0 or dead_at == "last" and j == npair - 1:
                    pending_dead = True
                else:
                    pending_dead = False
                yield lambda g=g: s["gathered"] > g
                _check(s["q_item"] == it and s["tma"] is None, f"consumer {c} QK of item {it} on Q({s['q_item']})")
                s["reading"][c] = True
                yield lambda: True
                s["reading"][c] = False
                if pending_dead:
                    arrive_dead()
                yield lambda: True
                s["freed"][g] = s["freed"].get(g, 0) + 1
            s["ls"][c] = it  # finish: own l half, BAR_BOTH, both halves read
            k = s["both"][c] = s["both"][c] + 1
            yield lambda k=k: s["both"][1 - c] >= k
            _check(s["ls"] == [it, it], f"consumer {c} read l halves {s['ls']} in item {it}")

    actors = {"producer": producer(), "c0": consumer(0), "c1": consumer(1), "tma": tma()}
    pending = {name: next(gen) for name, gen in actors.items()}
    while pending:
        runnable = [n for n, cond in pending.items() if cond()]
        if not runnable:
            raise Violation(f"deadlock: waiting {sorted(pending)}")
        name = rng.choice(runnable)
        try:
            pending[name] = next(actors[name])
        except StopIteration:
            del pending[name]
            if name == "producer":
                s["done_prod"] = True


def _item_lists(rng, n):
    for _ in range(n):
        yield [rng.choice((0, 1, 1, 2, 3)) for _ in range(rng.randint(1, 6))]


def test_q_next_protocol_holds():
    rng = random.Random(0)
    for items in _item_lists(rng, 400):
        for _ in range(5):
            simulate(items, rng)


@pytest.mark.parametrize("broken", [dict(dead_at="first"), dict(item_sync=False)], ids=["dead_at_first", "no_sync"])
def test_q_next_protocol_broken_variants_fail(broken):
    """q_dead at the top of the first pair lets the next Q land while the later QKs still read it; without
    BAR_BOTH at an item's start a consumer can rewrite its l half before the other read it."""
    rng = random.Random(1)
    with pytest.raises(Violation):
        for items in _item_lists(rng, 400):
            for _ in range(5):
                simulate(items, rng, **broken)
