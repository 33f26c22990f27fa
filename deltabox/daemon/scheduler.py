"""The host-wide scheduler of background checkpoint I/O.

A checkpoint, rollback or fork returns as soon as the state is captured; what remains (warm
clones and mounts for the next rollback, freeing retired layers, process dumps) runs in the
background, while agents think. Across all sandboxes at most `slots` such jobs run at once,
so a burst of checkpoints cannot flood the disk under the foreground. A foreground operation
that depends on one of them waits for exactly that job (`wait(key)`), never for the queue:
the jobs of a group someone waits for (`urgent(group)`) take the next free slot before any
other queued job. Behind a backlog of process dumps, a restore waiting for one dump waited
for every job queued before it, whichever sandbox's (10-48 s in a 32 x 1000 soak).
"""

from __future__ import annotations

import collections
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import TypeVar

import trio

T = TypeVar("T")


@dataclass
class _Waiter:
    group: str
    granted: bool = False
    event: trio.Event = field(default_factory=trio.Event)


class IOScheduler:
    def __init__(self, slots: int = 2) -> None:
        self.slots = slots
        self._running = 0
        self._queue: collections.deque[_Waiter] = collections.deque()   # FIFO
        self._urgent: collections.Counter[str] = collections.Counter()   # group -> waiters
        self._pending: dict[str, list[trio.Event]] = {}
        self.done = 0          # jobs finished (for `deltabox info`-style reporting and tests)
        self.jumped = 0        # jobs that took a slot ahead of earlier ones (urgent)

    @property
    def running(self) -> int:
        return self._running

    @property
    def queued(self) -> int:
        return len(self._queue)

    @contextmanager
    def urgent(self, group: str) -> Iterator[None]:
        """While inside, the jobs of `group` (queued or still to come) go before the others:
        a foreground operation is waiting for them."""
        self._urgent[group] += 1
        try:
            yield
        finally:
            self._urgent[group] -= 1
            if self._urgent[group] <= 0:
                del self._urgent[group]

    @asynccontextmanager
    async def slot(self, key: str, group: str | None = None) -> AsyncIterator[None]:
        """Hold one of the slots for a job producing `key` (waits for a free slot). group
        (default: key) is what `urgent` names to let it go first."""
        ev = trio.Event()
        self._pending.setdefault(key, []).append(ev)
        try:
            await self._acquire(key if group is None else group)
            try:
                yield
            finally:
                self._release()
        finally:
            self.done += 1
            waiters = self._pending.get(key, [])
            if ev in waiters:
                waiters.remove(ev)
            if not waiters:
                self._pending.pop(key, None)
            ev.set()

    async def _acquire(self, group: str) -> None:
        await trio.lowlevel.checkpoint_if_cancelled()
        if self._running < self.slots and not self._queue:
            self._running += 1
            await trio.lowlevel.cancel_shielded_checkpoint()
            return
        w = _Waiter(group)
        self._queue.append(w)
        try:
            await w.event.wait()
        except BaseException:
            if w.granted:          # handed a slot as it was cancelled: pass it on
                self._release()
            else:
                self._queue.remove(w)
            raise

    def _release(self) -> None:
        """Free a slot: to the first queued job of an urgent group, else the first one."""
        self._running -= 1
        if self._running >= self.slots or not self._queue:
            return
        w = next((w for w in self._queue if w.group in self._urgent), None)
        if w is None:
            w = self._queue[0]
        elif w is not self._queue[0]:
            self.jumped += 1
        self._queue.remove(w)
        self._running += 1
        w.granted = True
        w.event.set()

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
