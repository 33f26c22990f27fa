"""run_all: the daemon's way to run steps concurrently and report a failure as itself."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from deltabox.background import run_all
from deltabox.errors import ResourceExhausted


def test_run_all_raises_the_first_error_as_itself_after_every_call_ended() -> None:
    ended: list[str] = []

    async def slow() -> None:
        await trio.sleep(0.05)  # still running when the other fails: not cancelled
        ended.append("slow")

    async def full() -> None:
        raise ResourceExhausted("no space left on the store")

    async def main() -> None:
        await run_all([slow, full])

    # a plain trio nursery would raise an ExceptionGroup here (INTERNAL at the API)
    with pytest.raises(ResourceExhausted, match="no space"):
        trio.run(main)
    assert ended == ["slow"]


def test_run_all_runs_calls_concurrently() -> None:
    async def main() -> float:
        t0 = trio.current_time()
        await run_all([lambda: trio.sleep(0.2) for _ in range(5)])
        return trio.current_time() - t0

    # virtual time (the clock jumps when all tasks sleep): 0.2 s together, 1.0 s in a row
    assert trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0)) == \
        pytest.approx(0.2)
