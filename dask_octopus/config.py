"""dask_octopus defaults in ``dask.config`` under the ``octopus`` key (see ``octopus.yaml``)."""

from __future__ import annotations

import os
from typing import Any

import dask.config
import yaml

with open(os.path.join(os.path.dirname(__file__), "octopus.yaml")) as f:
    defaults = yaml.safe_load(f)

dask.config.update_defaults(defaults)


def get(key: str) -> Any:
    """``octopus.<key>`` from ``dask.config``, or the package's default where the configuration has
    no such key (Dask's test utilities, for one, replace the whole configuration)."""
    return dask.config.get(f"octopus.{key}", default=dask.config.get(f"octopus.{key}", config=defaults))
