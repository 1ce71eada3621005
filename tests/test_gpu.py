"""GPU tests (marked ``gpu``; skipped without CuPy and a CUDA device). Run on the GPU machine. The UCX
tests also skip without distributed-ucxx (``protocol="ucx"``). Tests of two workers run them on two GPUs,
or both on GPU 0 where it is the only one; those that tell two GPUs apart skip without two."""

import contextlib
import os
import time

import numpy as np
import pytest

from dask_octopus.bench.workloads import workers_info

pytestmark = pytest.mark.gpu


def capture_stats(dask_worker):
    """Captured, refused and replayed groups on a worker (its stream-group runtime)."""
    from dask_octopus.groups.streams import EXTENSION

    return dask_worker.extensions[EXTENSION].stats()


def n_gpus():
    import cupy

    return cupy.cuda.runtime.getDeviceCount()


def test_gpu_probe_figures_and_memory_is_freed():
    import cupy

    from dask_octopus.profiling.probes import run_probes

    pool = cupy.get_default_memory_pool()
    before = pool.total_bytes()
    p = run_probes(0.6)
    assert p["device"] == "gpu" and p["memory_total"] > 2**30
    assert p["compute"] > 1e12 and p["memory"] > 1e11  # FLOP/s and bytes/s of a real GPU
    assert p["probe_seconds"] < 3
    assert pool.total_bytes() == before


def needs_two_gpus():
    """Skip without two GPUs."""
    if n_gpus() < 2:
        pytest.skip("needs two GPUs")


@contextlib.contextmanager
def two_worker_cluster(protocol):
    """A client of two dask-cuda workers that talk over ``protocol``: on GPUs 0 and 1, or both on GPU 0
    where it is the only one (:func:`~dask_octopus.bench.experiment.local_cluster` with ``"0,0"``)."""
    from dask_octopus.bench.experiment import local_cluster

    with local_cluster(True, "0,1" if n_gpus() >= 2 else "0,0", protocol=protocol) as c:
        assert len(c.scheduler_info()["workers"]) == 2
        assert c.scheduler.address.startswith(f"{protocol}://")
        yield c


@pytest.fixture
def cuda_client():
    """Two dask-cuda workers on two GPUs, over TCP: for what tells the GPUs apart (a co-tenant on one)."""
    needs_two_gpus()
    with two_worker_cluster("tcp") as c:
        yield c


@pytest.fixture
def worker_pair():
    """Two dask-cuda workers over TCP, on two GPUs or sharing the only one: for what two workers do
    (placement, fragments and their aggregate, a worker's death), whatever their speeds."""
    with two_worker_cluster("tcp") as c:
        yield c


@pytest.fixture
def ucx_pair():
    """Two dask-cuda workers talking UCX (NVLink between two GPUs where it links them)."""
    pytest.importorskip("distributed_ucxx", reason="protocol ucx needs distributed-ucxx")
    with two_worker_cluster("ucx") as c:
        yield c


def cuda_worker_processes():
    """How many ``dask cuda worker`` commands start two workers: one on two GPUs, or two on the only one."""
    return 1 if n_gpus() >= 2 else 2


def cuda_worker_env():
    """The GPUs each of those commands sees: the first two this process sees (one worker each; more GPUs
    would start more workers), or the only one."""
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()] or ["0", "1"]
    return {"CUDA_VISIBLE_DEVICES": ",".join(visible[:2]) if n_gpus() >= 2 else visible[0]}


def test_calibration_on_two_gpus_one_with_a_cotenant(cuda_client):
    import dask_octopus
    from dask_octopus.bench.cotenant import CoTenant

    info = workers_info(cuda_client)
    shared = next(w for w, v in info.items() if str(v["name"]) == "0")
    with CoTenant(gpus=[0]):
        dask_octopus.register(cuda_client)
        weights = dask_octopus.speeds(cuda_client)
        profiles = dask_octopus.profiles(cuda_client)
    print("weights", weights)
    print("profiles", profiles)
    assert weights[shared] < 0.4
    assert all(p["device"] == "gpu" and p["error"] is None for p in profiles.values())


def test_balance_cupy_array_exact_and_pinned(worker_pair):
    import dask_octopus

    dask_octopus.register(worker_pair)
    balance_exact_and_pinned(worker_pair)


def balance_exact_and_pinned(client):
    """Balance a CuPy array in two blocks per worker: each worker's rows follow its weight, the values
    are exact, and every per-block task ran on its block's worker."""
    import cupy
    import dask.array as da
    from dask.utils import key_split
    from distributed import get_task_stream

    import dask_octopus

    rng = da.random.default_rng(cupy.random.default_rng(0))
    x = rng.random((100_000, 256), chunks=(10_000, 256), dtype=np.float32)
    weights = dask_octopus.speeds(client)
    y = dask_octopus.balance(x, per_worker=2)
    plan = client.run_on_scheduler(
        lambda dask_scheduler, name=y.name: dask_scheduler.plugins["octopus"].placement.plans[name].workers)
    # each worker's rows follow its calibrated weight: predicted makespan within min-gain (3%) of the best
    rows = {w: sum(n for n, owner in zip(y.chunks[0], plan) if owner == w) for w in weights}
    assert max(rows[w] / weights[w] for w in weights) <= 1.03 * (100_000 + len(weights)), (rows, weights)
    reference = client.compute((x * 2 + 1).sum(axis=1)).result()
    with get_task_stream(client) as ts:
        result = client.compute((y * 2 + 1).sum(axis=1)).result()
    assert isinstance(result, cupy.ndarray)
    cupy.testing.assert_array_equal(result, reference)
    blocks = [(r["key"], r["worker"]) for r in ts.data
              if isinstance(r["key"], tuple) and not key_split(r["key"]).startswith(("random", "rechunk-split"))]
    assert len(blocks) >= 4 and all(w == plan[k[1]] for k, w in blocks)


