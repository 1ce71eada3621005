"""The bytes of the blocks of dask arrays, known before the tasks that make them run.

Dask keeps each array's chunks and dtype with its layer of the high-level graph
(``collection_annotations``). The optimizer of ``annotate``, which runs where the scheduler
materializes a graph, remembers them by layer name (:func:`remember`), for the memory budget of
fragments (``octopus.fragments.max-bytes``): a fragment that makes blocks from nothing it reads
(random blocks), or reads blocks another fragment makes, is sized before it runs, whether its tasks
are grouped by the optimizer or, later, by the scheduler plugin from the annotations of a compute
inside ``annotate`` (:func:`block_bytes`). An array's layer name is a token of what it computes, so
what is remembered under a name holds; the last :data:`LAYERS` names are kept.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import numpy as np
from dask.highlevelgraph import HighLevelGraph
from dask.typing import Key

LAYERS = 1000  # layers remembered (least recently seen dropped first)

_lock = threading.Lock()  # the optimizer runs in Dask's offload thread, the plugin on the event loop
_layers: OrderedDict[str, tuple[tuple[tuple[int, ...], ...], int]] = OrderedDict()


def remember(dsk: Any) -> None:
    """Remember the chunks and item size of each array layer of ``dsk``, a ``HighLevelGraph`` (anything
    else is left as it is), but arrays of unknown chunks or of Python objects."""
    if not isinstance(dsk, HighLevelGraph):
        return
    found = {}
    for name, layer in dsk.layers.items():
        about = layer.collection_annotations or {}
        chunks, dtype = about.get("chunks"), about.get("dtype")
        if (isinstance(name, str) and isinstance(chunks, tuple) and isinstance(dtype, np.dtype)
                and not dtype.hasobject and all(c == c for dim in chunks for c in dim)):  # (NaN: unknown)
            found[name] = (chunks, dtype.itemsize)
    with _lock:
        for name, known in found.items():
            _layers[name] = known
            _layers.move_to_end(name)
        while len(_layers) > LAYERS:
            _layers.popitem(last=False)


def block_bytes(keys: Iterable[Key]) -> dict[Key, float]:
    """The bytes of each of ``keys`` that names a block of a remembered array layer (:func:`remember`)."""
    with _lock:
        layers = dict(_layers)
    out = {}
    for k in keys:
        array = layers.get(k[0]) if type(k) is tuple and k and type(k[0]) is str else None
        if array is not None and len(k) == len(array[0]) + 1 and all(type(i) is int for i in k[1:]):
            nbytes = array[1]
            for dim, i in zip(array[0], k[1:], strict=True):
                nbytes *= dim[i]
            out[k] = float(nbytes)
    return out
