# The device call (from the repository root): GPU tests, then the cold interleaved-blocks variants.
set -u
out=${1:?usage: run.sh OUTDIR}
mkdir -p "$out" .whl-ucx && tar xJf ucx-wheels.tar.xz -C .whl-ucx
w=(.whl/*.whl); for x in .whl-ucx/*.whl; do [[ -e .whl/${x##*/} ]] || w+=("$x"); done
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "${w[@]}" || exit 1
here=benchmarks/results/2026-12-06-h200/618c4a2-gpu-tests-interleaved-blocks-plan-memo
export PYTHONPATH=$PWD:/tmp/site:$PWD/benchmarks/results/2026-12-06-cpu/7585f54-interleaved-blocks-cold:$PWD/benchmarks/results/2026-12-05-cpu/13d6ca6-interleaved-blocks PYTHONUNBUFFERED=1
sha1sum dask_octopus/*.py dask_octopus/*/*.py tests/test_gpu.py $here/*.py > "$out/hashes.txt"
{ date -u; nvidia-smi; python3 -c 'import sys, cupy, dask, distributed, dask_cuda, distributed_ucxx; print(sys.version); print("cupy", cupy.__version__, "dask", dask.__version__, "distributed", distributed.__version__, "dask_cuda", dask_cuda.__version__, "distributed_ucxx", distributed_ucxx.__version__)'; } > "$out/env.txt" 2>&1
t0=$SECONDS
timeout 270 python3 -m pytest -m gpu -v -s -p no:cacheprovider --timeout 90 tests/test_gpu.py > "$out/gpu-tests.log" 2>&1
echo "gpu tests exit $? after $((SECONDS - t0)) s" | tee "$out/steps.txt"
for args in "2 8 ucx 0,0" "128 1024 ucx 0,0" "128 1024 ucx 0,0,0,0"; do
  echo "# $(date -u +%H:%M:%S) python3 interleaved_blocks_cold_gpu.py $args" >> "$out/output.txt"
  t0=$SECONDS
  timeout 100 python3 $here/interleaved_blocks_cold_gpu.py $args >> "$out/output.txt" 2> "$out/stderr-${args// /_}.txt"
  echo "interleaved $args exit $? after $((SECONDS - t0)) s" | tee -a "$out/steps.txt"
done
tail -c 3000 "$out/gpu-tests.log"; cat "$out/output.txt"
