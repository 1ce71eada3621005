"""The bytes of the blocks of dask arrays, known before the tasks that make them run.

Dask keeps each array's chunks and dtype with its layer of the high-level graph
(``collection_annotations``). The optimizer of ``annotate``, which runs where the scheduler
materializes a graph, remembers them by layer name (:func:`remember`), for the memory budget of
fragments (``octopus.fragments.max-bytes``): a fragment that makes blocks from nothing it reads
(random blocks), or reads blocks another fragment makes, is sized before it runs, whether its tasks
are grouped by the optimizer or, later, by the scheduler plugin from the annotations of a compute
inside ``annotate`` (:func:`block_bytes`). These are estimates: the chunks describe the array a layer
makes, which some of Dask's own intermediate layers (a reduction's partial results) do not hold, and
two arrays of other chunks that a user gave one name are sized as the last one remembered. Only
layers of NumPy and CuPy blocks of known chunks count; the last :data:`LAYERS` names are kept (and
all those of the last graph).
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from itertools import product
from typing import Any

import numpy as np
from dask.highlevelgraph import HighLevelGraph
from dask.typing import Key

LAYERS = 1000  # layers remembered (least recently seen dropped first)
ARRAYS = ("numpy", "cupy")  # the modules of the block types sized (dense arrays)

_lock = threading.Lock()  # the optimizer runs in Dask's offload thread, the plugin on the event loop
Layout = tuple[tuple[tuple[int, ...], ...], int]  # an array layer's chunks and item size
_layers: OrderedDict[str, Layout] = OrderedDict()


def _dense(chunk_type: Any) -> bool:
    """Whether ``chunk_type`` (Dask's name of a layer's block type) names NumPy's or CuPy's array."""
    return isinstance(chunk_type, str) and chunk_type.split(".")[0] in ARRAYS and chunk_type.endswith(".ndarray")


def _known(chunks: tuple) -> bool:
    """Whether ``chunks`` are all numbers, none of them NaN (unknown: a NaN makes its dimension's sum NaN)."""
    try:
        return not any(math.isnan(sum(dim)) for dim in chunks)
    except TypeError:
        return False


def remember(dsk: Any) -> None:
    """Remember the chunks and item size of each layer of dense arrays of known chunks of ``dsk``, a
    ``HighLevelGraph`` (anything else is left as it is)."""
    if not isinstance(dsk, HighLevelGraph):
        return
    found = {}
    for name, layer in dsk.layers.items():
        about = layer.collection_annotations or {}
        chunks, dtype = about.get("chunks"), about.get("dtype")
        if (isinstance(name, str) and isinstance(chunks, tuple) and isinstance(dtype, np.dtype)
                and not dtype.hasobject and _dense(about.get("chunk_type")) and _known(chunks)):
            found[name] = (chunks, dtype.itemsize)
    with _lock:
        for name, layout in found.items():
            _layers[name] = layout
            _layers.move_to_end(name)
        while len(_layers) > max(LAYERS, len(found)):
            _layers.popitem(last=False)


def _block_bytes(key: tuple, layout: Layout) -> float | None:
    """The bytes of the block ``key`` of a layer of ``layout`` (``None``: not one of its blocks)."""
    chunks, nbytes = layout
    if len(key) != len(chunks) + 1:
        return None
    at = 1
    for dim in chunks:  # (indexed, without zip and a slice of the key: a call per step of a fragment)
        i = key[at]
        if type(i) is not int or not 0 <= i < len(dim):
            return None
        nbytes *= dim[i]
        at += 1
    return float(nbytes)


def known_bytes(made: Mapping[Key, float], keys: Iterable[Key]) -> dict[Key, float]:
    """The bytes ``made`` (a :class:`BlockBytes` or any mapping) knows of each of ``keys`` that it sizes."""
    if isinstance(made, BlockBytes):
        return made.known(keys)
    return {k: b for k in keys if (b := made.get(k)) is not None}


class BlockBytes(Mapping[Key, float]):
    """The bytes of the blocks of the layers remembered when it was made (:func:`block_bytes`), by key
    ``(name, i, j, ...)``, each computed when it is looked up."""

    def __init__(self, layers: Mapping[str, Layout]):
        self._layers = layers

    def __getitem__(self, key: Key) -> float:
        nbytes = self.get(key)
        if nbytes is None:
            raise KeyError(key)
        return nbytes

    def get(self, key: Key, default: Any = None) -> Any:
        """The bytes of block ``key``, else ``default`` (without raising)."""
        layout = self._layers.get(key[0]) if type(key) is tuple and key and type(key[0]) is str else None
        nbytes = None if layout is None else _block_bytes(key, layout)
        return default if nbytes is None else nbytes

    def known(self, keys: Iterable[Key]) -> dict[Key, float]:
        """The bytes of the blocks among ``keys`` (fragments look up every step's name, most of which name
        no block: one pass here, without a call per key)."""
        layers = self._layers
        out = {}
        for key in keys:
            if (type(key) is tuple and key and type(key[0]) is str and (layout := layers.get(key[0])) is not None
                    and (nbytes := _block_bytes(key, layout)) is not None):
                out[key] = nbytes
        return out

    def layouts(self, names: Iterable[Any]) -> frozenset[tuple[Any, Layout | None]]:
        """The chunks and item size of each layer of ``names`` (``None`` where not remembered), by name:
        two mappings size the keys of those layers alike where these are equal."""
        return frozenset((name, self._layers.get(name)) for name in names)

    def __iter__(self) -> Iterator[Key]:
        for name, (chunks, _) in self._layers.items():
            for index in product(*(range(len(dim)) for dim in chunks)):
                yield (name, *index)

    def __len__(self) -> int:
        return sum(int(np.prod([len(dim) for dim in chunks])) for chunks, _ in self._layers.values())


def block_bytes() -> BlockBytes:
    """The bytes of the blocks of the array layers remembered now (:func:`remember`): a mapping over a
    copy of the table, sizing a key when it is looked up."""
    with _lock:
        return BlockBytes(dict(_layers))
