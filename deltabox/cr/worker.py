"""The one thread that traces sandbox processes.

ptrace binds a tracee to the *thread* that attached it: every later request (inject, template,
spawn, release) must come from that same OS thread, and trio's worker threads are
interchangeable. So DeltaCR owns one dedicated thread for its whole life, started and joined by
the daemon's nursery (`async with PtraceWorker() as w`), and trio code awaits jobs on it.

The thread waits for jobs in native code (native.JobQueue) with the interpreter's lock
released: a Python job costs it that lock, taken from the trio thread, and the trio thread a
wake-up through its own queue to learn the result (0.2-0.4 ms each way on these VMs), while
a rollback's births (`births`) run there at once, without the interpreter, their end an
eventfd the trio thread polls.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import outcome
import trio

from . import native

T = TypeVar("T")
_STOP = object()
log = logging.getLogger("deltaboxd")


def _queue_failed(name: str, error: native.CRError) -> NoReturn:
    """In the trio loop: raising here ends the run (trio.TrioInternalError)."""
    msg = f"{name}: the ptrace thread's job queue failed: {error}"
    log.critical("%s; stopping (a restarted deltaboxd recovers every committed checkpoint)",
                 msg)
    raise RuntimeError(msg) from error


class PtraceWorker:
    def __init__(self, name: str = "deltabox-ptrace") -> None:
        self.name = name
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._queue: native.JobQueue | None = None   # wakes the thread: one post per job
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
        self._queue = native.JobQueue()
        self._thread = threading.Thread(
            target=self._loop, args=(self._queue, trio.lowlevel.current_trio_token()),
            name=self.name, daemon=True)
        self._thread.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._thread is not None and self._queue is not None
        self._post(_STOP)
        await trio.to_thread.run_sync(self._thread.join)
        self._queue.close()

    def _post(self, job: Any) -> None:
        """Queue a Python job. The marker goes first: if it cannot be posted, nothing is
        queued (the thread, woken by it, waits on the Python queue for the job)."""
        assert self._queue is not None
        self._queue.post(None)
        self._jobs.put(job)

    def _loop(self, jobs: native.JobQueue, loop: trio.lowlevel.TrioToken) -> None:
        while True:
            try:
                jobs.wait()   # runs the births posted meanwhile; returns at a Python job
            except native.CRError as e:
                # The queue itself failed (a bug, not a job's error): nothing runs on this
                # thread any more and every caller would wait for ever. Crash the trio run
                # loudly instead: a restarted daemon recovers every committed checkpoint.
                with contextlib.suppress(trio.RunFinishedError):
                    loop.run_sync_soon(_queue_failed, self.name, e)
                return
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
        try:
            self._post((fn, args, trio.lowlevel.current_trio_token(), done))
        except BaseException:
            self._active -= 1
            raise
        with trio.CancelScope(shield=True):
            await event.wait()
        return result[0].unwrap()

    async def births(self, jobs: list[tuple[native.Carrier, int | None, int]],
                     victims: list[int], timeout: float) -> list[int | native.CRError]:
        """Each (carrier, pid to take or None, pgid) gives birth once on the ptrace thread,
        in native code (native.Births: no interpreter on that thread, no trip through
        trio's queue back), those taking a pid once the processes behind the pidfds
        `victims` have exited (or `timeout` passed). In the order of jobs posted before.
        Each one's born pid or CRError. Not cancellable once posted, as run."""
        if self._thread is None or self._queue is None:
            raise RuntimeError("PtraceWorker is not running")
        done = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        try:
            job = native.Births(jobs, victims, timeout, done)
            self._active += 1
            try:
                self._queue.post(job)
                with trio.CancelScope(shield=True):
                    await trio.lowlevel.wait_readable(done)
            finally:
                self._active -= 1
            return job.outcomes()
        finally:
            os.close(done)
