#!/usr/bin/env bash
# Pack the UCX wheels small enough to carry to the GPU machine beside the tree and .whl/.
#
# The tree plus all the wheels ../shared/gpu/wheels.sh fetches exceed the device tool's 64 MiB carry;
# the UCX wheels (libucx alone is 42 MB, deflated) shrink to about 33 MB when repacked uncompressed
# and xz'd as one archive. Run from the project root after ../shared/gpu/wheels.sh:
#
#   tools/pack_ucx_wheels.sh          # moves the UCX wheels out of .whl/ into ucx-wheels.tar.xz
#
# then carry [".whl", "ucx-wheels.tar.xz"] and start the device command with
#   mkdir -p .whl-ucx && tar xJf ucx-wheels.tar.xz -C .whl-ucx && bash benchmarks/gpu_validation.sh "$OUT"
# (gpu_validation.sh installs .whl-ucx/*.whl too). The archive is ignored by git.
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
grep -qx '/ucx-wheels.tar.xz' .git/info/exclude 2>/dev/null || echo '/ucx-wheels.tar.xz' >> .git/info/exclude
shopt -s nullglob
ucx=(.whl/*ucx*.whl .whl/*rmm*.whl .whl/rapids_logger*.whl .whl/cuda_core*.whl .whl/cuda_pathfinder*.whl)
[ ${#ucx[@]} -gt 0 ] || { echo "no UCX wheels in .whl/: run ../shared/gpu/wheels.sh first" >&2; exit 2; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir "$work/stored"
for w in "${ucx[@]}"; do  # the same wheel, its members stored instead of deflated: xz then compresses them
  rm -rf "$work/x" && mkdir "$work/x"
  (cd "$work/x" && unzip -q "$root/$w" && zip -q -0 -r "$work/stored/$(basename "$w")" .)
done
tar cf - -C "$work/stored" . | xz -T2 -6 > ucx-wheels.tar.xz
rm -f "${ucx[@]}"
du -sh .whl ucx-wheels.tar.xz
