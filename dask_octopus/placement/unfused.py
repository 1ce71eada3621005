"""A task that Dask's low-level fusion leaves on its own."""

from __future__ import annotations

from dask_octopus._compat import Task


class UnfusedTask(Task):
    """A task that Dask's low-level fusion does not merge with its neighbours (``block_fusion``, as
    Dask's own P2P barrier), so that the scheduler can place it apart from them.

    :func:`~dask_octopus.balance` gives this class to the slice of an input block that a planned block
    on another worker is cut from: fused into that block's task, which is pinned to the planned worker,
    the slice would move the whole input block there; on its own it runs where the input block is held
    and only the slice moves. It never joins a fragment itself, but unlike Dask's special tasks it does
    not keep the tasks that read it out of one."""

    __slots__ = ()

    @property
    def block_fusion(self) -> bool:
        return True
