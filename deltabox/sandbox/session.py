"""Persistent named bash sessions: cwd, environment, variables, functions and jobs persist.

The daemon keeps one `bash --noprofile --norc` per session reading commands from a pipe. Each
run sends the command as a quoted here-document (so no quoting of the command is needed and a
syntax error in it cannot swallow what follows), evaluates it in the shell itself with stdin
from /dev/null, then prints a per-run random marker with the exit status on stdout and one on
stderr. Output up to the markers is the command's. A run returns once the shell is blocked in
the read of its next command again (Session._settle), the state a checkpoint should find it in.

After each command the shell also reports its own state on stderr, between a state marker
and the end marker: variables, functions, aliases, options, traps, umask, limits, directory
stack and jobs, all from builtins (no process is started). The daemon keeps a digest of it
(`Session.state`): when a checkpoint's turn ran commands in a session but the digest did not
change, the shell's running changed nothing a rollback would bring back (daemon/turns.py).
Variables that change by themselves on every command ($_, $RANDOM, $SECONDS, $LINENO, ...)
and the session's own bookkeeping are left out.

A session started with `tty` runs its commands on a pseudo-terminal of the sandbox's own
devpts, whose master the daemon holds: the shell leads its session with the pty as its
controlling terminal (dbx-enter --tty) and keeps it at fd 3; each command runs with
stdin, stdout and stderr on it (programs see a terminal: isatty, colours, /dev/tty, line
editing), while the markers still go through the pipes, and one more marker through the
pty tells where the command's output on it ends. Its output is the terminal's, stdout and
stderr merged, as a terminal shows it (ONLCR: "\r\n"); a command that reads its input
waits for it as in a terminal (until the timeout). A checkpoint captures the pty with the
session (cr/ptys.py: the master is the daemon's); a restore gives the daemon a new one.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import secrets
import signal
import subprocess
import termios
import time
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass

import trio

from ..background import GuardedNursery
from ..cr import ptys

from .execute import OUTPUT_LIMIT, ExecOutput, _terminate, end_helper, exit_code
from .runtime import HELPER_ENV, Runtime, own_group

_TAIL = 512
TTY_FD = 3              # where a session's shell keeps its terminal (native/enter.c)
TTY_ROWS, TTY_COLS = 24, 80
SETTLE_MAX_S = 0.05     # how long run() waits for the shell to read again (Session._settle)
SETTLE_POLL_S = 0.0002
# Bash builtins that print the shell's state (stdout), run after every command.
_STATE_SCRIPT = ("{ declare -p; declare -f; alias -p; shopt -p; set +o; trap -p; umask; "
                 "ulimit -a; dirs -l -p; jobs -l; } >&2 2>/dev/null")
# Variables that differ after every command whatever it did; and our own.
_VOLATILE = re.compile(
    rb"^declare -[-a-zA-Z]* (_|RANDOM|SRANDOM|SECONDS|EPOCHSECONDS|EPOCHREALTIME|LINENO|"
    rb"BASH_COMMAND|PIPESTATUS|BASH_LINENO|BASH_SOURCE|FUNCNAME|BASH_ARGC|BASH_ARGV|"
    rb"BASH_ARGV0|BASHPID|BASH_CMDS|HISTCMD|COLUMNS|LINES|BASH_SUBSHELL|__dbx_[a-z]+)(=|$)")


def state_digest(report: bytes) -> str:
    """Digest of a shell's state report, without the volatile lines."""
    h = hashlib.sha256()
    for line in report.split(b"\n"):
        if not _VOLATILE.match(line):
            h.update(line + b"\n")
    return h.hexdigest()[:32]


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
        pass   # (a pty's master reads EIO once no slave is open: trio's BrokenResourceError)
    finally:
        target.eof.set()


