#!/usr/bin/env bash
# The whole GPU validation on the GPU machine (2 x H200): GPU tests (UCX ones included), the demo, the
# FFT filter, stream groups on one GPU, the phases of a compute (new keys, and the same keys with and
# without the plan remembered), a long run (device memory), dask-cuda's local_cupy.py with and
# without the plugin, the benchmark suite with and without a co-tenant and the image mixes alone
# (co-tenant on GPU 0, with their ideal), all over $PROTOCOL (default ucx: what dask-cuda users run on
# NVLink), and beside them the operations that move data between GPUs over tcp (suite-tcp). Everything
# lands in one folder, packed as results.tar.gz (the device tool returns at most 8 files). The default
# steps' time limits add up to about 40 minutes: run them as a few STEPS subsets (a command may run 10).
#
#   ../shared/gpu/wheels.sh                   # once, here: fills .whl/ (never committed)
#   tools/pack_ucx_wheels.sh                  # then: the UCX wheels in ucx-wheels.tar.xz (64 MiB carry)
#   device run, carry [".whl", "ucx-wheels.tar.xz"]:
#       mkdir -p .whl-ucx && tar xJf ucx-wheels.tar.xz -C .whl-ucx && bash benchmarks/gpu_validation.sh "$OUT"
#   (each command may run 10 minutes: run the steps as a few STEPS subsets, back to back)
#   a subset: STEPS="gpu-tests suite-images" bash benchmarks/gpu_validation.sh "$OUT"
#   all over tcp: PROTOCOL=tcp bash benchmarks/gpu_validation.sh "$OUT"
#   some stream-groups operations only: STREAM_OPS=chain-sum,frames (default: all six)
#   some GPU tests only: GPU_TESTS_K='map or killed' (pytest's -k expression; default: all)
#   the two-worker steps on other GPUs: DEVS=0,0 (two workers sharing GPU 0, where only one GPU is
#   lent: an even cluster, not two GPUs' speed; default 0,1)
#   not run by default: suite-matmul (matmul_iterate alone, with the co-tenant), suite-even-aa (the even
#   suite with replicas defaults@2 and balance@2, 5 runs: balance against defaults beside defaults against
#   itself, the noise floor; AA_RUNS runs, default 5), suite-even-cpu (the same on two one-thread CPU
#   workers), suite-compare re-runs matmul_iterate with a co-tenant over tcp and prints the
#   change against $COMPARE (a committed suite JSON, measured over tcp): the check that a change left the
#   figures and the JSON fields as they were; scheduler-overhead (CPU only: the scheduler's throughput
#   at 50,000 blocks mapped and summed, minutes per run).
set -u
out=${1:?usage: gpu_validation.sh OUTDIR}
run="$out/run"
mkdir -p "$run"
protocol=${PROTOCOL:-ucx}
devs=${DEVS:-0,1}
shopt -s nullglob
wheels=(.whl/*.whl)
for w in .whl-ucx/*.whl; do [[ -e .whl/${w##*/} ]] || wheels+=("$w"); done  # the UCX wheels, when carried apart
shopt -u nullglob
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "${wheels[@]}" \
  && export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 || exit 1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [[ $protocol == ucx ]] && ! python3 -c 'import distributed_ucxx' 2> "$run/ucx-import.log"; then
  echo "PROTOCOL=ucx but distributed_ucxx does not import (see $run/ucx-import.log): carry the UCX wheels" \
    "(.whl or .whl-ucx) or run with PROTOCOL=tcp" | tee "$run/steps.txt"
  exit 1
fi

steps=${STEPS:-gpu-tests demo fft-filter stream-groups fragment-phases plan-memo long-run local-cupy suite-cotenant suite-even suite-images suite-tcp dashboard}
step() {  # step LIMIT NAME COMMAND...: run, log to $run/NAME.log, note the exit code, re-pack
  local limit=$1 name=$2; shift 2
  [[ " $steps " == *" $name "* ]] || return 0
  echo "== $name: $*" | tee -a "$run/steps.txt"
  local t0=$SECONDS
  timeout "$limit" "$@" > "$run/$name.log" 2>&1
  echo "   exit $? after $((SECONDS - t0)) s" | tee -a "$run/steps.txt"
  tar czf "$out/results.tar.gz" -C "$out" run  # what ran so far survives a later time-out
}

{ date -u; nvidia-smi; python3 -c 'import sys, cupy, dask, distributed, dask_cuda; print(sys.version); print("cupy", cupy.__version__, "dask", dask.__version__, "distributed", distributed.__version__, "dask_cuda", dask_cuda.__version__)'; python3 -c 'import distributed_ucxx, ucxx; print("distributed_ucxx", distributed_ucxx.__version__, "ucxx", ucxx.__version__)'; echo "PROTOCOL=$protocol"; env | grep -E "^UCX(PY)?_" | sort; } > "$run/env.txt" 2>&1

