"""One-shot commands inside a sandbox, with captured or streamed output.

The command's exit ends the call, as with `docker exec`: a background job it left behind may
still hold the output pipes, so after the exit we take what is already buffered and keep
draining the pipes in the background (discarding), so the job is never hit by SIGPIPE.
"""

from __future__ import annotations

import fcntl
import signal
import subprocess
import sys
import termios
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import trio

from ..background import GuardedNursery

from .runtime import HELPER_ENV, Runtime

# How long, after the command exits, we wait for its output pipes to reach EOF before
# assuming a background job holds them.
EXIT_GRACE_S = 0.02
DRAIN_LIMIT_S = 5.0   # at most this long reading what an exited command left in its pipes
OUTPUT_LIMIT = 64 << 20

ChunkSink = Callable[[str, bytes], None]  # ("stdout" | "stderr", data)


@dataclass
class ExecOutput:
    exit_code: int
    stdout: bytes
    stderr: bytes
    duration_ms: float
    timed_out: bool = False
    stdout_truncated: bool = False
    stderr_truncated: bool = False


class Capture:
    """Collects one stream up to a limit; after `detach()` it only discards."""

    def __init__(self, name: str, limit: int, sink: ChunkSink | None) -> None:
        self.name = name
        self.limit = limit
        self.sink = sink
        self.buf = bytearray()
        self.truncated = False
        self.attached = True
        self.eof = trio.Event()
        self.fd = -1           # our end of the pipe (for FIONREAD), set by spawn

    def feed(self, data: bytes) -> None:
        if not self.attached:
            return
        room = self.limit - len(self.buf)
        if len(data) > room:
            self.truncated = True
            data = data[:max(room, 0)]
        self.buf += data
        if self.sink and data:
            self.sink(self.name, data)

    def detach(self) -> bytes:
        self.attached = False
        return bytes(self.buf)


async def pump(stream: trio.abc.ReceiveStream, cap: Capture) -> None:
    """Read a pipe to EOF into a capture (closing our end only at EOF)."""
    try:
        while True:
            try:
                data = await stream.receive_some(65536)
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                break
            if not data:
                break
            cap.feed(data)
    finally:
        cap.eof.set()
        await stream.aclose()


async def feed_stdin(stream: trio.abc.SendStream, data: bytes) -> None:
    try:
        if data:
            await stream.send_all(data)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass  # the command did not read all of its input
    finally:
        await stream.aclose()


@dataclass
class Running:
    proc: trio.Process
    out: Capture
    err: Capture
    t0: float


async def spawn(rt: Runtime, argv: list[str], *, cwd: str, env: dict[str, str], stdin: bytes,
                background: GuardedNursery, sink: ChunkSink | None = None,
                limit: int = OUTPUT_LIMIT) -> Running:
    """Start argv in the sandbox. Output pumps live in the daemon's background nursery:
    they may outlive the call (a background job holding the pipes)."""
    t0 = time.perf_counter()
    proc = await trio.lowlevel.open_process(
        rt.enter_argv(argv, cwd, env),
        stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=rt.pass_fds,
        env=HELPER_ENV)
    assert proc.stdout is not None and proc.stderr is not None
    out, err = Capture("stdout", limit, sink), Capture("stderr", limit, sink)
    out.fd, err.fd = proc.stdout.fileno(), proc.stderr.fileno()
    background.start_soon(pump, proc.stdout, out)
    background.start_soon(pump, proc.stderr, err)
    if stdin and proc.stdin is not None:
        background.start_soon(feed_stdin, proc.stdin, stdin)
    return Running(proc, out, err, t0)


# Kills the command that dbx-enter (its host pid) runs, with its process group but the
# daemon's stopped processes there (Live.kill_command); False if no command is found.
CommandKiller = Callable[[int], Awaitable[bool]]


async def wait(r: Running, timeout: float | None,
               kill_command: CommandKiller | None = None) -> ExecOutput:
    """Wait for the command to exit, or kill it (and its process group, but the templates
    there: kill_command) at the timeout."""
    timed_out = False
    try:
        with trio.move_on_after(timeout if timeout else float("inf")) as scope:
            await r.proc.wait()
        if scope.cancelled_caught:
            timed_out = True
            await _take_down(r.proc, kill_command)
    except BaseException:
        # Our caller was cancelled (client went away, daemon stopping): take the command down.
        with trio.CancelScope(shield=True):
            await _take_down(r.proc, kill_command)
        r.out.detach()
        r.err.detach()
        raise
    with trio.move_on_after(EXIT_GRACE_S):
        await r.out.eof.wait()
        await r.err.eof.wait()
    # A background job may hold the pipes open (no EOF); but all the command wrote is in
    # them once it exited: let the pumps read it before we detach (under load they may not
    # have run yet; the soak benchmark lost output without this).
    deadline = trio.current_time() + DRAIN_LIMIT_S
    for cap in (r.out, r.err):
        while not cap.eof.is_set() and _unread(cap.fd) and trio.current_time() < deadline:
            await trio.sleep(0.001)
    return ExecOutput(exit_code(r.proc), r.out.detach(), r.err.detach(), (time.perf_counter() - r.t0) * 1000,
                      timed_out, r.out.truncated, r.err.truncated)


def _unread(fd: int) -> int:
    """Bytes waiting in a pipe (0 if it is closed meanwhile)."""
    buf = bytearray(4)
    try:
        fcntl.ioctl(fd, termios.FIONREAD, buf)
    except OSError:
        return 0
    return int.from_bytes(buf, sys.byteorder)


def exit_code(proc: trio.Process) -> int:
    """Shell convention: the exit status, or 128+N when killed by signal N."""
    rc = proc.returncode
    if rc is None:
        return -1
    return 128 - rc if rc < 0 else rc


async def _take_down(helper: trio.Process, kill_command: CommandKiller | None) -> None:
    """Kill the command dbx-enter `helper` runs with its process group, then end `helper`.
    A checkpoint taken while the command ran made templates of its processes, some in its
    group: kill_command spares them, where dbx-enter's own group kill would not."""
    if kill_command is not None and await kill_command(helper.pid):
        await end_helper(helper)
    else:
        await _terminate(helper)


async def end_helper(helper: trio.Process) -> None:
    """End dbx-enter once its command's group was killed: it exits with its command, or
    by SIGKILL, which it cannot turn into a group kill (its SIGTERM would be one)."""
    with trio.move_on_after(2):
        await helper.wait()
    if helper.returncode is None:
        helper.kill()
        await helper.wait()


async def _terminate(proc: trio.Process) -> None:
    """dbx-enter turns SIGTERM into SIGKILL of the command's whole process group."""
    if proc.returncode is None:
        try:
            proc.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass
    with trio.move_on_after(2):
        await proc.wait()
    if proc.returncode is None:
        proc.kill()
        await proc.wait()
