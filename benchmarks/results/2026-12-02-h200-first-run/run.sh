#!/usr/bin/env bash
# The probe of this folder on the GPU machine, over UCX then TCP (device call, carry .whl and ucx-wheels.tar.xz):
#   mkdir -p .whl-ucx && tar xJf ucx-wheels.tar.xz -C .whl-ucx && bash benchmarks/results/2026-12-02-h200-first-run/run.sh "$OUT"
set -u
out=${1:?usage: run.sh OUTDIR}
here=$(dirname "$0")
shopt -s nullglob
wheels=(.whl/*.whl)
for w in .whl-ucx/*.whl; do [[ -e .whl/${w##*/} ]] || wheels+=("$w"); done
shopt -u nullglob
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "${wheels[@]}" \
  && export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 || exit 1
mkdir -p "$out"
for p in ${PROTOCOLS:-ucx tcp}; do
  timeout 240 python3 "$here/probe_first_run.py" --type gpu --protocol "$p" --out "$out/$p" > "$out/probe-$p.log" 2>&1
  echo "$p: exit $?" >> "$out/steps.txt"
done