class SpawnedShell:
    """A shell the daemon started (through dbx-enter, its child)."""

    def __init__(self, proc: trio.Process, master: trio.lowlevel.FdStream | None = None
                 ) -> None:
        self.proc = proc
        assert proc.stdin and proc.stdout and proc.stderr
        self.stdin, self.stdout, self.stderr = proc.stdin, proc.stdout, proc.stderr
        self.master = master           # of its terminal (a tty session)
        self.bash: int | None = None   # its host pid, once found (Session.shell_pid)

    def alive(self) -> bool:
        return self.proc.returncode is None

    def exit_code(self) -> int:
        return exit_code(self.proc)

    async def terminate(self, group_killed: bool = False) -> None:
        """End dbx-enter. Its SIGTERM kills the shell's whole process group; once the
        caller killed that group (sparing what it must), dbx-enter ends with its shell,
        or by SIGKILL, which it cannot turn into a group kill."""
        await (end_helper if group_killed else _terminate)(self.proc)


@dataclass
class AdoptedShell:
    """A shell restored from a checkpoint: not the daemon's child, so it is watched through a
    pidfd and its exit status is unknown; its pipes are the ones the restore gave it."""

    pid: int          # host pid (not a group leader: its group also holds the template)
    pidfd: int
    stdin: trio.lowlevel.FdStream
    stdout: trio.lowlevel.FdStream
    stderr: trio.lowlevel.FdStream
    master: trio.lowlevel.FdStream | None = None   # of its terminal (a tty session)

    def alive(self) -> bool:
        if self.pidfd < 0:   # terminated
            return False
        try:
            signal.pidfd_send_signal(self.pidfd, 0)
            return True
        except ProcessLookupError:
            return False

    def exit_code(self) -> int:
        return -1  # not our child: its status went to the sandbox's init

    async def terminate(self, group_killed: bool = False) -> None:
        try:
            signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
        except (ProcessLookupError, OSError):
            pass
        try:
            os.close(self.pidfd)
        except OSError:
            pass
        self.pidfd = -1


Shell = SpawnedShell | AdoptedShell