def test_online_refinement_from_cuda_events_after_a_slowdown(cuda_client):
    """Tasks that return at kernel launch (no sync) still refine speeds: the worker times them with events."""
    import cupy

    import dask_octopus
    from dask_octopus.bench.cotenant import CoTenant
    from dask_octopus.bench.workloads import gemm_repeat

    dask_octopus.register(cuda_client)
    info = workers_info(cuda_client)
    shared = next(w for w, v in info.items() if str(v["name"]) == "0")
    assert dask_octopus.speeds(cuda_client)[shared] > 0.4
    data = {w: cuda_client.submit(cupy.ones, (4096, 4096), dtype="float32", workers=[w]) for w in info}
    with CoTenant(gpus=[0]):
        for _ in range(6):
            futs = [cuda_client.submit(gemm_repeat, data[w], 20, False, workers=[w], pure=False) for w in info]
            cuda_client.gather(futs)
        import time

        time.sleep(0.6)  # event timings are polled every 200 ms
        weights = dask_octopus.speeds(cuda_client)
        profiles = dask_octopus.profiles(cuda_client)
    print("weights after slowdown", weights, {w: p["samples"] for w, p in profiles.items()})
    assert all(p["event_timing"] for p in profiles.values())
    rates = cuda_client.run_on_scheduler(lambda dask_scheduler: dask_scheduler.plugins["octopus"].model.table())
    timed = rates["gemm_repeat"]  # the tasks returned at launch: these timings are the CUDA events'
    assert set(timed) == set(info) and all(count >= 3 for _, seconds, count in timed.values())
    assert all(seconds > 0.01 for _, seconds, _ in timed.values())  # 20 GEMMs of 4096^2, not a launch's us
    assert weights[shared] < 0.4


def test_map_cupy_items_exact_and_placed(worker_pair):
    import dask_octopus

    dask_octopus.register(worker_pair)
    map_exact_and_placed(worker_pair)


def map_exact_and_placed(client):
    """``map`` image pipelines over the workers: exact histograms, each worker's share of the cost near its weight."""
    import dask_octopus
    from dask_octopus.bench.workloads import image_pipeline, specs, to_host

    items = specs("video", 0.5, 2)
    weights = dask_octopus.speeds(client)
    futs = dask_octopus.map(image_pipeline, items, cost=[h * w for h, w, _ in items], group=8)
    got = client.gather(futs)
    expected = [image_pipeline(it) for it in items]  # the same pipeline, in this process
    assert all(np.array_equal(to_host(a), to_host(b)) for a, b in zip(got, expected, strict=True))
    plan = client.run_on_scheduler(lambda dask_scheduler: next(
        p for n, p in dask_scheduler.plugins["octopus"].placement.plans.items() if "-octopus-map-" in n))
    load = {w: 0.0 for w in weights}  # the planned cost of each worker's batches
    for w, c in zip(plan.workers, plan.costs):
        load[w] += c
    total = sum(load.values())
    # indivisible items, 60 of them: each worker's share of the cost within 0.15 of its weight
    assert all(abs(load[w] / total - weights[w]) < 0.15 for w in weights), (load, weights)


def gemms_unless_on(x, bad):
    """20 GEMMs of 2048^2 on the GPU; on the worker ``bad``, an error after the first 5 (a later step
    fails there)."""
    import cupy
    from distributed import get_worker

    a = cupy.ones((2048, 2048), dtype=cupy.float32)
    for i in range(20):
        if i == 5 and get_worker().address == bad:
            raise ImportError("library missing on this worker")
        a = a @ a / 2048
    return x


def test_gpu_batches_whose_items_failed_teach_no_speed(worker_pair):
    """The CUDA-event timings of a batch whose items failed are not sent: the worker where the function
    fails early would look fast (its batches do a quarter of the work) and take most of the next map's items."""
    import dask_octopus

    dask_octopus.register(worker_pair, calibrate=False)
    good, bad = sorted(workers_info(worker_pair))
    for _ in range(3):
        out = dask_octopus.map(gemms_unless_on, range(24), client=worker_pair, cost=[1.0] * 24, gather=True,
                               errors="skip", bad=bad)
        assert out and set(out) < set(range(24))
    time.sleep(0.6)  # event timings are polled every 200 ms
    profiles = dask_octopus.profiles(worker_pair)
    assert all(p["event_timing"] for p in profiles.values())
    rates = worker_pair.run_on_scheduler(lambda dask_scheduler: dask_scheduler.plugins["octopus"].model.table())
    timed = {p: per for p, per in rates.items() if "octopus-map" in p}
    assert timed and all(good in per and bad not in per for per in timed.values()), timed


def square_gemms(block):
    """20 GEMMs of a square block by itself (scaled)."""
    for _ in range(20):
        block = block @ block / block.shape[0]
    return block


def test_gpu_fragment_timings_name_their_members_work(cuda_one):
    """The CUDA-event timing of a fragment task goes under its members' prefixes, not the one prefix that
    every fragment task's key has."""
    import cupy
    import dask.array as da

    import dask_octopus

    x = cuda_one.persist(da.ones((8192, 2048), dtype="float32", chunks=2048).map_blocks(cupy.asarray))
    for _ in range(3):
        with dask_octopus.annotate():
            cuda_one.compute(x.map_blocks(square_gemms).sum()).result()
    time.sleep(0.6)  # event timings are polled every 200 ms
    rates = cuda_one.run_on_scheduler(lambda dask_scheduler: dask_scheduler.plugins["octopus"].model.table())
    fragments = [p for p in rates if p.startswith("octopus-fragments")]
    # (Dask fuses the GEMMs into the partial sums: octopus-fragments(sum+sum-partial))
    assert fragments and all(p != "octopus-fragments" and "sum-partial" in p for p in fragments), list(rates)


def test_dask_cuda_worker_with_preload(tmp_path):
    """``dask cuda worker --preload dask_octopus``: two workers (one command on two GPUs, or two
    commands on the only one), calibrated on arrival, then balanced, pinned and exact."""
    import cupy
    import dask.array as da
    from test_deployment import check_balanced_and_pinned, cli_cluster

    with cli_cluster(tmp_path, ["cuda", "worker"], n_workers=2, worker_processes=cuda_worker_processes(),
                     worker_env=cuda_worker_env()) as c:
        assert all(p["device"] == "gpu" for p in dask_octopus_profiles(c).values())
        rng = da.random.default_rng(cupy.random.default_rng(1))
        x = rng.random((40_000, 64), chunks=(10_000, 64), dtype=np.float32)
        y = check_balanced_and_pinned(c, x)
        cupy.testing.assert_array_equal(y.sum(axis=1).compute(), x.sum(axis=1).compute())


def dask_octopus_profiles(c):
    import dask_octopus

    return dask_octopus.profiles(c)


