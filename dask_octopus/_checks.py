"""Input checks shared by the planning math, the speed models and the plugins (no Dask here)."""

from __future__ import annotations

import math
import numbers
from typing import Any


def is_finite(value: Any, *, positive: bool = False) -> bool:
    """Whether ``value`` is a real number (not a bool), finite, and ``> 0`` if ``positive`` else ``>= 0``."""
    if type(value) is not float and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
        return False  # (a float, the common case, skips the slower checks)
    return math.isfinite(value) and (value > 0 if positive else value >= 0)


def is_count(value: Any, minimum: int = 1) -> bool:
    """Whether ``value`` is an integer (Python's or NumPy's, not a bool) ``>= minimum``."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= minimum


def check_flag(value: Any, what: str) -> bool:
    """Return ``value``, or raise ``TypeError`` saying that ``what`` must be True or False."""
    if not isinstance(value, bool):
        raise TypeError(f"{what} must be True or False, got {value!r}")
    return value


def check_finite(value: Any, what: str, *, positive: bool = True,
                 error: type[Exception] = ValueError) -> float:
    """Return ``value`` as a float, or raise ``error`` saying that ``what`` must be finite and
    ``> 0`` (``positive``) or ``>= 0``."""
    if not is_finite(value, positive=positive):
        raise error(f"{what} must be finite and {'> 0' if positive else '>= 0'}, got {value!r}")
    return float(value)
