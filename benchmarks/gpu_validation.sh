#!/usr/bin/env bash
# The whole GPU validation in one call on the GPU machine (2 x H200): GPU tests, calibration figures,
# the demo, and matmul_iterate benchmarks with and without a co-tenant. Everything lands in one folder,
# packed as results.tar.gz (the device tool returns at most 8 files).
#
#   ../shared/gpu/wheels.sh                   # once, here: fills .whl/ (never committed)
#   device run, carry [".whl"]:  bash benchmarks/gpu_validation.sh "$OUT"
#   a subset: STEPS="gpu-tests images" bash benchmarks/gpu_validation.sh "$OUT"
set -u
out=${1:?usage: gpu_validation.sh OUTDIR}
run="$out/run"
mkdir -p "$run"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 || exit 1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

steps=${STEPS:-gpu-tests calibration demo bench-cotenant bench-even images stream-groups stream-groups-g32}
step() {  # step LIMIT NAME COMMAND...: run, log to $run/NAME.log, note the exit code, re-pack
  local limit=$1 name=$2; shift 2
  [[ " $steps " == *" $name "* ]] || return 0
  echo "== $name: $*" | tee -a "$run/steps.txt"
  local t0=$SECONDS
  timeout "$limit" "$@" > "$run/$name.log" 2>&1
  echo "   exit $? after $((SECONDS - t0)) s" | tee -a "$run/steps.txt"
  tar czf "$out/results.tar.gz" -C "$out" run  # what ran so far survives a later time-out
}

{ date -u; nvidia-smi; python3 -c 'import sys, cupy, dask, distributed, dask_cuda; print(sys.version); print("cupy", cupy.__version__, "dask", dask.__version__, "distributed", distributed.__version__, "dask_cuda", dask_cuda.__version__)'; } > "$run/env.txt" 2>&1

step 240 gpu-tests python3 -m pytest -m gpu -v -s -p no:cacheprovider --timeout 60 tests/test_gpu.py
step 90 calibration python3 benchmarks/calibration.py --type gpu --devs 0,1 --out "$run"
step 90 demo python3 -m dask_octopus demo --type gpu --out "$run"
common=(--type gpu --devs 0,1 --size 2000000 --cols 2048 --width 2048 --passes 3 --runs 2 --warmup-runs 1)
step 150 bench-cotenant python3 benchmarks/local_octopus.py "${common[@]}" --cotenant 0 --out "$run"
step 90 bench-even python3 benchmarks/local_octopus.py "${common[@]}" --variants equal,balance --runs 3 --out "$run"
step 150 images python3 examples/images.py --type gpu --devs 0,1 --cotenant 0 --repeat 4 --runs 3 \
  --json-out "$run/images-gpu-cotenant.json"
step 240 stream-groups python3 benchmarks/stream_groups.py --type gpu --devs 0 --runs 5 --sets 10 --out "$run"
step 120 stream-groups-g32 python3 benchmarks/stream_groups.py --type gpu --devs 0 --operations frames --group 32 \
  --runs 5 --sets 10 --tag stream-groups-g32 --out "$run"

cp "$run/steps.txt" "$out/steps.txt"
tail -n 40 "$run"/*.log | tail -c 11000
