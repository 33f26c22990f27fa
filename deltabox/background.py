"""The daemon's background nursery, with fault containment."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio

log = logging.getLogger("deltaboxd")


class GuardedNursery:
    """The daemon's background nursery: a failing background task (draining a pipe, reaping
    a helper, deleting a layer) is logged, never allowed to take the daemon down with it."""

    def __init__(self, nursery: trio.Nursery) -> None:
        self.nursery = nursery
        self.cancel_scope = nursery.cancel_scope

    def start_soon(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        async def guarded() -> None:
            try:
                await fn(*args)
            except Exception:
                log.exception("background task %s failed", getattr(fn, "__name__", fn))
        self.nursery.start_soon(guarded, name=getattr(fn, "__qualname__", None))