@pytest.fixture
def cuda_one():
    from dask_cuda import LocalCUDACluster
    from distributed import Client

    import dask_octopus

    with LocalCUDACluster(CUDA_VISIBLE_DEVICES="0", dashboard_address=":0") as cluster, Client(cluster) as c:
        c.wait_for_workers(1)
        dask_octopus.register(c, calibrate=False)
        yield c


def add_sqrt(a, b):
    import cupy

    return cupy.sqrt(a * a + b) + 1


def test_groups_never_read_a_block_before_its_slow_producer_finished(cuda_one):
    """Producers run unannotated on the worker's default stream and return at launch (20 GEMMs, no
    sync); the grouped consumers run on other streams: they must wait for the producers every time."""
    import cupy
    import dask.array as da

    import dask_octopus
    from dask_octopus.bench.workloads import gemm_repeat

    rng = da.random.default_rng(cupy.random.default_rng(3))
    x = cuda_one.persist(rng.random((8 * 2048, 2048), chunks=(2048, 2048), dtype=np.float32))
    for run in range(5):
        p = x.map_blocks(gemm_repeat, 20, False, name=f"producer-{run}")
        ref = da.map_blocks(add_sqrt, p, p, name=f"ref-{run}").sum(axis=0)
        expected = cuda_one.compute(ref).result()
        p2 = x.map_blocks(gemm_repeat, 20, False, name=f"producer2-{run}")
        with dask_octopus.annotate(resource="memory", group=8):
            y = da.map_blocks(add_sqrt, p2, p2, name=f"grouped-{run}")
        got = cuda_one.compute(y.sum(axis=0)).result()
        cupy.testing.assert_array_equal(got, expected)


def test_grouped_results_exact_with_memory_reused_across_many_groups(cuda_one):
    import cupy
    import dask
    import dask.array as da

    import dask_octopus

    rng = da.random.default_rng(cupy.random.default_rng(4))
    x = cuda_one.persist(rng.random((64 * 512, 512), chunks=(512, 512), dtype=np.float32))
    expected = cuda_one.compute(da.map_blocks(add_sqrt, x, x, name="ref-mem").sum(axis=0)).result()
    # eager runs only: replays would draw from a graph's private pool, not from the streams' reuse
    cuda_one.run(lambda: dask.config.set({"octopus.streams.capture": False}))
    for run in range(20):  # temporaries freed on the group streams are reused by the next groups
        with dask_octopus.annotate(resource="auto", group=8):
            y = da.map_blocks(add_sqrt, x, x, name=f"mem-{run}")
        cupy.testing.assert_array_equal(cuda_one.compute(y.sum(axis=0)).result(), expected)
    (s,) = cuda_one.run(capture_stats).values()
    assert s["graphs"] == 0 and s["replays"] == 0  # every group ran eagerly on the streams


def test_repeated_frames_are_captured_replayed_and_exact(cuda_one):
    import dask
    from distributed import wait

    import dask_octopus
    from dask_octopus.bench.workloads import frame_pipeline, frame_specs, make_frame, stack_to_host

    specs = frame_specs(0.25)[::4]
    frames = [cuda_one.submit(make_frame, *s, gpu=True, pure=False) for s in specs]
    wait(frames)
    expected = np.stack([frame_pipeline(make_frame(*s, gpu=True)).get() for s in specs])
    for _ in range(4):
        with dask_octopus.annotate(resource="memory", group=8):
            hists = [dask.delayed(frame_pipeline, pure=False)(f) for f in frames]
        np.testing.assert_array_equal(cuda_one.compute(dask.delayed(stack_to_host)(hists)).result(), expected)
    stats = cuda_one.run(capture_stats)
    print("capture stats", stats)
    (s,) = stats.values()
    assert s["graphs"] >= 1 and s["replays"] > s["graphs"]  # captured once, then replayed from the cache


def test_groups_that_refuse_capture_run_eagerly_and_exact(cuda_one):
    import cupy
    import dask.array as da

    import dask_octopus
    from dask_octopus.bench.workloads import square

    rng = da.random.default_rng(cupy.random.default_rng(5))
    x = cuda_one.persist(rng.random((8 * 256, 256), chunks=(256, 256), dtype=np.float32))
    expected = cuda_one.compute(x.map_blocks(square, name="sq-ref").sum(axis=0)).result()
    for run in range(3):  # cuBLAS refuses capture: the group stays eager
        with dask_octopus.annotate(resource="compute", group=8):
            y = x.map_blocks(square, name=f"sq-{run}")
        cupy.testing.assert_array_equal(cuda_one.compute(y.sum(axis=0)).result(), expected)
    (s,) = cuda_one.run(capture_stats).values()
    assert s["refused"] >= 1


def allocate_too_much(block):
    import cupy

    return cupy.empty(2**38, dtype=cupy.uint8)  # 256 GiB: more than any one GPU here


def test_real_out_of_memory_on_a_gpu_names_worker_block_and_remedy(worker_pair):
    import cupy
    import dask.array as da

    import dask_octopus

    dask_octopus.register(worker_pair)
    rng = da.random.default_rng(cupy.random.default_rng(6))
    x = dask_octopus.balance(rng.random((40_000, 256), chunks=(10_000, 256), dtype=np.float32))
    with pytest.raises(Exception) as info:
        worker_pair.compute(x.map_blocks(allocate_too_much, dtype=np.uint8).sum()).result()
    text = str(info.value) + "\n".join(getattr(info.value, "__notes__", []))
    print(type(info.value), text)
    assert "OutOfMemory" in type(info.value).__name__ or "out of memory" in text.lower()
    assert "dask_octopus: worker tcp://" in text and "MiB" in text and "per_worker" in text
    assert worker_pair.compute(x.sum()).result() > 0  # the cluster keeps working


def slow_copy(block, delay):
    import time

    time.sleep(delay)
    return block.copy()


def test_killed_cuda_worker_mid_compute_with_balance_groups_and_map(worker_pair):
    """A dask-cuda worker process dies mid-compute (its nanny restarts it): results complete and exact."""
    killed_worker_mid_compute(worker_pair)


