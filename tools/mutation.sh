#!/usr/bin/env bash
# Mutation testing of the pure cores (no Dask inside) with mutmut 3, one module at a time.
#
#   tools/mutation.sh                      # all six pure modules
#   tools/mutation.sh groups/planning      # only some (paths under dask_octopus/, without .py)
#   KEEP=1 tools/mutation.sh ...           # keep the temporary copy to inspect survivors there
#
# Each module is mutated in its own temporary copy of the repository (the files `git ls-files` lists,
# as they are in the working tree, untracked but not ignored ones included): the mutmut
# configuration is written there as setup.cfg, so nothing in the repository changes. Only the
# module's own test file runs against its mutants, with one worker process (MUTMUT_CHILDREN to change).
# mutmut stops a mutant that runs longer than MUTATION_TIMEOUT_MULTIPLIER (default 5, mutmut's own is 15)
# times the unmutated run of the tests that reach it, plus a second (a timeout counts as killed); the
# address space of mutmut and its children is capped (MUTATION_MEM_KB, default 4 GiB), so that a
# mutant which loops while allocating fails with MemoryError instead of filling the machine.
# Needs `pip install mutmut` (written against mutmut 3.8). See docs/testing.md, "Mutation testing".
set -euo pipefail

declare -A TESTS=(
  [placement/planning]=tests/test_planning.py
  [placement/packing]=tests/test_packing.py
  [placement/bandwidth]=tests/test_transfers.py
  [profiling/speedmodel]=tests/test_speedmodel.py
  [profiling/itemcosts]=tests/test_itemcosts.py
  [groups/planning]=tests/test_grouping.py
)
ORDER=(placement/planning placement/packing placement/bandwidth profiling/speedmodel profiling/itemcosts groups/planning)
CHILDREN=${MUTMUT_CHILDREN:-1}
MEM_KB=${MUTATION_MEM_KB:-4194304}
TIMEOUT_MULTIPLIER=${MUTATION_TIMEOUT_MULTIPLIER:-5}

command -v mutmut >/dev/null || { echo "mutmut is not installed: pip install mutmut" >&2; exit 2; }
repo=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
modules=("$@")
[ ${#modules[@]} -gt 0 ] || modules=("${ORDER[@]}")
for m in "${modules[@]}"; do
  [ -n "${TESTS[$m]:-}" ] || { echo "unknown module $m: one of ${ORDER[*]}" >&2; exit 2; }
done

work=$(mktemp -d "${TMPDIR:-/tmp}/octopus-mutation.XXXXXX")
if [ -n "${KEEP:-}" ]; then echo "keeping $work"; else trap 'rm -rf "$work"' EXIT; fi

summary=()
for m in "${modules[@]}"; do
  src="dask_octopus/$m.py"
  test=${TESTS[$m]}
  dir="$work/${m//\//-}"
  mkdir -p "$dir"
  # the working tree's files (deleted ones left out), not git's index: nothing in git changes
  (cd "$repo" && git ls-files -z --cached --others --exclude-standard \
     | while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done \
     | tar --null -T - -cf -) | tar -xf - -C "$dir"
  if grep -q '^\[tool\.mutmut\]' "$dir/pyproject.toml"; then
    echo "pyproject.toml has a [tool.mutmut] section, which mutmut would read instead of setup.cfg" >&2
    exit 2
  fi
  cat > "$dir/setup.cfg" <<CFG
[mutmut]
source_paths = dask_octopus
only_mutate = $src
pytest_add_cli_args_test_selection = $test
timeout_multiplier = $TIMEOUT_MULTIPLIER
pytest_add_cli_args =
    -p
    no:cacheprovider
    -W
    ignore::hypothesis.errors.HypothesisWarning
CFG
  # Hypothesis keeps no example database here (it falls back to one in memory, per mutant's process):
  # with the default one on disk, a failing example found while testing one mutant is replayed on
  # every later one, and if the unmutated code fails it too, every later mutant counts as killed.
  : > "$dir/.no-hypothesis-database"
  echo "=== $src  <-  $test"
  start=$SECONDS
  (cd "$dir" && ulimit -v "$MEM_KB" && export HYPOTHESIS_STORAGE_DIRECTORY="$dir/.no-hypothesis-database/x" &&
     mutmut run --max-children "$CHILDREN" > "$dir/run.log" 2>&1) || {
    tail -40 "$dir/run.log" >&2; echo "mutmut run failed for $src (log above)" >&2; exit 1; }
  (cd "$dir" && mutmut results --all true) > "$dir/results.txt"
  # survivors and the like, with their diffs, for reading
  grep -v ': killed$\|: timeout$' "$dir/results.txt" | sed 's/^ *//; s/: .*//' | while read -r name; do
    (cd "$dir" && mutmut show "$name")
  done > "$dir/survivors.diff" || true
  grep -v ': killed$\|: timeout$' "$dir/results.txt" || true
  line=$(awk -F': ' -v m="$src" -v t=$((SECONDS - start)) '
    { n++; s[$2]++ }
    END {
      k = s["killed"] + s["timeout"]
      printf "%-40s killed %3d / %3d = %5.1f%%  (survived %d, no tests %d, timeout %d, other %d; %d s)",
        m, k, n, n ? 100 * k / n : 0, s["survived"], s["no tests"], s["timeout"],
        n - k - s["survived"] - s["no tests"], t
    }' "$dir/results.txt")
  echo "$line"
  summary+=("$line")
done

echo
echo "=== killed share per module (killed + timeout over all mutants)"
printf '%s\n' "${summary[@]}"