class Session:
    """A bash shell living in the sandbox; `run` is serialized per session."""

    def __init__(self, name: str, tty: bool = False,
                 kill_group: Callable[[int], Awaitable[None]] | None = None) -> None:
        self.name = name
        self.tty = tty
        # Kills a process group of the sandbox but the daemon's stopped processes in it:
        # the templates of a shell's processes share its group (close). None: every one.
        self.kill_group = kill_group
        self.shell: Shell | None = None
        self.lock = trio.Lock()
        self.out = _Stream(OUTPUT_LIMIT)
        self.err = _Stream(OUTPUT_LIMIT)
        self.term = _Stream(OUTPUT_LIMIT)   # what the master reads (a tty session)
        # Digest of the shell's state after its last command (None: unknown), and what it
        # was when the current turn began (set by the daemon at checkpoints and restores).
        self.state: str | None = None
        self.turn_state: str | None = None

    @property
    def alive(self) -> bool:
        return self.shell is not None and self.shell.alive()

    @property
    def spawned(self) -> trio.Process | None:
        """The dbx-enter process behind a shell the daemon started (None if adopted)."""
        return self.shell.proc if isinstance(self.shell, SpawnedShell) else None

    async def start(self, rt: Runtime, env: dict[str, str], background: GuardedNursery) -> None:
        argv = ["bash", "--noprofile", "--norc"]
        master = slave = -1
        if self.tty:
            assert rt.generation is not None
            master, slave = ptys.new_pair(rt.generation.mntfd, TTY_ROWS, TTY_COLS)
        try:
            proc = await trio.lowlevel.open_process(
                rt.enter_argv(argv, "/workspace", env, tty=slave), stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                pass_fds=rt.pass_fds + ((slave,) if slave >= 0 else ()), env=HELPER_ENV)
        except BaseException:
            if master >= 0:
                os.close(master)
            raise
        finally:
            if slave >= 0:
                os.close(slave)   # the shell's alone: its end closes the pty
        self.attach(SpawnedShell(proc, trio.lowlevel.FdStream(master) if master >= 0 else None),
                    background)

    def master_fd(self) -> int | None:
        """The daemon's descriptor of the session's terminal (None: on pipes, or gone)."""
        master = self.shell.master if self.shell is not None else None
        try:
            return None if master is None else master.fileno()
        except trio.ClosedResourceError:
            return None

    def shell_pid(self, exclude: Collection[int] = ()) -> int | None:
        """Host pid of the bash process (a spawned shell is dbx-enter's child; so are the
        templates made of it, which the caller excludes)."""
        if isinstance(self.shell, AdoptedShell):
            return self.shell.pid
        if isinstance(self.shell, SpawnedShell):
            if self.shell.bash is not None:
                return self.shell.bash
            helper = self.shell.proc.pid
            try:
                with open(f"/proc/{helper}/task/{helper}/children") as f:
                    kids = [int(k) for k in f.read().split() if int(k) not in exclude]
            except OSError:
                return None
            if len(kids) == 1:
                self.shell.bash = kids[0]   # dbx-enter waits for it: its pid stays its own
            return self.shell.bash
        return None

    def attach(self, shell: Shell, background: GuardedNursery) -> None:
        """Talk to `shell` from now on (a new one, or one restored by a rollback)."""
        self.shell = shell
        self.out, self.err = _Stream(OUTPUT_LIMIT), _Stream(OUTPUT_LIMIT)
        self.term = _Stream(OUTPUT_LIMIT)
        background.start_soon(_pump, shell.stdout, self.out)
        background.start_soon(_pump, shell.stderr, self.err)
        if shell.master is not None:
            background.start_soon(_pump, shell.master, self.term)

    async def run(self, command: str, timeout: float | None) -> ExecOutput:
        assert self.shell is not None
        t0 = time.perf_counter()
        nonce = secrets.token_hex(8)
        rc_marker = f"\n__DBX_{nonce}_RC=".encode()
        self.out.reset(rc_marker)
        self.err.reset(f"\n__DBX_{nonce}_END\n".encode())
        tty_marker = f"__DBX_{nonce}_TTY".encode()
        self.term.reset(tty_marker if self.tty else b"")
        stdio = f"<&{TTY_FD} >&{TTY_FD} 2>&{TTY_FD} {TTY_FD}>&-" if self.tty else "</dev/null"
        script = (f"IFS= read -r -d '' __dbx_cmd <<'__DBX_EOF_{nonce}'\n{command}\n"
                  f"__DBX_EOF_{nonce}\n"
                  f'eval "$__dbx_cmd" {stdio}\n'
                  f"printf '\\n__DBX_{nonce}_RC=%d\\n' $?\n"
                  + (f"printf '\\n{tty_marker.decode()}' >&{TTY_FD}\n" if self.tty else "") +
                  "unset __dbx_cmd\n"  # multi-line; and not the shell's own state
                  f"printf '\\n__DBX_{nonce}_STATE\\n' >&2\n"
                  f"{_STATE_SCRIPT}\n"
                  f"printf '\\n__DBX_{nonce}_END\\n' >&2\n")
        try:
            await self.shell.stdin.send_all(script.encode())
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
        output = self.out
        if self.tty:   # the command's output is the terminal's (its stdout pipe is unused)
            output = self.term
            stdout, out_trunc, _ = output.result()
            stdout = _strip_newline(stdout)
        stderr, self.state = _split_state(stderr, f"\n__DBX_{nonce}_STATE\n".encode(),
                                          err_trunc)
        if self.out.found.is_set():
            code = int(rest.split(b"\n", 1)[0] or b"0")
            if self.err.found.is_set():
                await self._settle()
        else:  # the shell exited (e.g. `exit 3`) or was killed
            await self.close()
            code = self.shell.exit_code()
        if self.state is not None:
            # A command may have changed the shell's descriptors (exec 9>log, a read that
            # moved an offset) or its terminal (stty) and nothing else: the shell's state
            # includes them. Read once it is back in its read: while it prints a marker,
            # bash holds a saved copy of the descriptor it redirects (fd 10), which made a
            # read-only turn's digest differ now and then (stop 51's test_policy flake).
            self.state = _with_process(self.state, self.shell_pid(), self.master_fd())
        return ExecOutput(code, stdout, stderr, (time.perf_counter() - t0) * 1000, timed_out,
                          out_trunc and output.total > output.limit,
                          err_trunc and self.err.total > self.err.limit)

    async def _settle(self) -> None:
        """Wait until the shell is back in the read of its next command, a few
        microseconds after its last marker unless it was descheduled: a checkpoint taken
        as soon as run() returns then finds it blocked there, so a copy restored from it
        only re-enters that read. Caught between the marker and the read, the copy would
        run on in user mode before the inspector watches it, and the next checkpoint of
        that turn could not be an alias (turns.py). Bounded: SETTLE_MAX_S."""
        pid = self.shell_pid()
        if pid is None:
            return
        deadline = trio.current_time() + SETTLE_MAX_S
        while not _reading_commands(pid) and trio.current_time() < deadline:
            await trio.sleep(SETTLE_POLL_S)

    async def _wait_markers(self) -> None:
        """Both markers, or the shell's end (whichever first)."""
        async with trio.open_nursery() as n:
            async def markers() -> None:
                await self.out.found.wait()
                await self.err.found.wait()
                if self.tty:
                    await self.term.found.wait()
                n.cancel_scope.cancel()

            async def shell_end() -> None:
                await self.out.eof.wait()
                await self.err.eof.wait()
                n.cancel_scope.cancel()

            n.start_soon(markers)
            n.start_soon(shell_end)

    async def close(self) -> None:
        """Kill the shell and every job in its process group (but the templates there:
        kill_group), a spawned shell's or a restored one's alike."""
        if self.shell is None:
            return
        with trio.CancelScope(shield=True):
            kill = self.kill_group
            pid = self.shell_pid() if kill is not None and self.alive else None
            group = None if pid is None else own_group(pid)
            if kill is not None and group is not None:
                await kill(group)
            await self.shell.stdin.aclose()
            await self.shell.terminate(group_killed=group is not None)
            if self.shell.master is not None:
                await self.shell.master.aclose()