def killed_worker_mid_compute(client):
    """Kill a worker process during a balanced, grouped compute, then ``map`` on the restarted cluster:
    both exact."""
    import os

    import cupy
    import dask.array as da

    import dask_octopus
    from dask_octopus.bench.workloads import square

    dask_octopus.register(client)
    rng = da.random.default_rng(cupy.random.default_rng(7))
    x = da.floor(rng.random((16 * 4096, 256), chunks=(4096, 256), dtype=np.float32) * 100)  # sums are exact
    expected = client.compute(x.sum(axis=1)).result()
    y = dask_octopus.balance(x, per_worker=8)
    with dask_octopus.annotate(group=4):
        z = y.map_blocks(slow_copy, 0.2, dtype=y.dtype)
    fut = client.compute(z.sum(axis=1))
    time.sleep(1.0)
    assert not fut.done()
    victim = sorted(workers_info(client))[0]
    with contextlib.suppress(Exception):  # the worker dies before it can answer
        client.run(os._exit, 1, workers=[victim])
    cupy.testing.assert_array_equal(fut.result(timeout=120), expected)
    items = [cupy.full((256, 256), float(i), dtype=cupy.float32) for i in range(12)]
    got = client.gather(dask_octopus.map(square, items, group=4))
    assert all(cupy.array_equal(g, square(i)) for g, i in zip(got, items))


def stream_of(block):
    """The block unchanged, and the CUDA stream this member was launched on."""
    import cupy

    return block + 0, cupy.cuda.get_current_stream().ptr


def made_on_stream(i):
    """A block made from a number (no device input: the fragment cannot size its memory), and the CUDA
    stream this member was launched on."""
    import cupy

    return cupy.full((256, 256), float(i)), cupy.cuda.get_current_stream().ptr


def test_a_fragment_spreads_its_members_over_streams_only_where_memory_allows(cuda_one):
    """Eagerly, independent members reading device blocks stay on one stream of the pool (one arena per
    stream would hold a block per stream more); members whose inputs are not device arrays spread."""
    import cupy
    import dask

    import dask_octopus

    blocks = [cuda_one.submit(cupy.full, (256, 256), float(i), pure=False) for i in range(16)]
    with dask_octopus.annotate(resource="memory", group=8):
        ran = [dask.delayed(stream_of, pure=False)(b) for b in blocks]
    got = cuda_one.compute(dask.delayed(list)(ran)).result()
    assert [float(a[0, 0]) for a, _ in got] == [float(i) for i in range(16)]
    per_fragment = [{ptr for _, ptr in got[:8]}, {ptr for _, ptr in got[8:]}]
    assert all(len(s) == 1 for s in per_fragment) and 0 not in per_fragment[0] | per_fragment[1]
    with dask_octopus.annotate(resource="memory", group=8):
        made = [dask.delayed(made_on_stream, pure=False)(i) for i in range(16)]
    got = cuda_one.compute(dask.delayed(list)(made)).result()
    streams = {ptr for _, ptr in got}
    assert [float(a[0, 0]) for a, _ in got] == [float(i) for i in range(16)]
    assert len(streams) >= 4 and 0 not in streams  # the pool's streams, not the legacy default stream


def scaled_sum(block):
    """Two block-sized intermediates, then a row of sums."""
    return ((block * 2.0 + 1.0) * block).sum(axis=0)


def through_fragments(client, blocks):
    """Each block's row of sums, computed as annotated tasks (one fragment of the 16)."""
    import cupy
    import dask

    import dask_octopus

    with dask_octopus.annotate(resource="memory", group=16):
        sums = [dask.delayed(scaled_sum, pure=False)(b) for b in blocks]
    return client.compute(dask.delayed(cupy.stack)(sums)).result()


def through_map(client, blocks):
    """Each block's row of sums, computed by ``map`` (one batch of the 16)."""
    import dask

    import dask_octopus

    with dask.config.set({"octopus.map.steal-fraction": 0}):  # one batch (no stealable tail)
        return dask_octopus.map(scaled_sum, blocks, client=client, group=16, resource="memory", gather=True)


@pytest.mark.parametrize("through", [through_fragments, through_map], ids=["fragment", "map"])
def test_a_captured_graph_holds_no_more_than_one_stream_would_plus_a_block(cuda_one, through):
    """16 independent members reading 16 device blocks (a fragment, or a batch of ``map``), run eagerly,
    captured (on one stream and over 8), replayed. Over 8 streams the graph keeps about three blocks of
    intermediates per stream: with 32 MB blocks that is more than octopus.streams.capture-spare-bytes
    (32 MiB) beyond the one-stream graph, which is kept; with 128 kB blocks it is not, and the graph
    forked over the streams is kept."""
    import cupy

    held = 0
    for side in (2048, 128):
        blocks = [cuda_one.submit(cupy.full, (side, side), float(i), pure=False) for i in range(16)]
        block_bytes = side * side * 8
        for _ in range(3):  # eager, captured, replayed
            got = through(cuda_one, blocks)
            assert [float(r[0]) for r in got] == [float(((2 * i + 1) * i) * side) for i in range(16)]
        (st,) = cuda_one.run(capture_stats).values()
        graph_bytes, held = st["graph_bytes"] - held, st["graph_bytes"]
        print(f"blocks of {block_bytes} bytes: the captured graph holds {graph_bytes} bytes")
        if side == 2048:
            assert 0 < graph_bytes <= 4 * block_bytes
        else:
            assert 4 * block_bytes < graph_bytes <= 4 * block_bytes + 32 * 2**20
    assert (st["graphs"], st["refused"]) == (2, 0) and st["replays"] >= 2
    assert st["graphs_on_streams"] == 1  # the 128 kB blocks' graph forks over the streams, the other does not


def fft_magnitude(block):
    import cupy

    return cupy.abs(cupy.fft.fft(block, axis=1)).astype(cupy.float32) + 1


def other_ffts(n):
    """FFTs of ``n`` other shapes on this worker thread (CuPy's plan cache keeps 16 plans), then the memory
    their plans held filled with other data."""
    import cupy

    for k in range(n):
        cupy.fft.fft(cupy.ones((3, 100 + k), cupy.complex64), axis=1)
    filler = [cupy.full((1 << 20,), -7.0, cupy.float32) for _ in range(64)]
    cupy.cuda.Device().synchronize()
    return len(filler)


