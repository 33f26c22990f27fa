"""The host-wide scheduler of background checkpoint I/O.

A checkpoint, rollback or fork returns as soon as the state is captured; what remains (warm
clones and mounts for the next rollback, freeing retired layers, process dumps) runs in the
background, while agents think. Across all sandboxes at most `slots` such jobs run at once,
so a burst of checkpoints cannot flood the disk under the foreground. A foreground operation
that depends on one of them waits for exactly that job (`wait(key)`), never for the queue.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TypeVar

import trio

T = TypeVar("T")


class IOScheduler:
    def __init__(self, slots: int = 2) -> None:
        self.limiter = trio.CapacityLimiter(slots)
        self._pending: dict[str, list[trio.Event]] = {}
        self.done = 0          # jobs finished (for `deltabox info`-style reporting and tests)

    @property
    def running(self) -> int:
        return self.limiter.borrowed_tokens

    @property
    def queued(self) -> int:
        return self.limiter.statistics().tasks_waiting

    @asynccontextmanager
    async def slot(self, key: str) -> AsyncIterator[None]:
        """Hold one of the slots for a job producing `key` (waits for a free slot)."""
        ev = trio.Event()
        self._pending.setdefault(key, []).append(ev)
        try:
            async with self.limiter:
                yield
        finally:
            self.done += 1
            waiters = self._pending.get(key, [])
            if ev in waiters:
                waiters.remove(ev)
            if not waiters:
                self._pending.pop(key, None)
            ev.set()

    async def run(self, key: str, fn: Callable[..., T], *args: object) -> T:
        """Run the blocking `fn(*args)` in a worker thread when a slot is free. `key` names
        what it reads or produces (e.g. the layer it clones), for `wait`."""
        async with self.slot(key):
            return await trio.to_thread.run_sync(fn, *args)

    def busy(self, key: str) -> bool:
        return bool(self._pending.get(key))

    async def wait(self, key: str) -> None:
        """Until every job for `key` queued so far has finished."""
        for ev in list(self._pending.get(key, [])):
            await ev.wait()
