"""Balanced blocks read whole on one worker, then computed where planned: the transfers each round.

Two one-thread CPU worker processes (LocalCluster), Dask's active memory manager every 200 ms. Eight
balanced blocks of 1000x512 float64 (4 MB) persisted; each round computes ``y.rechunk(one block).sum()``
(a task on one worker reads every block: copies of the other worker's blocks), waits 0.6 s (the
manager drops one copy of each), then ``(y + 1).sum(axis=1)``, whose per-block tasks are pinned to the
blocks' planned workers. Counted per round: the blocks not held by their planned worker after the wait,
and the keys the workers fetched during the pinned compute. ``policy``: ``octopus`` (the plugin's
ReduceReplicas, sparing the planned worker's copy) or ``dask`` (Dask's own, put back by hand).

    python amm_homes.py ROUNDS
"""

import json
import sys
import time

import dask
import dask.array as da
from distributed import Client, LocalCluster, wait

import dask_octopus
from dask_octopus.placement.replicas import release_homes


def fetched(client: Client) -> int:
    return sum(client.run(lambda dask_worker: sum(len(e["keys"]) for e in dask_worker.transfer_incoming_log)).values())


def away(dask_scheduler, keys):
    plugin = dask_scheduler.plugins["octopus"]
    return sum(1 for k in keys if plugin.placement.home(k) not in {ws.address for ws in dask_scheduler.tasks[k].who_has})


def put_dask_back(dask_scheduler):
    release_homes(dask_scheduler, dask_scheduler.plugins["octopus"].placement.home)
    return sorted(type(p).__name__ for p in dask_scheduler.extensions["amm"].policies)


def run(policy: str, rounds: int) -> dict:
    with dask.config.set({"distributed.scheduler.active-memory-manager.interval": "200ms"}), \
            LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as cl, \
            Client(cl) as c:
        dask_octopus.register(c, calibrate=False)
        policies = c.run_on_scheduler(put_dask_back) if policy == "dask" else None
        x = da.random.default_rng(0).random((8000, 512), chunks=(1000, 512))
        y = c.persist(dask_octopus.balance(x, client=c))
        wait(y)
        keys = [k for row in y.__dask_keys__() for k in row]
        out = {"policy": policy, "policies": policies, "blocks": len(keys), "away": [], "fetched": [], "seconds": []}
        for _ in range(rounds):
            y.rechunk((8000, 512)).sum().compute()
            time.sleep(0.6)
            out["away"].append(c.run_on_scheduler(away, keys=keys))
            before = fetched(c)
            start = time.perf_counter()
            (y + 1).sum(axis=1).compute()
            out["seconds"].append(time.perf_counter() - start)
            out["fetched"].append(fetched(c) - before)
        return out


if __name__ == "__main__":
    rounds = int(sys.argv[1])
    results = [run(p, rounds) for p in ("dask", "octopus", "dask", "octopus")]
    for r in results:
        print(json.dumps(r))