def test_fragments_that_run_ffts_stay_eager_and_exact_after_their_plans_leave_the_cache(cuda_one):
    """A graph that captured an FFT reads its cuFFT plan, which CuPy's plan cache frees once 16 other
    plans came: the next replay crashed the worker (an illegal memory access). Such fragments refuse
    capture and stay eager."""
    import cupy
    import dask.array as da

    import dask_octopus

    x = cuda_one.persist(da.from_array(cupy.arange(8 * 64 * 256, dtype=cupy.float32).reshape(8 * 64, 256) % 7,
                                       chunks=(64, 256)))
    expected = cuda_one.compute(x.map_blocks(fft_magnitude, name="fft-ref").sum(axis=0)).result()
    for run in range(6):
        if run == 3:
            assert cuda_one.submit(other_ffts, 40, pure=False).result() == 64
        with dask_octopus.annotate():
            got = cuda_one.compute(x.map_blocks(fft_magnitude, name=f"fft-{run}").sum(axis=0)).result()
        cupy.testing.assert_allclose(got, expected, rtol=1e-5)
    (st,) = cuda_one.run(capture_stats).values()
    assert st["refused"] >= 1 and st["graphs"] == 0 and "cuFFT" in st["last_refusal"], st


def fresh_stream_runtime(max_graph_bytes, dask_worker=None):
    """A new stream runtime on the worker (no graphs), reading ``octopus.streams.max-graph-bytes`` as given."""
    import dask

    from dask_octopus.groups import streams

    dask.config.set({"octopus.streams.max-graph-bytes": max_graph_bytes})
    dask_worker.extensions[streams.EXTENSION] = streams.StreamRuntime()


def test_graphs_beyond_max_graph_bytes_are_dropped_and_larger_ones_run_eagerly(cuda_one):
    """The fragments of three persisted arrays of different shapes, each captured reading its blocks in
    place: with room for two and a half of their graphs a worker thread keeps no more than that; with
    room for half of one, none (each is replayed once, then its shapes run eagerly). Every compute is
    exact."""
    import cupy
    import dask.array as da

    import dask_octopus

    widths = [512, 640, 768]
    xs = [cuda_one.persist(da.from_array(cupy.full((8 * 512, w), float(i + 1), cupy.float32), chunks=(512, w)))
          for i, w in enumerate(widths)]

    def computes():
        for _ in range(3):  # eager, captured, replayed
            for i, x in enumerate(xs):
                with dask_octopus.annotate():
                    got = cuda_one.compute((x * 2 + 1).sum(axis=0)).result()
                cupy.testing.assert_array_equal(got, cupy.full(widths[i], (2 * (i + 1) + 1) * 8 * 512, cupy.float32))
        (st,) = cuda_one.run(capture_stats).values()
        return st

    st = computes()  # the default: room for all three
    assert st["graphs"] == 3 and st["graphs_in_place"] == 3, st
    one = st["graph_bytes"] / 3
    print(f"each graph holds {one:.0f} bytes")
    cuda_one.run(fresh_stream_runtime, int(2.5 * one))
    st = computes()
    assert 1 <= st["graphs"] < 3 and st["graph_bytes"] <= 2.5 * one and st["refused"] == 0, st
    cuda_one.run(fresh_stream_runtime, int(0.5 * one))
    st = computes()
    assert st["graphs"] == 0 and st["refused"] >= 1, st


def scaled_pair(block, k):
    """Two CuPy results of one item, one of them not contiguous."""
    return {"scaled": block * k, "transposed": (block + k).T}


@pytest.mark.parametrize("group", [None, 4])
def test_map_to_host_returns_numpy_copies_of_cupy_results(cuda_one, group):
    import cupy

    import dask_octopus

    items = [cuda_one.submit(cupy.full, (64, 32), float(i), dtype=cupy.float32, pure=False) for i in range(10)]
    got = dask_octopus.map(scaled_pair, items, group=group, gather=True, to_host=True, k=3.0)
    for i, r in enumerate(got):
        assert isinstance(r["scaled"], np.ndarray) and isinstance(r["transposed"], np.ndarray)
        np.testing.assert_array_equal(r["scaled"], np.full((64, 32), 3.0 * i, dtype=np.float32))
        np.testing.assert_array_equal(r["transposed"], np.full((32, 64), i + 3.0, dtype=np.float32))
    pairs = dict(dask_octopus.imap(scaled_pair, items, group=group, to_host=True, k=2.0))
    assert sorted(pairs) == list(range(10)) and all(isinstance(r["scaled"], np.ndarray) for r in pairs.values())


def doubled_sum(block):
    return (block * 2 + 1).sum()


def test_map_batches_replay_reading_persisted_items_in_place(cuda_one):
    """The same persisted CuPy items mapped again and again: the worker's batch is captured reading
    the items where they are (no copies of them in the graph) and replayed, exact; other items of the
    same shapes are never read from the first ones' buffers."""
    import cupy
    import dask

    import dask_octopus

    def items(offset):
        return [cuda_one.submit(cupy.full, (256, 256), float(i + offset), dtype=cupy.float32, pure=False)
                for i in range(8)]

    sets = {"first": items(0), "second": items(100)}
    for name in ("first", "first", "first", "second", "second", "second", "first"):
        with dask.config.set({"octopus.map.steal-fraction": 0}):  # one batch of the 8 (no stealable tail)
            got = dask_octopus.map(doubled_sum, sets[name], group=8, resource="memory", gather=True, to_host=True)
        offset = 0 if name == "first" else 100
        assert all(isinstance(r, np.ndarray) and r.shape == () for r in got)  # 0-d, as the function returns
        assert [float(r) for r in got] == [(2.0 * (i + offset) + 1) * 256 * 256 for i in range(8)], name
    (s,) = cuda_one.run(capture_stats).values()
    print("capture stats", s)
    # first: eager, captured in place, replayed; second: captured with copies of its inputs (the shapes
    # were seen before, not these buffers), replayed twice; first again: its in-place graph
    assert (s["graphs"], s["graphs_in_place"], s["replays"], s["refused"]) == (2, 1, 6, 0)


