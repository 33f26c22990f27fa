"""The work a rollback leaves behind waits for the command the agent runs next
(deltabox/daemon/foreground.py): on two CPUs it had run during that command and slowed it.
Real daemon and store; what the daemon did when is read from its debug log (the warm pool's
read-ahead is the last step of preparing the next rollback)."""

from __future__ import annotations

import threading

import trio
from conftest import new_sandbox, private_daemon, wait_for

from deltabox.daemon.foreground import Foreground

PREPARED = "read ahead for"   # warm.py: logged once per ready generation made


def test_the_next_rollback_is_prepared_after_the_command_not_during_it() -> None:
    with private_daemon("dbx-quiet-") as d:
        d.start("--no-inspector", "--log-level", "DEBUG", "--quiet-wait-ms", "1500")
        prepared = lambda: d.log.read_text().count(PREPARED)  # noqa: E731
        with new_sandbox(d.socket) as sbx:
            sh = sbx.session("main")
            assert sh.run("echo 1 > /root/f && X=kept").exit_code == 0
            cp = sbx.checkpoint()
            wait_for(lambda: prepared() == 1, timeout=30, what="the first ready generation")

            # A step in one call: the rollback, then at once the command (no client round
            # trip in between that the preparation's own short delay must cover).
            done: list[object] = []
            step = threading.Thread(target=lambda: done.append(
                sh.run("sleep 0.8; echo $X", rollback_to=cp)))
            step.start()
            step.join(0.6)
            assert step.is_alive() and prepared() == 1, \
                "the next rollback was prepared while the command after the rollback ran"
            step.join()
            assert done[0].stdout == "kept\n" and done[0].rollback is not None
            wait_for(lambda: prepared() == 2, timeout=10,
                     what="the next rollback prepared once the command ended")

            # A longer command does not hold it back for longer than --quiet-wait-ms.
            step = threading.Thread(target=lambda: sh.run("sleep 4", rollback_to=cp))
            step.start()
            try:
                wait_for(lambda: prepared() == 3, timeout=3.5,
                         what="the next rollback prepared during a long command")
                assert step.is_alive()
            finally:
                step.join()
            # and the sandbox is the checkpoint's after all of it
            assert sh.run("cat /root/f; echo $X").stdout == "1\nkept\n"


def test_quiet_waits_for_every_command_of_that_sandbox_only() -> None:
    async def main() -> None:
        fg = Foreground(cap=5)
        log: list[str] = []

        async def background(sid: str) -> None:
            await fg.quiet(sid)
            log.append(f"{sid} quiet")

        async with trio.open_nursery() as nursery:
            with fg.command("a"):
                with fg.command("a"):
                    nursery.start_soon(background, "a")
                    nursery.start_soon(background, "b")   # not running anything
                    await trio.sleep(0.05)
                    assert log == ["b quiet"]
                await trio.sleep(0.05)
                assert log == ["b quiet"] and fg.busy("a")   # one command still runs
                log.append("a ends")
            await trio.sleep(0.05)
            assert log == ["b quiet", "a ends", "a quiet"] and not fg.busy("a")

    trio.run(main)


def test_quiet_gives_up_after_its_cap_and_zero_turns_it_off() -> None:
    async def main() -> None:
        for cap, waited in ((0.2, 0.2), (0, 0.0)):
            fg = Foreground(cap=cap)
            with fg.command("a"):
                t0 = trio.current_time()
                await fg.quiet("a")
                assert abs((trio.current_time() - t0) - waited) < 0.1
                assert fg.busy("a")

    trio.run(main)