def _reading_commands(pid: int) -> bool:
    """Is the shell `pid` blocked in a read of its stdin (its commands' pipe)?"""
    try:
        with open(f"/proc/{pid}/syscall", "rb") as f:
            return f.read(16).startswith(b"0 0x0 ")   # read(0, ...)
    except OSError:
        return True   # gone: nothing to wait for


def _with_process(state: str, pid: int | None, master: int | None) -> str:
    """The shell's state digest, its descriptors' and its terminal's in one digest."""
    h = hashlib.sha256(state.encode())
    if pid is not None:
        h.update(_descriptors(pid))
    if master is not None:
        h.update(_terminal(master))
    return h.hexdigest()[:32]


def _descriptors(pid: int) -> bytes:
    """The shell's descriptors: number, what it is (a pipe's or socket's kind only: a
    restore makes new ones) and offset (~50 us for a shell's handful)."""
    out = []
    try:
        fds = sorted(os.listdir(f"/proc/{pid}/fd"), key=int)
    except OSError:
        return b""   # gone: the next run finds it
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            with open(f"/proc/{pid}/fdinfo/{fd}", "rb") as f:
                pos = f.readline().strip()
        except OSError:
            continue
        if target.startswith(("pipe:", "socket:", "anon_inode:")):
            target = target.split(":", 1)[0]
        out.append(b"%s %s %s\n" % (fd.encode(), os.fsencode(target), pos))
    return b"".join(out)


def _terminal(master: int) -> bytes:
    """Its terminal's settings and size, read through the master (TCGETS2 and TIOCGWINSZ
    there give the slave's)."""
    try:
        return (fcntl.ioctl(master, ptys.TCGETS2, bytes(ptys.TERMIOS2_SIZE)) +
                fcntl.ioctl(master, termios.TIOCGWINSZ, bytes(8)))
    except OSError:
        return b""   # hung up: the shell is gone, which the next run finds


def _strip_newline(out: bytes) -> bytes:
    """A tty command's output without the newline its end marker began with (ONLCR's
    "\r\n", or "\n" if the command turned output processing off)."""
    return out[:-2] if out.endswith(b"\r\n") else out[:-1] if out.endswith(b"\n") else out


def _split_state(stderr: bytes, marker: bytes, truncated: bool) -> tuple[bytes, str | None]:
    """(the command's stderr, the digest of the state report after it or None)."""
    i = stderr.rfind(marker)
    if i < 0:
        return stderr, None
    return stderr[:i], None if truncated else state_digest(stderr[i + len(marker):])
