"""Option types of the command lines (the benchmarks', the examples' and ``dask-octopus``'s): each refuses
what it cannot use as a usage error while the command line is read, before anything starts."""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from typing import Any

import click


class OutFolder(click.ParamType):
    """A folder for a benchmark's results, made (with its parents) as the command line is read: one that
    cannot be made, or written to, is a usage error then, not a traceback after the run."""

    name = "folder"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        try:
            os.makedirs(value, exist_ok=True)
        except OSError as e:
            self.fail(f"cannot make the folder {value!r}: {e.strerror or e}", param, ctx)
        if not os.access(value, os.W_OK | os.X_OK):
            self.fail(f"cannot write into the folder {value!r}", param, ctx)
        return str(value)


class FiniteRange(click.FloatRange):
    """``click.FloatRange`` for a finite number: ``nan``, which compares false with both bounds, and
    ``inf`` are usage errors, not a traceback later (``time.sleep(nan)``)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number


class Names(click.ParamType):
    """A comma-separated list of one or more of ``choices``, in the order given (repeats dropped), as a
    list of str."""

    name = "names"

    def __init__(self, choices: Iterable[str]):
        self.choices = list(choices)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> list[str]:
        if isinstance(value, list):  # (a default given as a list)
            return value
        names = list(dict.fromkeys(v.strip() for v in str(value).split(",") if v.strip()))
        unknown = [v for v in names if v not in self.choices]
        if unknown:
            self.fail(f"unknown {', '.join(unknown)}: choose among {', '.join(self.choices)}", param, ctx)
        if not names:
            self.fail(f"name at least one of {', '.join(self.choices)}", param, ctx)
        return names
