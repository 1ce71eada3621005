"""The package as a user imports it: light, and the harness apart from the product."""

import subprocess
import sys


def test_import_adds_nothing_heavy_to_what_dask_array_and_distributed_load():
    code = ("import sys, distributed, dask.array; before = set(sys.modules); import dask_octopus; "
            "print(' '.join(sorted(set(sys.modules) - before)))")
    added = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert "dask_octopus.plugins.scheduler" in added  # the product is there
    third_party = [m for m in added if m.split(".")[0] not in sys.stdlib_module_names | {"dask_octopus"}]
    assert third_party == []  # no matplotlib, rich, pandas, dask.dataframe... (the standard library is light)
    assert not [m for m in added if m.startswith("dask_octopus.bench")]  # the harness stays out