def grouped_exact(client):
    """A balanced CuPy array's blocks in stream groups of 4 (each group on its block's GPU): the same
    values as without groups."""
    import cupy
    import dask.array as da

    import dask_octopus

    rng = da.random.default_rng(cupy.random.default_rng(8))
    x = dask_octopus.balance(rng.random((16 * 1024, 512), chunks=(1024, 512), dtype=np.float32), per_worker=4)
    expected = client.compute(da.map_blocks(add_sqrt, x, x, name="ref-groups").sum(axis=0)).result()
    with dask_octopus.annotate(resource="auto", group=4):
        y = da.map_blocks(add_sqrt, x, x, name="grouped-ucx")
    cupy.testing.assert_array_equal(client.compute(y.sum(axis=0)).result(), expected)


def balanced_fragments_exact_and_placed(client):
    """A balanced CuPy array through an annotated chain, then a sum across the workers: each worker
    runs its blocks and their partial sums as one fragment, where they are; the aggregate reads both
    workers' fragments; the values are those of the unannotated compute."""
    from collections import Counter

    import cupy
    import dask.array as da
    from dask.utils import key_split
    from distributed import get_task_stream, wait

    import dask_octopus
    from dask_octopus.groups.rewrite import FRAGMENT_PREFIX

    rng = da.random.default_rng(cupy.random.default_rng(9))
    x = client.persist(dask_octopus.balance(rng.random((16 * 1024, 512), chunks=(1024, 512), dtype=np.float32),
                                            per_worker=4))
    wait(x)
    holders = Counter(w for (w,) in client.who_has(x).values())
    assert len(holders) == 2, holders  # the balanced blocks live on both workers
    expected = client.compute(da.map_blocks(add_sqrt, x, x, name="ref-fragments").sum(axis=0)).result()
    with dask_octopus.annotate(resource="auto"):
        y = da.map_blocks(add_sqrt, x, x, name="fragments-pair")
    with get_task_stream(client) as ts:
        got = client.compute(y.sum(axis=0)).result()
    cupy.testing.assert_array_equal(got, expected)
    ran = [(key_split(t["key"]), t["worker"]) for t in ts.data]
    # one fragment per worker (one thread each), on the worker holding its blocks: it fetched none
    assert Counter(w for name, w in ran if FRAGMENT_PREFIX in name) == Counter(holders.keys()), ran
    fetched = [t["key"] for t in ts.data if FRAGMENT_PREFIX in str(t["key"])
               and any(s["action"] == "transfer" for s in t["startstops"])]
    assert not fetched, fetched
    others = [name for name, _ in ran if FRAGMENT_PREFIX not in name]
    assert others and "fragments-pair" not in others, ran  # the aggregate (fused with Dask's finalize), no block


def test_balanced_fragments_run_where_their_blocks_are_and_aggregate_exactly(worker_pair):
    import dask_octopus

    dask_octopus.register(worker_pair)
    balanced_fragments_exact_and_placed(worker_pair)


def test_ucx_cluster_registers_balances_maps_and_groups_exactly(ucx_pair):
    import cupy

    import dask_octopus
    from dask_octopus.placement.transfers import bandwidths

    dask_octopus.register(ucx_pair)
    profiles = dask_octopus.profiles(ucx_pair)
    assert len(profiles) == 2 and all(p["device"] == "gpu" and p["error"] is None for p in profiles.values())
    balance_exact_and_pinned(ucx_pair)
    map_exact_and_placed(ucx_pair)
    grouped_exact(ucx_pair)
    balanced_fragments_exact_and_placed(ucx_pair)
    # the transfer model reads what UCX moved: a 64 MiB block from one worker to the other is timed by the
    # receiving worker, and the scheduler keeps the pair's figure from the next heartbeat on
    sender, receiver = sorted(profiles)
    block = ucx_pair.submit(cupy.ones, 2**24, dtype=cupy.float32, workers=[sender], pure=False)
    assert ucx_pair.submit(cupy.sum, block, workers=[receiver], pure=False).result() == 2**24
    deadline = time.monotonic() + 20
    while (sender, receiver) not in bandwidths(ucx_pair).pairs:
        assert time.monotonic() < deadline, "no bandwidth measured between the workers"
        time.sleep(0.25)
    links = bandwidths(ucx_pair)
    print("bandwidths (B/s): default", links.default, "pairs", links.pairs)
    assert links.between(sender, receiver) > 0


def test_ucx_cli_cluster_with_preload(tmp_path):
    """``dask scheduler --protocol ucx --preload dask_octopus`` and ``dask cuda worker --protocol ucx
    --preload dask_octopus``: calibrated on arrival, then balance, map and groups, all exact."""
    pytest.importorskip("distributed_ucxx", reason="protocol ucx needs distributed-ucxx")
    import cupy
    import dask.array as da
    from test_deployment import check_balanced_and_pinned, cli_cluster

    worker = ["cuda", "worker", "--protocol", "ucx", "--host", "127.0.0.1"]
    with cli_cluster(tmp_path, worker, n_workers=2, worker_processes=cuda_worker_processes(),
                     scheduler_args=["--protocol", "ucx"], worker_env=cuda_worker_env()) as c:
        assert c.scheduler.address.startswith("ucx://")
        assert all(p["device"] == "gpu" for p in dask_octopus_profiles(c).values())
        rng = da.random.default_rng(cupy.random.default_rng(1))
        x = rng.random((40_000, 64), chunks=(10_000, 64), dtype=np.float32)
        y = check_balanced_and_pinned(c, x)
        cupy.testing.assert_array_equal(y.sum(axis=1).compute(), x.sum(axis=1).compute())
        map_exact_and_placed(c)
        grouped_exact(c)


def test_killed_cuda_worker_mid_compute_over_ucx(ucx_pair):
    """The kill test of a TCP cluster, over UCX: a worker process dies mid-compute; results exact."""
    killed_worker_mid_compute(ucx_pair)


def fail_on_block_3(b, block_info=None):
    if block_info and block_info[0]["chunk-location"][0] == 3:
        raise ValueError("block 3 is broken")
    return b + 1


def fragment_tasks(client, compute):
    """What ``compute()`` returns, and how many fragment tasks ran for it (Dask's task stream)."""
    from distributed import get_task_stream

    from dask_octopus.groups.rewrite import FRAGMENT_PREFIX

    with get_task_stream(client) as ts:
        out = compute()
    return out, sum(FRAGMENT_PREFIX in str(t["key"]) for t in ts.data)


