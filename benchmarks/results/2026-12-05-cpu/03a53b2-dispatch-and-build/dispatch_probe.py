import sys, time, statistics, functools
sys.path.insert(0, "benchmarks")
import dask
import dask_octopus
from distributed import Client, LocalCluster, Worker
from distributed.scheduler import Scheduler
import distributed.worker_state_machine as wsm
import fragment_phases as fp
from dask_octopus.groups.rewrite import FRAGMENT_PREFIX
ev = {}
def stamp(name):
    ev.setdefault(name, time.time())
orig_msg = Scheduler._task_to_msg
def task_to_msg(self, ts, *a, **k):
    if FRAGMENT_PREFIX in str(ts.key): stamp("msg>")
    r = orig_msg(self, ts, *a, **k)
    if FRAGMENT_PREFIX in str(ts.key): stamp("msg<")
    return r
Scheduler._task_to_msg = task_to_msg
orig_hs = Worker.handle_stimulus
def hs(self, *stims):
    for s in stims:
        if isinstance(s, wsm.ComputeTaskEvent) and FRAGMENT_PREFIX in str(s.key): stamp("worker got")
    return orig_hs(self, *stims)
Worker.handle_stimulus = hs
orig_ex = Worker.execute
async def ex(self, key, **kw):
    if FRAGMENT_PREFIX in str(key): stamp("execute>")
    return await orig_ex(self, key, **kw)
Worker.execute = ex
if __name__ == "__main__":
    procs = "procs" in sys.argv
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=":0") as cl, Client(cl) as client:
        build = fp.chain_sum_builder(client, False)
        with dask_octopus.annotate():
            client.compute(build("warm")).result()
        events = {}
        fp.instrument(cl.scheduler, events)
        stamps = fp.Stamps(); cl.scheduler.add_plugin(stamps, name="st")
        rows = []
        for run in range(12):
            ev.clear(); events.clear(); stamps.compute.clear()
            with dask_octopus.annotate():
                y = build(f"r{run}")
                fut = client.compute(y)
            fut.result()
            s = stamps.compute[0][0]
            u = events["update_graph<"]
            rows.append([ev["msg>"]-u, ev["msg<"]-ev["msg>"], ev["worker got"]-ev["msg<"], ev["execute>"]-ev["worker got"], s-ev["execute>"], s-u])
        for name, col in zip(["ug<->msg>", "msg", "->worker", "->execute", "->start", "dispatch"], zip(*rows[2:])):
            print(f"{name:>10} {statistics.median(col)*1e3:7.2f} ms")