p=(--protocol "$protocol")
step 420 gpu-tests python3 -m pytest -m gpu -v -s -p no:cacheprovider --timeout 90 ${GPU_TESTS_K:+-k "$GPU_TESTS_K"} tests/test_gpu.py
demo_p=("${p[@]}")  # with one GPU the demo balances CPU workers, which talk tcp only
(( $(nvidia-smi -L | wc -l) < 2 )) && demo_p=(--protocol tcp)
step 150 demo env COLUMNS=160 python3 -m dask_octopus demo "${demo_p[@]}" --out "$run/demo"
fft_size=()  # two workers on one GPU: half the array (its 8 GiB blocks took 40 GiB a worker, two too many for 80 GiB)
[[ -n $(tr , '\n' <<< "$devs" | sort | uniq -d) ]] && fft_size=(--rows 65536 --chunk-rows 32768)
step 80 fft-filter python3 benchmarks/fft_filter.py --devs "$devs" "${fft_size[@]}" --cotenant-procs 2 "${p[@]}" --out "$run"
step 300 stream-groups python3 benchmarks/stream_groups.py --type gpu --devs 0 --runs 5 --sets 10 \
  --operations "${STREAM_OPS:-chain-sum,tiny,dataframe,frames,large,mixed}" "${p[@]}" --out "$run"
step 150 fragment-phases python3 benchmarks/fragment_phases.py --type gpu --devs 0 --runs 6 "${p[@]}" --out "$run"
# the chain-sum computed each run as the same collection, then on new keys (the chain named anew), its plan
# remembered (plan-memo 8: the same keys reuse it, new keys reuse it renamed) and not (0)
step 300 plan-memo bash -c 'for k in same new; do for m in 8 0; do DASK_OCTOPUS__FRAGMENTS__PLAN_MEMO=$m \
  python3 benchmarks/fragment_phases.py --type gpu --devs 0 --workloads chain-sum --runs 6 --$k-keys \
  --protocol "$0" --tag "phases-$k-keys-memo$m" --out "$1" || exit; done; done' "$protocol" "$run"
step 260 long-run python3 benchmarks/long_run.py --type gpu --devs "$devs" --n 1000 "${p[@]}" --out "$run"
step 180 local-cupy python3 benchmarks/dask_cuda_overhead.py --devs "$devs" --operations transpose_sum,dot --size 20000 \
  --chunk-size 5000 --runs 3 --rounds 2 "${p[@]}" --out "$run"
sizes=(--type gpu --devs "$devs" --size 1000000 --cols 1024 --square-size 20000 --width 1024 --passes 3 --warmup-runs 1
       --octopus all)
moving=matmul_iterate,dot,transpose_sum,map_overlap  # the operations that move data between the GPUs
suite=("${sizes[@]}" --operation "$moving,images" --image-repeat 2)
step 240 suite-cotenant python3 benchmarks/local_octopus.py "${suite[@]}" --runs 2 --cotenant 0 "${p[@]}" --out "$run"
step 150 suite-matmul python3 benchmarks/local_octopus.py "${sizes[@]}" --operation matmul_iterate --runs 2 --cotenant 0 \
  "${p[@]}" --tag suite-matmul --out "$run"  # not run by default: matmul_iterate alone, as in suite-cotenant
step 120 suite-even python3 benchmarks/local_octopus.py "${suite[@]}" --runs 1 "${p[@]}" --out "$run"
step 400 suite-even-aa python3 benchmarks/local_octopus.py "${sizes[@]}" --operation "$moving" \
  --variants defaults,balance,defaults@2,balance@2 --runs "${AA_RUNS:-5}" "${p[@]}" --tag suite-even-aa --out "$run"  # not run by default
step 200 suite-even-cpu python3 benchmarks/local_octopus.py --type cpu --n-workers 2 --operation "$moving" \
  --variants defaults,balance,defaults@2,balance@2 --runs "${AA_RUNS:-5}" --protocol tcp --tag suite-even-cpu \
  --out "$run"  # not run by default: the same on two CPU workers of the GPU machine's host
step 90 suite-images python3 benchmarks/local_octopus.py --type gpu --devs "$devs" --operation images --octopus all \
  --image-repeat 4 --runs 3 --warmup-runs 1 --cotenant 0 --tag images "${p[@]}" --out "$run"
step 150 suite-tcp python3 benchmarks/local_octopus.py "${sizes[@]}" --operation "$moving" --runs 1 --cotenant 0 \
  --protocol tcp --tag suite-tcp --out "$run"  # beside the suite: what moves data, over tcp
step 90 dashboard python3 benchmarks/dashboard_screenshot.py --type gpu --devs "$devs" --seconds 30 --no-png \
  --html "$run/octopus-gpu.html" --metrics "$run/metrics-gpu.txt" "${p[@]}"  # screenshot it here: --from-html octopus-gpu.html --png ...
compare=${COMPARE:-benchmarks/results/2026-11-30-h200x2-validation/suite-gpu-cotenant.json}
step 120 suite-compare python3 benchmarks/local_octopus.py --type gpu --devs "$devs" --operation matmul_iterate \
  --size 1000000 --cols 1024 --width 1024 --passes 3 --warmup-runs 1 --octopus all --runs 1 --cotenant 0 \
  --protocol tcp --tag compare --compare "$compare" --out "$run"
step 240 scheduler-overhead python3 benchmarks/scheduler_overhead.py --blocks 50000 --runs 2 --out "$run"

cp "$run/steps.txt" "$out/steps.txt"
tail -n 40 "$run"/*.log | tail -c 11000
