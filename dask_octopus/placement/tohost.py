"""Copy a batch's CuPy results to host memory at once (``map(..., to_host=True)``).

A ``.get()`` per item inside the mapped function blocks the launching thread item by item, so the
items of a stream group stop overlapping. Here every CuPy array among the results (also inside
lists, tuples and dicts) is copied into pinned host memory without blocking, after the batch's
work was launched, and the batch waits once for all the copies.
"""

from __future__ import annotations

import sys
from typing import Any


def to_host(results: list[Any]) -> list[Any]:
    """``results`` with every CuPy array replaced by a NumPy copy (in pinned memory); other values, and
    all values on a worker that never imported CuPy, are returned as they are."""
    cp = sys.modules.get("cupy")
    if cp is None:
        return results
    import cupyx

    def copy(value: Any) -> Any:
        if isinstance(value, cp.ndarray):
            src = value if value.flags.c_contiguous else cp.ascontiguousarray(value)  # (that makes 0-d 1-d)
            out = cupyx.empty_pinned(src.shape, src.dtype)
            src.get(out=out, blocking=False)  # on the current stream, after the kernels that made value
            return out
        if type(value) in (list, tuple):
            return type(value)(copy(v) for v in value)
        if type(value) is dict:
            return {k: copy(v) for k, v in value.items()}
        return value

    out = [copy(r) for r in results]
    cp.cuda.get_current_stream().synchronize()
    return out
