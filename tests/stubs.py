"""Stand-ins for the scheduler's task states, for tests of the scheduler side of placement alone."""

from collections.abc import Hashable, Iterable, Mapping
from types import SimpleNamespace
from typing import Any


class Stub(SimpleNamespace):
    """A stand-in for one of the scheduler's objects (a task's or a worker's state, the scheduler, an
    extension): the fields given, hashable by identity as the scheduler's states are (a worker's
    ``processing`` set, a task's ``who_has``)."""

    __hash__ = object.__hash__


def task_state(key: Hashable, state: str = "released", dependencies: Iterable[Stub] = (),
               who_has: set[Stub] | None = None, annotations: Mapping[str, Any] | None = None, **fields: Any) -> Stub:
    """The fields of distributed's ``TaskState`` that placement reads and sets: a task ``key`` in ``state``
    with no restrictions; ``annotations`` an empty dict unless given."""
    return Stub(key=key, state=state, run_spec=None, dependencies=dependencies, who_has=who_has,
                worker_restrictions=None, host_restrictions=None, resource_restrictions=None,
                loose_restrictions=False, annotations={} if annotations is None else dict(annotations), **fields)
