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


def test_an_urgent_groups_jobs_take_the_next_slots_before_earlier_ones() -> None:
    """A restore waiting for a process dump marks that dump's sandbox urgent: its queued
    I/O goes before every job queued earlier (32 sandboxes' dumps made a restore wait
    10-48 s behind them); the rest keep their order."""
    io = IOScheduler(slots=1)
    hold = threading.Event()
    order: list[str] = []

    def job(name: str) -> None:
        order.append(name)

    async def main() -> None:
        async with trio.open_nursery() as n:
            n.start_soon(io.run, "first", hold.wait, 10)  # bounded: a failure ends
            await trio.sleep(0.01)
            for name, group in [("a1", "a"), ("b1", "b"), ("a2", "a"), ("c1", "c"),
                                ("b2", "b")]:
                async def one(name: str = name, group: str = group) -> None:
                    async with io.slot(name, group=group):
                        await trio.to_thread.run_sync(job, name)
                n.start_soon(one)
                await trio.sleep(0.01)
            assert io.queued == 5 and io.running == 1
            with io.urgent("b"):
                hold.set()
                await io.wait("b2")
            assert order == ["b1", "b2"]   # before a1, a2, c1, queued earlier
            order.append("b done")
        assert io.jumped == 2

    trio.run(main)
    assert order == ["b1", "b2", "b done", "a1", "a2", "c1"]
    assert io.running == 0 and io.queued == 0


def test_a_job_cancelled_in_the_queue_leaves_it_and_frees_no_slot() -> None:
    """A job cancelled while it waits for a slot (its checkpoint deleted, the daemon
    stopping) leaves the queue; the slots still admit exactly `slots` jobs."""
    io = IOScheduler(slots=1)
    hold = threading.Event()
    ran: list[str] = []

    async def main() -> None:
        async with trio.open_nursery() as n:
            n.start_soon(io.run, "first", hold.wait, 10)  # bounded: a failure ends
            await trio.sleep(0.01)
            scope = trio.CancelScope()

            async def doomed() -> None:
                with scope:
                    await io.run("doomed", ran.append, "doomed")
            n.start_soon(doomed)
            await trio.sleep(0.01)
            n.start_soon(io.run, "next", ran.append, "next")
            await trio.sleep(0.01)
            assert io.queued == 2
            scope.cancel()
            await trio.sleep(0.01)
            assert io.queued == 1 and io.running == 1 and not io.busy("doomed")
            hold.set()

    trio.run(main)
    assert ran == ["next"] and io.running == 0 and io.queued == 0
