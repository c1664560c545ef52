"""The attack search in a CI budget (issue step 14): a fixed slice of the search's newest family
(every attack of the library, f < n/3 attackers on 1 to f /24s, random timings, honest churn), each
schedule checked for every invariant. The long run and its seed range are in docs/BENCHMARKS.md
("The attack search"); ``python -m bench.swarm --replay SEED`` tells one schedule's story."""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

import pytest

from hivetrain.peer.sim.attacks import LIBRARY
from hivetrain.peer.sim.search import NEXT_SEEDS, verdict

# NEXT 6,000,000-6,000,059: each of the library's attacks drawn at least once (asserted below), in
# runs of 6 to 14 peers at targets 4 and 8, with and without a crash; about 3 s a schedule on one core
SEEDS = range(NEXT_SEEDS, NEXT_SEEDS + 60)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_search_finds_no_broken_invariant_in_a_ci_budget() -> None:
    workers = max(1, min(4, os.cpu_count() or 1))
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        rows = list(zip(SEEDS, pool.map(verdict, SEEDS), strict=True))
    drawn = {a for _, (attacks, _, _) in rows for a in attacks}
    assert drawn == set(LIBRARY), f"attacks never drawn in this slice: {sorted(set(LIBRARY) - drawn)}"
    broken = {seed: found for seed, (_, found, _) in rows if found}
    assert not broken, "\n".join(f"seed {seed}: {'; '.join(found)}  (python -m bench.swarm --replay {seed})"
                                 for seed, found in broken.items())
    completed = sum(m["I4_completed_fraction"] for _, (_, _, m) in rows) / len(rows)
    assert completed > 0.8, f"honest peer-rounds completed {completed:.3f}: the swarm barely trains under attack"
