"""dask_octopus defaults in ``dask.config`` under the ``octopus`` key (see ``octopus.yaml``), and the
one place that reads and checks them."""

from __future__ import annotations

import contextlib
import copy
import difflib
import os
from collections.abc import Callable, Mapping
from typing import Any

import dask.config
import yaml
from dask.utils import parse_bytes, parse_timedelta

from dask_octopus._checks import is_count, is_finite

with open(os.path.join(os.path.dirname(__file__), "octopus.yaml")) as f:
    defaults = yaml.safe_load(f)

# the settings as the environment and YAML files gave them: Dask's update_defaults replaces a value given
# where a section of settings belongs (DASK_OCTOPUS__CALIBRATION=5) by that section, which check_all refuses
_given = copy.deepcopy(dask.config.get("octopus", default=None))
dask.config.update_defaults(defaults)


def _parses(parse: Callable[[Any], Any]) -> Callable[[Any], bool]:
    def ok(value: Any) -> bool:
        # (Dask's parsers take True for 1, and an empty or blank string for 1 byte)
        if isinstance(value, bool) or (isinstance(value, str) and not value.strip()):
            return False
        try:
            return is_finite(parse(value))
        except (TypeError, ValueError, KeyError, AttributeError,  # (Dask's parsers: AttributeError for None, lists,
                IndexError, OverflowError):  # IndexError for an empty duration, OverflowError for 1e999s)
            return False

    return ok


def _size(value: Any) -> bool:
    """A size that parses, given as a string or as a whole number of bytes (Dask's parser takes 0.5 for 0)."""
    return _parses(parse_bytes)(value) and (isinstance(value, str) or float(value).is_integer())


def _integer(minimum: int) -> Callable[[Any], bool]:
    return lambda v: is_count(v, minimum)


_FRACTION = ("a number in (0, 1]", lambda v: is_finite(v, positive=True) and v <= 1)
CHECKS: dict[str, tuple[str, Callable[[Any], bool]]] = {  # key: (what it must be, check)
    "calibration.seconds": ("a number > 0", lambda v: is_finite(v, positive=True)),
    "calibration.device": ("one of auto, cpu, gpu", lambda v: v in ("auto", "cpu", "gpu")),
    "calibration.wait": ("a duration such as 30s", _parses(parse_timedelta)),
    "refine.confidence-samples": ("an integer >= 1", _integer(1)),
    "refine.min-duration": ("a duration such as 2ms", _parses(parse_timedelta)),
    "refine.significance": ("a number >= 0", is_finite),
    "refine.max-prefixes": ("an integer >= 1", _integer(1)),
    "balance.memory-fraction": _FRACTION,
    "balance.min-gain": ("a number >= 0", is_finite),
    "map.steal-fraction": ("a number in [0, 1]", lambda v: is_finite(v) and v <= 1),
    "map.item-cost-alpha": _FRACTION,
    "map.steal-min-seconds": ("a duration such as 50ms", _parses(parse_timedelta)),
    "map.learn-result-size": ("true or false", lambda v: isinstance(v, bool)),
    "map.learn-result-wait": ("a duration such as 5s", _parses(parse_timedelta)),
    "max-plans": ("an integer >= 1", _integer(1)),
    "fragments.max-bytes": ("auto or a size such as 2GiB", lambda v: v == "auto" or _size(v)),
    "fragments.plan-memo": ("an integer >= 0", _integer(0)),
    "fragments.task-cost": ("a duration of 0 or more such as 1ms",
                            lambda v: _parses(parse_timedelta)(v) and parse_timedelta(v) >= 0),
    "streams.max-streams": ("an integer >= 1", _integer(1)),
    "streams.large-bytes": ("a size such as 128MiB", _size),
    "streams.capture": ("true or false", lambda v: isinstance(v, bool)),
    "streams.capture-after": ("an integer >= 1", _integer(1)),
    "streams.max-graphs": ("an integer >= 1", _integer(1)),
    "streams.max-graph-bytes": ("a size such as 4GiB", _size),
    "streams.capture-spare-bytes": ("a size such as 32MiB", _size),
    "streams.switch-interval": ("off or a duration of 1us or more, such as 100us",  # (off: YAML reads it as false)
                                lambda v: v is False or v == "off" or (_parses(parse_timedelta)(v)
                                                                       and parse_timedelta(v) >= 1e-6)),
}


#: keys that were renamed: old -> (new, why), refused by :func:`check_all` with the new name
RENAMED: dict[str, tuple[str, str]] = {
    "refine.alpha": ("map.item-cost-alpha", "it weighs map batches only; the speed model has no smoothing "
                                            "weight: its rates are means since their last change"),
}

_MISSING = object()
_checked: set[tuple[str, type, Any]] = set()  # (key, type, value) of the values that passed their check


def get(key: str, override: Any = None, argument: str | None = None) -> Any:
    """``override`` if given, else ``octopus.<key>`` from ``dask.config``, else the package's default
    (Dask's test utilities, for one, replace the whole configuration); raises ``ValueError`` naming
    the key, or the ``argument`` that passed ``override``, when the value is not what the key takes."""
    name = f"octopus.{key}"
    if override is not None:
        value = override
        name = f"{argument or 'the value given for ' + name} (as octopus.{key})"
    else:
        value = dask.config.get(f"octopus.{key}", default=_MISSING)
        if value is _MISSING:
            value = dask.config.get(f"octopus.{key}", config=defaults)
    try:
        # the hot paths read settings per call: check each value once (by type too: False == 0, True == 1)
        if (key, type(value), value) in _checked:
            return value
    except TypeError:  # not hashable: check it every time
        pass
    what, ok = CHECKS[key]
    if not ok(value):
        raise ValueError(f"{name} must be {what}, got {value!r}")
    with contextlib.suppress(TypeError):
        _checked.add((key, type(value), value))
    return value


def _check_keys(given: Any, known: dict[str, Any], path: str) -> None:
    """Raise ``ValueError`` for a key under ``path`` that dask_octopus does not read (with the nearest
    known one), or a value where a section of settings belongs (but ``None``: a YAML section whose keys are
    all commented out, read as the defaults)."""
    if given is None:
        return
    if not isinstance(given, Mapping):
        raise ValueError(f"{path} must be a section of settings ({', '.join(known)}), got {given!r}")
    for key, value in given.items():
        name = str(key).replace("_", "-")  # (as dask.config reads them: max_bytes is max-bytes)
        if name not in known:
            near = difflib.get_close_matches(name, known, n=1)
            hint = f"; did you mean {path}.{near[0]}?" if near else f" (it reads {', '.join(known)})"
            raise ValueError(f"{path}.{key} is not a dask_octopus setting{hint}")
        if isinstance(known[name], dict):
            _check_keys(value, known[name], f"{path}.{name}")


def check_all() -> None:
    """Check every ``octopus`` setting now (each is checked again only when its value changes): raises
    ``ValueError`` naming the first key whose value is not what the key takes, a renamed key that is
    set, with its new name, a key that dask_octopus does not read (a misspelt one would be ignored), or
    a value where a section of settings belongs."""
    for old, (new, why) in RENAMED.items():
        if dask.config.get(f"octopus.{old}", default=_MISSING) is not _MISSING:
            raise ValueError(f"octopus.{old} was renamed octopus.{new} ({why})")
    _check_keys(_given, defaults["octopus"], "octopus")
    _check_keys(dask.config.get("octopus", default={}), defaults["octopus"], "octopus")
    for key in CHECKS:
        get(key)
