"""The daemon's garbage collection: between calls, not inside them, and nothing left behind
(deltabox/daemon/idlegc.py). Real collections of this test process's garbage."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest
import trio

from deltabox.daemon.idlegc import IdleCollector


class Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic collector frees it


@pytest.fixture
def collector() -> Iterator[IdleCollector]:
    saved = gc.get_threshold()
    # threshold far out of reach: in this test only the idle collection may run
    c = IdleCollector(quiet_s=0.05, threshold=10**9)
    c.install()
    try:
        yield c
    finally:
        gc.unfreeze()
        gc.set_threshold(*saved)


def test_install_freezes_what_is_alive_and_raises_the_threshold(
        collector: IdleCollector) -> None:
    assert gc.get_freeze_count() > 0
    assert gc.get_threshold()[0] == 10**9


def test_cyclic_garbage_of_a_call_is_freed_once_the_daemon_is_idle(
        collector: IdleCollector) -> None:
    seen: dict[str, bool] = {}

    async def handler() -> weakref.ref[Node]:
        return weakref.ref(Node())  # garbage as soon as the call returns

    async def main() -> None:
        async with trio.open_nursery() as n:
            n.start_soon(collector.run)
            ref = await collector.call(handler)
            await trio.sleep(0.01)  # not yet quiet for long enough
            seen["alive_right_after"] = ref() is not None
            await trio.sleep(0.2)
            seen["alive_once_idle"] = ref() is not None
            n.cancel_scope.cancel()

    trio.run(main)
    assert seen == {"alive_right_after": True, "alive_once_idle": False}
    assert collector.collections == 1


def test_no_collection_while_a_call_is_in_progress(collector: IdleCollector) -> None:
    refs: list[weakref.ref[Node]] = []
    during: list[int] = []

    async def short() -> None:
        refs.append(weakref.ref(Node()))

    async def long() -> None:
        await trio.sleep(0.3)  # the short call ends, and 0.05 s pass, meanwhile
        during.append(collector.collections)

    async def main() -> None:
        async with trio.open_nursery() as n:
            n.start_soon(collector.run)
            async with trio.open_nursery() as calls:
                calls.start_soon(collector.call, long)
                await trio.sleep(0.01)
                calls.start_soon(collector.call, short)
            await trio.sleep(0.2)
            n.cancel_scope.cancel()

    trio.run(main)
    assert during == [0]              # nothing collected inside the long call
    assert collector.collections == 1  # once both had ended
    assert refs[0]() is None


def test_a_freeze_asked_for_while_serving_waits_for_idle(collector: IdleCollector) -> None:
    frozen: dict[str, int] = {}

    async def call() -> None:
        collector.freeze_soon()  # e.g. the inspector loaded while this call runs
        Node()
        await trio.sleep(0.1)
        frozen["during"] = gc.get_freeze_count()

    async def main() -> None:
        async with trio.open_nursery() as n:
            n.start_soon(collector.run)
            await collector.call(call)
            await trio.sleep(0.2)
            frozen["after"] = gc.get_freeze_count()
            n.cancel_scope.cancel()

    before = gc.get_freeze_count()
    trio.run(main)
    assert frozen["during"] == before   # not inside the call
    assert frozen["after"] > before     # at the next idle moment