def test_fragments_exact_eager_then_replayed_reading_persisted_blocks_in_place(cuda_one):
    """The chain-and-sum shape: one fragment per thread, exact against Dask; seen again, captured as one
    multi-stream graph that reads the persisted blocks where they are, then replayed."""
    import cupy
    import dask.array as da

    import dask_octopus
    from dask_octopus.bench.small_tasks import chain_sum

    rng = da.random.default_rng(cupy.random.default_rng(11))
    x = cuda_one.persist(rng.random((64 * 256, 384), chunks=(256, 384), dtype=np.float32))
    expected = cuda_one.compute(chain_sum(x, "chain-ref")).result()
    for run in range(4):
        with dask_octopus.annotate():
            got, n = fragment_tasks(cuda_one, lambda run=run: cuda_one.compute(chain_sum(x, f"chain-{run}")).result())
        assert n == 1  # one worker, one thread
        cupy.testing.assert_allclose(got, expected, rtol=1e-6)
    (s,) = cuda_one.run(capture_stats).values()
    print("capture stats", s)
    assert s["graphs_in_place"] >= 1 and s["replays"] >= 2 and s["refused"] == 0


def test_new_data_of_one_shape_reuses_its_plan_renamed_and_replays_exactly(cuda_one, monkeypatch):
    """A loop over new data (a new persisted array each compute: other values, other keys, the last one
    freed): from the third compute on the plan is reused renamed and the fragment's graph replayed on
    each compute's own blocks; the values of unannotated Dask every time."""
    import cupy
    import dask.array as da

    import dask_octopus
    from dask_octopus.bench.small_tasks import chain_sum
    from dask_octopus.groups import rewrite

    planned = []
    real = rewrite._fragment_graph  # (the scheduler plans in this process)
    monkeypatch.setattr(rewrite, "_fragment_graph", lambda *args: planned.append(1) or real(*args))
    (before,) = cuda_one.run(capture_stats).values()
    for run in range(6):
        rng = da.random.default_rng(cupy.random.default_rng(40 + run))
        x = cuda_one.persist(rng.random((16 * 256, 384), chunks=(256, 384), dtype=np.float32))
        expected = cuda_one.compute(chain_sum(x, f"reference-{run}")).result()
        with dask_octopus.annotate():
            got, n = fragment_tasks(cuda_one, lambda x=x, run=run: cuda_one.compute(
                chain_sum(x, f"chain-{run}")).result())
        assert n == 1
        cupy.testing.assert_allclose(got, expected, rtol=1e-6)
        del x  # (its blocks freed: the next data may lie where they lay)
    assert len(planned) == 2  # planned at the first two computes, reused renamed by the other four
    (s,) = cuda_one.run(capture_stats).values()
    print("capture stats", before, s)
    assert s["replays"] - before["replays"] >= 3 and s["refused"] == 0


def test_fragments_on_a_worker_of_two_threads_hand_their_results_over_exactly():
    """Two threads: each thread's fragments make block results that tasks on the other thread read
    (GEMMs launched on the task's stream, returned at launch) while this thread's next fragments run."""
    import cupy
    import dask.array as da
    from dask_cuda import LocalCUDACluster
    from distributed import Client

    import dask_octopus
    from dask_octopus.bench.workloads import elementwise_chain, gemm_repeat

    with LocalCUDACluster(CUDA_VISIBLE_DEVICES="0", threads_per_worker=2, dashboard_address=":0") as cluster, \
            Client(cluster) as c:
        dask_octopus.register(c, calibrate=False)
        rng = da.random.default_rng(cupy.random.default_rng(12))
        x = c.persist(rng.random((32 * 512, 512), chunks=(512, 512), dtype=np.float32))
        chained = x.map_blocks(elementwise_chain, name="two-threads-ref")
        expected = c.compute(chained.map_blocks(gemm_repeat, 5, False).sum(axis=0)).result()
        for run in range(6):  # eager, then replayed
            with dask_octopus.annotate():
                y = x.map_blocks(elementwise_chain, name=f"two-threads-{run}")
            got = c.compute(y.map_blocks(gemm_repeat, 5, False, name=f"read-{run}").sum(axis=0)).result()
            cupy.testing.assert_allclose(got, expected, rtol=1e-5)


def scale_by(b, w):
    return b * w + 1


def churn(dask_worker):
    """Take device memory of the sizes a constant and a block of the test below have, and fill it (held
    until the next call): a freed buffer of that size then holds -7s."""
    import cupy

    sizes = [384] * 32 + [256 * 384] * 32
    dask_worker.octopus_test_junk = [cupy.full(n, -7.0, dtype=cupy.float32) for n in sizes]
    cupy.cuda.get_current_stream().synchronize()


def test_a_replayed_fragment_reads_the_constants_it_was_captured_with(cuda_one):
    """A CuPy constant of the steps (a map_blocks argument, inside the fragment's specs) is read at its
    address of the capture by every replay: it lives as long as the graph, whatever takes memory between."""
    import cupy
    import dask.array as da

    import dask_octopus

    rng = da.random.default_rng(cupy.random.default_rng(12))
    x = cuda_one.persist(rng.random((16 * 256, 384), chunks=(256, 384), dtype=np.float32))
    w = cupy.linspace(0.5, 1.5, 384, dtype=cupy.float32)
    expected = cuda_one.compute(x.map_blocks(scale_by, w, name="scaled-ref").sum(axis=0)).result()
    for run in range(5):
        cuda_one.run(churn)
        with dask_octopus.annotate():
            got = cuda_one.compute(x.map_blocks(scale_by, w, name=f"scaled-{run}").sum(axis=0)).result()
        cupy.testing.assert_allclose(got, expected, rtol=1e-5)
    (s,) = cuda_one.run(capture_stats).values()
    print("capture stats", s)
    assert s["graphs"] >= 1 and s["replays"] >= 2


def test_a_failing_fragment_member_on_a_gpu_fails_only_its_own_outputs(cuda_one):
    import cupy
    import dask.array as da
    from distributed import futures_of, wait

    import dask_octopus

    x = cuda_one.persist(da.from_array(cupy.arange(64 * 6, dtype=cupy.float64).reshape(64, 6), chunks=(4, 6)))
    with dask_octopus.annotate():
        y = x.map_blocks(fail_on_block_3)
    futures = futures_of(cuda_one.persist(y.rechunk((8, 6))))  # block i joins blocks 2i and 2i + 1 of y
    wait(futures)
    expected = cupy.arange(64 * 6, dtype=cupy.float64).reshape(64, 6) + 1
    for f in futures:
        i = f.key[1]
        if i == 1:  # reads block 3 of y
            error = f.exception()
            assert isinstance(error, ValueError) and "block 3 is broken" in str(error)
            assert any("raised by task" in n and ", 3, 0)" in n for n in getattr(error, "__notes__", []))
        else:
            cupy.testing.assert_array_equal(f.result(), expected[8 * i:8 * i + 8])


