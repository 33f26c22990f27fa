"""The one thread that traces sandbox processes.

ptrace binds a tracee to the *thread* that attached it: every later request (inject, template,
spawn, release) must come from that same OS thread, and trio's worker threads are
interchangeable. So DeltaCR owns one dedicated thread for its whole life, started and joined by
the daemon's nursery (`async with PtraceWorker() as w`), and trio code awaits jobs on it.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import outcome
import trio

T = TypeVar("T")
_STOP = object()


class PtraceWorker:
    def __init__(self, name: str = "deltabox-ptrace") -> None:
        self.name = name
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._active = 0   # jobs queued or running (trio thread only)

    @property
    def queued(self) -> int:
        """Jobs queued or running (trio thread only)."""
        return self._active

    @property
    def busy(self) -> bool:
        """Some job is queued or running: optional work (warm.py) had better wait."""
        return self._active > 0

    async def __aenter__(self) -> PtraceWorker:
        self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
        self._thread.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._jobs.put(_STOP)
        assert self._thread is not None
        await trio.to_thread.run_sync(self._thread.join)

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is _STOP:
                return
            fn, args, token, done = job
            result = outcome.capture(fn, *args)
            # Hand the result over without waiting for trio to take it: the next job (e.g.
            # another fork child's spawn, queued meanwhile) starts at once, while the trio
            # thread prepares more.
            try:
                token.run_sync_soon(done, result)
            except trio.RunFinishedError:
                pass

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run fn(*args) on the ptrace thread and return its result (or raise its error).

        Not cancellable once queued: a half-done ptrace operation must finish or undo itself
        on its thread, never be abandoned."""
        if self._thread is None:
            raise RuntimeError("PtraceWorker is not running")
        result: list[outcome.Outcome] = []
        event = trio.Event()

        def done(r: outcome.Outcome) -> None:
            self._active -= 1
            result.append(r)
            event.set()

        self._active += 1
        self._jobs.put((fn, args, trio.lowlevel.current_trio_token(), done))
        with trio.CancelScope(shield=True):
            await event.wait()
        return result[0].unwrap()
