"""The host-wide background I/O scheduler: bounded concurrency, and waiting for exactly the
job one depends on."""

from __future__ import annotations

import threading
import time

import trio

from deltabox.daemon.scheduler import IOScheduler


def test_at_most_slots_jobs_run_at_once() -> None:
    io = IOScheduler(slots=2)
    lock = threading.Lock()
    now = peak = 0

    def job() -> None:
        nonlocal now, peak
        with lock:
            now += 1
            peak = max(peak, now)
        time.sleep(0.05)
        with lock:
            now -= 1

    async def main() -> None:
        async with trio.open_nursery() as n:
            for i in range(6):
                n.start_soon(io.run, f"k{i}", job)

    trio.run(main)
    assert peak == 2 and io.done == 6 and io.running == 0


def test_wait_is_for_that_key_only() -> None:
    io = IOScheduler(slots=2)
    release_slow = threading.Event()
    order: list[str] = []

    async def main() -> None:
        async with trio.open_nursery() as n:
            n.start_soon(io.run, "slow", release_slow.wait)
            n.start_soon(io.run, "fast", time.sleep, 0.05)
            await trio.sleep(0.01)
            assert io.busy("fast") and io.busy("slow")
            await io.wait("fast")            # does not wait for "slow"
            order.append("fast done")
            assert io.busy("slow")
            release_slow.set()
            await io.wait("slow")
            order.append("slow done")
            assert not io.busy("slow")
            await io.wait("never-queued")    # nothing pending: returns at once

    trio.run(main)
    assert order == ["fast done", "slow done"]
