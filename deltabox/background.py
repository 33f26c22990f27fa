"""The daemon's background nursery, with fault containment."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import trio

log = logging.getLogger("deltaboxd")


async def run_all(calls: Iterable[Callable[[], Awaitable[Any]]]) -> None:
    """Run `calls` concurrently, each to its end (none is cancelled because another failed:
    no step is left half-done), then raise the first error as itself -- not as an exception
    group, so that it maps to its gRPC status."""
    errors: list[Exception] = []

    async def one(fn: Callable[[], Awaitable[Any]]) -> None:
        try:
            await fn()
        except Exception as e:
            errors.append(e)

    async with trio.open_nursery() as n:
        for fn in calls:
            n.start_soon(one, fn)
    if errors:
        raise errors[0]


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

    async def start(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """`Nursery.start`: return once `fn` calls `task_status.started()`; it goes on in
        the background, guarded as in `start_soon`."""
        async def guarded(task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED) -> None:
            try:
                await fn(*args, task_status=task_status)
            except Exception:
                log.exception("background task %s failed", getattr(fn, "__name__", fn))
        return await self.nursery.start(guarded, name=getattr(fn, "__qualname__", None))
