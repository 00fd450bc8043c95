"""aotkit's locks, safe across ``os.fork``.

A process forked while another of its threads holds a lock (a ``DataLoader`` worker started
while a thread traces) copies that lock in the held state, and no thread of the child ever
releases it: the child's first compiled call would wait forever. Every lock made here is
reset, free, in a forked child, as the ``logging`` module does with its handlers' locks.
"""

from __future__ import annotations

import os
import threading
from typing import Any

_locks: list[Any] = []


def new_lock(reentrant: bool = False) -> Any:
    """A ``threading.Lock`` (``RLock`` if ``reentrant``) that a forked child finds free."""
    lock = threading.RLock() if reentrant else threading.Lock()
    _locks.append(lock)
    return lock


def _free_in_child() -> None:
    for lock in _locks:
        lock._at_fork_reinit()


if hasattr(os, "register_at_fork"):  # not on Windows, which has no fork
    os.register_at_fork(after_in_child=_free_in_child)