def test_the_memory_budget_cuts_gpu_fragments_and_they_stay_exact(cuda_one):
    import cupy
    import dask
    import dask.array as da

    import dask_octopus
    from dask_octopus.bench.small_tasks import chain_sum

    rng = da.random.default_rng(cupy.random.default_rng(12))
    x = cuda_one.persist(rng.random((64 * 256, 384), chunks=(256, 384), dtype=np.float32))
    expected = cuda_one.compute(chain_sum(x, "budget-ref")).result()
    block = 256 * 384 * 4
    counts = []
    for run, budget in enumerate(("auto", 16 * block)):  # 64 blocks: their inputs alone do not fit
        with dask.config.set({"octopus.fragments.max-bytes": budget}), dask_octopus.annotate():
            got, n = fragment_tasks(cuda_one, lambda run=run: cuda_one.compute(chain_sum(x, f"budget-{run}")).result())
        cupy.testing.assert_allclose(got, expected, rtol=1e-6)
        counts.append(n)
    assert counts[0] == 1 and counts[1] > 1, counts


def test_random_cupy_blocks_made_inside_annotate_are_sized_before_they_exist(cuda_one):
    """CuPy blocks a fragment makes from nothing it reads count their chunks' bytes when fragments are
    cut: a budget of a quarter of them cuts the work into several fragments, exact."""
    import cupy
    import dask
    import dask.array as da

    import dask_octopus

    block = 256 * 384 * 4
    counts = []
    for run, budget in enumerate(("auto", 16 * block)):  # 64 random blocks, made by the fragments
        rng = da.random.default_rng(cupy.random.default_rng(20 + run))  # new keys each run
        with dask_octopus.annotate():
            x = rng.random((64 * 256, 384), chunks=(256, 384), dtype=np.float32)
            y = (x / x.max()).sum()
        expected = float(y.compute(scheduler="sync"))
        with dask.config.set({"octopus.fragments.max-bytes": budget}):
            got, n = fragment_tasks(cuda_one, lambda y=y: cuda_one.compute(y).result())
        assert float(got) == pytest.approx(expected, rel=1e-5)
        counts.append(n)
    assert counts[1] > counts[0], counts


def inflate_on_gpu(block):
    """Six block-sized temporaries on the device: a working set of about eight blocks."""
    import cupy

    return block + cupy.ones((6, *block.shape), dtype=block.dtype).sum(axis=0)


def test_balance_learns_a_cupy_working_set_and_sizes_the_next_blocks_by_it():
    import cupy
    import dask
    import dask.array as da
    from dask.utils import key_split
    from dask_cuda import LocalCUDACluster
    from distributed import Client

    import dask_octopus

    fraction = 0.02  # of an H200's ~140 GB free: 2.8 GB, which holds the array but not 8 x a 512 MiB block
    with dask.config.set({"octopus.balance.memory-fraction": fraction}), \
            LocalCUDACluster(CUDA_VISIBLE_DEVICES="0", dashboard_address=":0") as cluster, Client(cluster) as c:
        dask_octopus.register(c)
        free = next(iter(dask_octopus.profiles(c).values()))["memory_free"]
        rng = da.random.default_rng(cupy.random.default_rng(5))
        x = rng.random(2**28, chunks=2**27, dtype=np.float32).persist()  # two blocks of 512 MiB
        expected = float(x.sum().compute()) + 6 * x.size
        first = dask_octopus.balance(x)
        assert float(first.map_blocks(inflate_on_gpu).sum().compute()) == pytest.approx(expected, rel=1e-5)

        source = key_split(x.name)

        def ratio(dask_scheduler, source=source):
            return dask_scheduler.plugins["octopus"].working_sets.ratio(source)

        deadline = time.monotonic() + 30
        while (r := c.run_on_scheduler(ratio)) is None:
            assert time.monotonic() < deadline, "no working set reached the scheduler"
            time.sleep(0.05)
        print("learned working set per byte of block", r, "chunks", first.chunks, "free", free)
        assert 4 < r < 12  # the block, six temporaries and the result, counted from CuPy's allocations
        second = dask_octopus.balance(x)
        print("next plan", second.chunks)
        assert all(n * 4 * r <= free * fraction for n in second.chunks[0])
        assert len(second.chunks[0]) > len(first.chunks[0])
        assert float(second.map_blocks(inflate_on_gpu).sum().compute()) == pytest.approx(expected, rel=1e-5)


def test_random_cupy_array_programs_are_exact_eager_and_replayed(cuda_one):
    """Random array programs (the CPU property test's operations) on persisted CuPy integer blocks,
    computed inside ``annotate`` three times: eager, then captured and replayed as CUDA graphs; each
    time the NumPy reference's values (integers exactly; means to 1e-12)."""
    import cupy
    import dask.array as da
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from test_fragment_properties import OPS, apply

    import dask_octopus

    @given(st.integers(2, 12), st.integers(1, 5), st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 9)),
                                                           min_size=1, max_size=6))
    @settings(max_examples=25, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    def check(side, chunk, ops):
        data = np.arange(side * side, dtype=np.int64).reshape(side, side)

        def program(x):
            for op, c in ops:
                x = apply(x, op, c)
            return x

        x = cuda_one.persist(da.from_array(cupy.asarray(data), chunks=chunk))
        expected = program(da.from_array(data, chunks=chunk)).compute(scheduler="sync")
        for _ in range(3):
            with dask_octopus.annotate():
                got = cupy.asnumpy(cuda_one.compute(program(x)).result())
            if np.issubdtype(expected.dtype, np.integer):
                np.testing.assert_array_equal(got, expected)
            else:
                np.testing.assert_allclose(got, expected, rtol=1e-12)

    check()
    (s,) = cuda_one.run(capture_stats).values()
    print("capture stats", s)
    assert s["replays"] >= 1  # (the fragments of most programs are captured at their second compute)
