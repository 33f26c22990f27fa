"""Python's garbage collector, run while the daemon is idle instead of inside its calls.

CPython collects its youngest objects after every 700 net allocations, in whichever thread
allocates: in the daemon, the middle of a checkpoint, a rollback or a fork, each of which
allocates thousands. Measured on this VM with `gc.callbacks` (20 checkpoint + rollback pairs
of the full scenario, then two fork(32)): a young collection about every call, 0.6-1.1 ms
each (cold caches), middle ones of up to 6 ms, and full ones of 45-65 ms over the daemon's
~55,000 objects, about one per fork(32).

So (IdleCollector): the objects alive once the daemon serves (grpc, protobuf, trio, and
bcc's once the inspector has loaded: they live as long as the daemon) are moved out of the
collector's sight (`gc.freeze`); the automatic threshold is raised so that only sustained
load starts a collection inside a call; and the young and middle generations are collected
once no call has run for `quiet_s` (all of them at most every `full_every_s`). With it, the
same loop and forks saw no collection inside a call (before: 25 in 40 calls, 20.5 ms in all,
and 15-17 per fork(32), 8-78 ms). A reference cycle among frozen objects that becomes
garbage stays in memory; they are the daemon's own machinery, made once.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import trio

T = TypeVar("T")

QUIET_S = 0.05            # no call for this long: the daemon is idle
YOUNG_THRESHOLD = 20_000  # automatic young collections under sustained load (CPython: 700)
FULL_EVERY_S = 60.0


class IdleCollector:
    """Counts the calls in progress (in the trio thread) and collects when they stop."""

    def __init__(self, quiet_s: float = QUIET_S, threshold: int = YOUNG_THRESHOLD,
                 full_every_s: float = FULL_EVERY_S) -> None:
        self.quiet_s = quiet_s
        self.threshold = threshold
        self.full_every_s = full_every_s
        self.calls = 0                # in progress
        self.collections = 0          # made while idle
        self._ended = trio.Event()    # the last call in progress ended
        self._last_end = 0.0          # when a call last ended (time.monotonic)
        self._last_full = time.monotonic()
        self._freeze = False          # freeze at the next idle collection

    def install(self) -> None:
        """Freeze what is alive now and raise the automatic threshold (at start-up)."""
        self.freeze()
        _, middle, old = gc.get_threshold()
        gc.set_threshold(self.threshold, middle, old)

    @staticmethod
    def freeze() -> None:
        """Collect, then keep every object alive now out of later collections."""
        gc.collect()
        gc.freeze()

    def freeze_soon(self) -> None:
        """`freeze` once the daemon is next idle (a full collection takes ~40 ms here): after
        a step that made long-lived objects while it serves, such as loading the inspector."""
        self._freeze = True
        if not self.calls:
            self._ended.set()

    async def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run one call's work, counted as in progress."""
        self.calls += 1
        try:
            return await fn(*args)
        finally:
            self.calls -= 1
            self._last_end = time.monotonic()
            if not self.calls:
                self._ended.set()

    async def quiet(self, at_most: float) -> None:
        """Return once no call has run for `quiet_s`, or after `at_most` seconds whatever
        the load: for background work that had better not share the CPU with a client's
        calls (fork spares: spares.py), but must not wait for ever either."""
        with trio.move_on_after(at_most):
            while self.calls or (left := self._last_end + self.quiet_s - time.monotonic()) > 0:
                await trio.sleep(self.quiet_s if self.calls else left)

    async def run(self) -> None:
        """Forever: `quiet_s` after the last call ended, unless another began meanwhile,
        collect."""
        while True:
            await self._ended.wait()
            self._ended = trio.Event()
            await trio.sleep(self.quiet_s)
            if self.calls or self._ended.is_set():  # not idle yet: wait for the next end
                continue
            self.collect()

    def collect(self) -> None:
        now = time.monotonic()
        if self._freeze:
            self._freeze = False
            self.freeze()
            self._last_full = now
        elif now - self._last_full >= self.full_every_s:
            gc.collect()
            self._last_full = now
        else:
            gc.collect(1)
        self.collections += 1
