import sys, time, cProfile, pstats
exec(open("benchmarks/results/2026-12-05-cpu/03a53b2-dispatch-and-build/dispatch_probe.py").read().split('if __name__')[0])
if __name__ == "__main__":
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=":0") as cl, Client(cl) as client:
        build = fp.chain_sum_builder(client, False)
        with dask_octopus.annotate():
            client.compute(build("warm")).result()
        pr = cProfile.Profile()
        client.sync(lambda: __import__("asyncio").sleep(0))
        cl.loop.add_callback(pr.enable); time.sleep(0.2)
        for run in range(10):
            with dask_octopus.annotate():
                y = build(f"r{run}")
                fut = client.compute(y)
            fut.result()
        cl.loop.add_callback(pr.disable); time.sleep(0.2)
        st = pstats.Stats(pr); st.sort_stats("cumulative").print_stats(60)
