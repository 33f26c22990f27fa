"""Persistent named bash sessions: cwd, environment, variables, functions and jobs persist.

The daemon keeps one `bash --noprofile --norc` per session reading commands from a pipe. Each
run sends the command as a quoted here-document (so no quoting of the command is needed and a
syntax error in it cannot swallow what follows), evaluates it in the shell itself with stdin
from /dev/null, then prints a per-run random marker with the exit status on stdout and one on
stderr. Output up to the markers is the command's.
"""

from __future__ import annotations

import secrets
import subprocess
import time

import trio

from ..background import GuardedNursery

from .execute import OUTPUT_LIMIT, ExecOutput, _terminate, exit_code
from .runtime import Runtime

_TAIL = 512


class _Stream:
    """One output stream of the shell, split into per-command pieces by markers."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.reset(b"")
        self.eof = trio.Event()

    def reset(self, marker: bytes) -> None:
        self.marker = marker
        self.head = bytearray()
        self.tail = b""
        self.total = 0
        self.found = trio.Event()

    def feed(self, data: bytes) -> None:
        if len(self.head) < self.limit:
            self.head += data[:self.limit - len(self.head)]
        self.total += len(data)
        self.tail = (self.tail + data)[-_TAIL:]
        if self.marker and self.marker in self.tail:
            self.found.set()

    def result(self) -> tuple[bytes, bool, bytes]:
        """(output before the marker, truncated, what follows the marker)."""
        buf = bytes(self.head)
        i = buf.find(self.marker) if self.marker else -1
        if i >= 0:
            return buf[:i], False, buf[i + len(self.marker):]
        j = self.tail.find(self.marker) if self.marker else -1
        return buf, True, self.tail[j + len(self.marker):] if j >= 0 else b""


async def _pump(stream: trio.abc.ReceiveStream, target: _Stream) -> None:
    try:
        while data := await stream.receive_some(65536):
            target.feed(data)
    except (trio.ClosedResourceError, trio.BrokenResourceError):
        pass
    finally:
        target.eof.set()


class Session:
    """A bash shell living in the sandbox; `run` is serialized per session."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.proc: trio.Process | None = None
        self.lock = trio.Lock()
        self.out = _Stream(OUTPUT_LIMIT)
        self.err = _Stream(OUTPUT_LIMIT)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def start(self, rt: Runtime, env: dict[str, str], background: GuardedNursery) -> None:
        argv = ["bash", "--noprofile", "--norc"]
        self.proc = await trio.lowlevel.open_process(
            rt.enter_argv(argv, "/workspace", env), stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=rt.pass_fds)
        self.out, self.err = _Stream(OUTPUT_LIMIT), _Stream(OUTPUT_LIMIT)
        assert self.proc.stdout is not None and self.proc.stderr is not None
        background.start_soon(_pump, self.proc.stdout, self.out)
        background.start_soon(_pump, self.proc.stderr, self.err)

    async def run(self, command: str, timeout: float | None) -> ExecOutput:
        assert self.proc is not None and self.proc.stdin is not None
        t0 = time.perf_counter()
        nonce = secrets.token_hex(8)
        rc_marker = f"\n__DBX_{nonce}_RC=".encode()
        self.out.reset(rc_marker)
        self.err.reset(f"\n__DBX_{nonce}_END\n".encode())
        script = (f"IFS= read -r -d '' __dbx_cmd <<'__DBX_EOF_{nonce}'\n{command}\n"
                  f"__DBX_EOF_{nonce}\n"
                  'eval "$__dbx_cmd" </dev/null\n'
                  f"printf '\\n__DBX_{nonce}_RC=%d\\n' $?\n"
                  f"printf '\\n__DBX_{nonce}_END\\n' >&2\n")
        try:
            await self.proc.stdin.send_all(script.encode())
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the shell is gone; reported below from its exit status
        timed_out = False
        with trio.move_on_after(timeout if timeout else float("inf")) as scope:
            await self._wait_markers()
        if scope.cancelled_caught:
            timed_out = True
            await self.close()
        stdout, out_trunc, rest = self.out.result()
        stderr, err_trunc, _ = self.err.result()
        if self.out.found.is_set():
            code = int(rest.split(b"\n", 1)[0] or b"0")
        else:  # the shell exited (e.g. `exit 3`) or was killed
            await self.close()
            assert self.proc is not None
            code = exit_code(self.proc)
        return ExecOutput(code, stdout, stderr, (time.perf_counter() - t0) * 1000, timed_out,
                          out_trunc and self.out.total > self.out.limit,
                          err_trunc and self.err.total > self.err.limit)

    async def _wait_markers(self) -> None:
        """Both markers, or the shell's end (whichever first)."""
        async with trio.open_nursery() as n:
            async def markers() -> None:
                await self.out.found.wait()
                await self.err.found.wait()
                n.cancel_scope.cancel()

            async def shell_end() -> None:
                await self.out.eof.wait()
                await self.err.eof.wait()
                n.cancel_scope.cancel()

            n.start_soon(markers)
            n.start_soon(shell_end)

    async def close(self) -> None:
        """Kill the shell and every job in its process group."""
        if self.proc is None:
            return
        if self.proc.stdin is not None:
            with trio.CancelScope(shield=True):
                await self.proc.stdin.aclose()
        with trio.CancelScope(shield=True):
            await _terminate(self.proc)


__all__ = ["Session"]
