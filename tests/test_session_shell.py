"""The session shell's protocol (deltabox/sandbox/session.py) on a real bash."""

from __future__ import annotations

import os
import subprocess
import sys

import trio

from deltabox.sandbox.session import AdoptedShell, Session


def _blocked_reading_stdin(pid: int) -> bool:
    with open(f"/proc/{pid}/syscall", "rb") as f:
        return f.read(16).startswith(b"0 0x0 ")   # read(0, ...)


def test_run_returns_with_the_shell_back_in_its_read() -> None:
    """When run() returns, the shell is blocked reading its next command, so a checkpoint
    taken at once captures it there and a copy restored from it only re-enters that read
    (caught between its last marker and the read, the copy ran on before the inspector
    watched it, and the fork's next checkpoint could not be an alias: a CI flake of
    test_fork_layers). The window is a few microseconds: three CPU hogs on this machine's
    two CPUs deschedule the shell in it a few times in 2000 runs without the wait."""
    bash = subprocess.Popen(["bash", "--noprofile", "--norc"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(3)]
    assert bash.stdin and bash.stdout and bash.stderr
    pipes = [os.dup(f.fileno()) for f in (bash.stdin, bash.stdout, bash.stderr)]
    caught: list[int] = []

    async def main() -> None:
        async with trio.open_nursery() as n:
            session = Session("t")
            session.attach(AdoptedShell(bash.pid, os.pidfd_open(bash.pid),
                                        *(trio.lowlevel.FdStream(fd) for fd in pipes)), n)
            for i in range(2000):
                out = await session.run(f"X={i}", 10)
                assert out.exit_code == 0
                if not _blocked_reading_stdin(bash.pid):
                    caught.append(i)
            assert (await session.run("echo $X", 10)).stdout == b"1999\n"
            await session.close()   # kills bash: its output pumps end

    try:
        trio.run(main)
    finally:
        for p in (*hogs, bash):
            p.kill()
            p.wait()
    assert not caught, f"runs after which the shell was not reading yet: {caught}"
