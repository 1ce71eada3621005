"""An FFT row filter over a large array whose blocks fill a good part of each GPU, with co-tenants on the
first worker: Dask's chunks against ``balance`` (by default no block larger than the user's own) and
``balance(per_worker=1)`` (one block per worker: the fast worker's block outgrows the user's chunks).

Each variant persists the array in its blocks, runs ``warmup_passes`` untimed passes (cuFFT makes its
plans for the variant's block shapes), then times ``passes`` of ``irfft(rfft(x) * lowpass)`` summed by
row; with ``--runs`` above one the variants alternate in balanced orders and each variant's median is
over the passes of all its runs. A variant that runs out of device memory is reported as such (its
error), not timed. Each run's row sums are checked against the first variant's (a checksum taken after
the timing): the script fails, after writing its record, where one differs.

    python benchmarks/fft_filter.py --rows 131072 --cols 32768 --chunk-rows 65536 --cotenant-procs 2 --out DIR
"""

from __future__ import annotations

import os
import statistics
from typing import Any

import click
from distributed import Client, wait

import dask_octopus
from dask_octopus.bench.cotenant import CoTenant
from dask_octopus.bench.experiment import local_cluster, slowest_target
from dask_octopus.bench.options import OutFolder
from dask_octopus.bench.protocol import check_cluster, protocol_of, protocol_option
from dask_octopus.bench.record import header, write_json
from dask_octopus.bench.runner import interleave, settle, timed
from dask_octopus.bench.workloads import checksum, random_matrix, same_checksums
from dask_octopus.cli import console as make_console


def lowpass(block: Any, keep: float = 0.25) -> Any:
    """Zero the upper ``1 - keep`` of each row's spectrum (rfft, mask, irfft), on the block's device."""
    import cupy as cp

    spectrum = cp.fft.rfft(block, axis=1)
    spectrum[:, int(spectrum.shape[1] * keep):] = 0
    return cp.fft.irfft(spectrum, n=block.shape[1], axis=1).astype(block.dtype)


def run_variant(client: Client, variant: str, rows: int, cols: int, chunk_rows: int, passes: int,
                warmup_passes: int) -> dict[str, Any]:
    """Blocks of ``variant``, the seconds of each timed pass and the checksum of the row sums
    (:func:`~dask_octopus.bench.workloads.checksum`), or the error that stopped it."""
    x = random_matrix(rows, cols, chunks=(chunk_rows, cols), gpu=True)
    if variant != "defaults":
        x = dask_octopus.balance(x, client=client, per_worker=1 if variant == "balance-1" else None)
    blocks = [float(b) * cols * 4 / 2**30 for b in x.chunks[0]]
    try:
        x = client.persist(x)
        wait(x)
        seconds = [timed(lambda: client.compute(x.map_blocks(lowpass).sum(axis=1)).result())[0]
                   for _ in range(warmup_passes + passes)][warmup_passes:]
    except Exception as e:  # out of memory on a block too large for its worker: the point of the variant
        return {"block_gib": blocks, "error": f"{type(e).__name__}: {str(e)[:300]}"}
    try:
        values = checksum(client, x.map_blocks(lowpass).sum(axis=1))
        return {"block_gib": blocks, "seconds": seconds, "checksum": values}
    except Exception as e:  # (the timing stands; the comparison fails the script)
        return {"block_gib": blocks, "seconds": seconds, "checksum_error": f"{type(e).__name__}: {str(e)[:300]}"}
    # (the blocks go with x, and settle() waits for that before the next variant: client.cancel(x) would
    # have the scheduler report the keys cancelled, which cancels the next run's futures of the same keys)


def pooled(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One variant's runs as one record: its blocks (the last run's), every run, the seconds of all
    their passes and their median; or the first error, where a run failed."""
    failed = next((r for r in runs if "error" in r), None)
    if failed is not None:
        return {**failed, "runs": runs}
    seconds = [s for r in runs for s in r["seconds"]]
    return {"block_gib": runs[-1]["block_gib"], "runs": runs, "seconds": seconds,
            "median_seconds": statistics.median(seconds)}


@click.command()
@click.option("--rows", type=click.IntRange(min=1), default=131072, show_default=True)
@click.option("--cols", type=click.IntRange(min=1), default=32768, show_default=True)
@click.option("--chunk-rows", type=click.IntRange(min=1), default=65536, show_default=True,
              help="the user's chunks (rows)")
@click.option("--passes", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--warmup-passes", type=click.IntRange(min=0), default=1, show_default=True,
              help="untimed passes after each persist (cuFFT's plans)")
@click.option("--runs", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--devs", default="0,1", show_default=True)
@protocol_option
@click.option("--cotenant-procs", type=click.IntRange(min=1), default=2, show_default=True,
              help="co-tenants on the first worker's GPU")
@click.option("--out", type=OutFolder(), default="benchmark-results", show_default=True)
def main(rows: int, cols: int, chunk_rows: int, passes: int, warmup_passes: int, runs: int, devs: str,
         protocol: str, cotenant_procs: int, out: str) -> None:
    """Time the variants and write fft-filter-gpu.json."""
    check_cluster("gpu", protocol, asked="GPU workers (dask-cuda) only")
    console = make_console()
    variants = ["defaults", "balance", "balance-1"]
    config = {"rows": rows, "cols": cols, "chunk_rows": chunk_rows, "passes": passes,
              "warmup_passes": warmup_passes, "runs": runs, "devs": devs,
              "protocol": protocol, "cotenant_procs": cotenant_procs, "array_gib": rows * cols * 4 / 2**30}
    with local_cluster(True, devs, protocol=protocol) as client:
        record = header(True, protocol_of(client), config=config)
        _, load = slowest_target(client, True)
        with CoTenant(**load, procs=cotenant_procs):
            dask_octopus.register(client)
            record["weights"] = dask_octopus.speeds(client)
            results = interleave({v: (lambda run, v=v: run_variant(client, v, rows, cols, chunk_rows, passes,
                                                                    warmup_passes))
                                  for v in variants}, runs, between=lambda: settle(client))
    record["variants"] = {v: pooled(r) for v, r in results.items()}
    # the reference: the first run with a checksum of the first variant that has one (a variant out of
    # memory has none)
    named, reference = next(((v, run["checksum"]) for v in variants for run in results[v] if "checksum" in run),
                            (None, None))
    record["reference_variant"] = named
    for r in record["variants"].values():  # (float32 FFTs of other batch sizes: equal to rtol 1e-4)
        sums = [run["checksum"] for run in r["runs"] if "checksum" in run]
        unchecked = any("checksum_error" in run for run in r["runs"])
        r["same_values_as_reference"] = (False if unchecked else None if reference is None or not sums
                                         else all(same_checksums(c, reference) for c in sums))
    for v, r in record["variants"].items():
        blocks = ", ".join(f"{b:.2f}" for b in r["block_gib"])
        outcome = f"{r['median_seconds']:.3f} s per pass" if "median_seconds" in r else r["error"][:120]
        console.print(f"{v:>10}: blocks {blocks} GiB; {outcome}")
    console.print(f"weights {record['weights']}; wrote {write_json(os.path.join(out, 'fft-filter-gpu.json'), record)}")
    differ = [v for v, r in record["variants"].items() if r["same_values_as_reference"] is False]
    if differ:  # (after the JSON: it holds each run's checksum, or why it has none)
        raise click.ClickException(f"results differ from {named}'s, or could not be read: {', '.join(differ)}")
    if named is None:
        raise click.ClickException("no variant ran to the end: nothing was compared")


if __name__ == "__main__":
    main()
