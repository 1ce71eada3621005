"""dask_octopus defaults in ``dask.config`` under the ``octopus`` key (see ``octopus.yaml``)."""

from __future__ import annotations

import os

import dask.config
import yaml

with open(os.path.join(os.path.dirname(__file__), "octopus.yaml")) as f:
    defaults = yaml.safe_load(f)

dask.config.update_defaults(defaults)
