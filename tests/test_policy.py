"""Checkpoint policy through the daemon (issue 5): a catalog of agent turns, each followed by
`checkpoint()` (mode auto). Read-only turns are skipped; changing turns are not; and after the
whole catalog, a rollback to every checkpoint brings back exactly what was there when it was
taken (files, the session's shell state, a long-lived process's memory), so no skip was
wrong. Real daemon, real eBPF (the inspector loads in the background at daemon start).
"""

from __future__ import annotations

import difflib
import io
import json
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest

import deltabox
from deltabox import Sandbox

from conftest import wait_for


# The tree the catalog works in, listed with names, types, modes, sizes and mtimes and every
# file's content. Not directories' mtimes: a turn that only creates and removes a file again
# (git status takes and drops .git/index.lock) is skipped, by policy (README: what a skipped
# checkpoint restores).
OBSERVE = ("cd / && find /workspace /tmp /usr/local/lib -xdev \\( -type d -printf '%p d %m\\n' "
           "\\) -o -printf '%p %y %s %m %T@\\n' 2>/dev/null | sort; "
           "find /workspace /tmp /usr/local/lib -xdev -type f "
           "-print0 2>/dev/null | sort -z | xargs -0 -r sha256sum | sha256sum")
# The session's own state, as a user could see it (without what changes by itself).
SHELL_STATE = ("pwd; alias; declare -f; declare -p | grep -v -E "
               "'^declare -[-a-zA-Z]* (_|RANDOM|SRANDOM|SECONDS|EPOCH[A-Z]*|LINENO|BASH_[A-Z]*|"
               "PIPESTATUS|FUNCNAME|BASHPID|HISTCMD|COLUMNS|LINES)(=|$)'; jobs")
# A long-lived process with in-memory state: SIGUSR1 appends 4 MiB to a list, SIGUSR2 writes
# the list's length to /tmp/report. Idle (signal.pause) otherwise.
COUNTER = r"""
import signal
items = []
def alloc(*_):
    items.append(bytearray(4 << 20))
def report(*_):
    with open("/tmp/report", "w") as out:
        out.write(str(len(items)))
signal.signal(signal.SIGUSR1, alloc)
signal.signal(signal.SIGUSR2, report)
while True:
    signal.pause()
"""


def _wheel() -> bytes:
    """A minimal pure-Python wheel (pip installs it offline)."""
    files = {"dbxmini/__init__.py": b"VALUE = 42\n",
             "dbxmini-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: dbxmini\n"
                                               b"Version: 1.0\n",
             "dbxmini-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\n"
                                            b"Root-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{n},,\n" for n in files) + "dbxmini-1.0.dist-info/RECORD,,\n"
    files["dbxmini-1.0.dist-info/RECORD"] = record.encode()
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
    return buf.getvalue()


class Catalog:
    """Runs turns, checkpoints after each, remembers what each checkpoint must restore."""

    def __init__(self, sbx: Sandbox) -> None:
        self.sbx = sbx
        self.sh = sbx.session("agent")
        self.counter = 0               # the long-lived process's list length (its memory)
        self.expect: dict[str, tuple[str, str, int]] = {}
        self.kinds: dict[str, str] = {}
        self.names: dict[str, str] = {}

    def observe_files(self) -> str:
        r = self.sbx.exec(OBSERVE)
        assert r.exit_code == 0, r
        return r.stdout

    def observe_shell(self) -> str:
        r = self.sh.run(SHELL_STATE)
        assert r.exit_code == 0, r
        return r.stdout

    def observe_counter(self) -> int:
        """Asks the process (a signal: it runs, so not during the catalog's turns)."""
        self.sbx.exec("rm -f /tmp/report; pkill -USR2 -f counter.py")
        wait_for(lambda: self.sbx.exec("test -s /tmp/report").exit_code == 0)
        n = int(self.sbx.exec("cat /tmp/report; rm -f /tmp/report").stdout)
        return n

    def turn(self, name: str, action: Callable[[], object], kinds: set[str]) -> str:
        action()
        cp = self.sbx.checkpoint(label=name)
        assert cp.kind in kinds, (name, cp.kind, cp.reasons)
        self.kinds[name] = cp.kind
        self.names[cp.id] = name
        # Observing reads only: it must not make the next turn a change (checked by the
        # read-only turns below, which follow observations).
        self.expect[cp.id] = (self.observe_files(), self.observe_shell(), self.counter)
        # (the counter is the test's model of the process's memory: asking the process
        # would make it run, a change to the next turn)
        return cp.id


def test_turn_catalog_skips_read_only_turns_and_restores_every_checkpoint_exactly(
        sbx: Sandbox, ebpf: str) -> None:
    c = Catalog(sbx)
    sh = c.sh
    # Set up: a git repo, a long-lived process with memory, a session with state.
    sbx.files.write("/workspace/repo/app.py", "print('hello')\n")
    sbx.files.write("/workspace/counter.py", COUNTER)
    sbx.files.write("/workspace/pkg/dbxmini-1.0-py3-none-any.whl", _wheel())
    r = sh.run("cd /workspace/repo && git init -q && git -c user.email=a@b -c user.name=a "
               "add -A && git -c user.email=a@b -c user.name=a commit -qm init && "
               # git status rewrites a "racily clean" index (files as new as it): settle it
               "sleep 1.1 && git status >/dev/null && "
               "(python3 /workspace/counter.py >/dev/null 2>&1 &) && "
               "export AGENT=1")
    assert r.exit_code == 0, r
    wait_for(lambda: sbx.exec("pgrep -f counter.py").exit_code == 0)
    time.sleep(0.3)  # its handlers are installed
    assert c.observe_counter() == 0  # it runs and answers
    c.turn("setup", lambda: None, {"full"})
    c.turn("nothing", lambda: None, {"skipped"})

    read_only = {
        "cat": "cat /workspace/repo/app.py",
        "ls": "ls -la /workspace /etc >/dev/null",
        "grep": "grep -rn hello /workspace/repo --include=*.py",
        "find": "find /workspace -name '*.py'",
        "git status": "git status --short",   # the session is in the repo
        "git log": "git -C /workspace/repo log --oneline",
        "python -c": "python3 -c 'print(1)'",
    }
    for name, cmd in read_only.items():
        c.turn(f"session {name}", lambda cmd=cmd: sh.run(cmd), {"skipped"})
    c.turn("exec cat", lambda: sbx.exec("cat /etc/hostname"), {"skipped"})
    c.turn("files api read", lambda: sbx.files.read("/workspace/repo/app.py"), {"skipped"})

    def alloc() -> None:
        sbx.exec("pkill -USR1 -f counter.py")
        c.counter += 1
        time.sleep(0.3)  # let it run

    changing: list[tuple[str, Callable[[], object], set[str]]] = [
        ("edit (files api)", lambda: sbx.files.write("/workspace/repo/app.py", "print(2)\n"),
         {"fs"}),
        ("edit (sed)", lambda: sh.run("sed -i s/2/3/ /workspace/repo/app.py"), {"fs"}),
        ("touch", lambda: sh.run("touch /workspace/new"), {"fs"}),
        ("chmod", lambda: sh.run("chmod 600 /workspace/new"), {"fs"}),
        ("mv", lambda: sh.run("mv /workspace/new /workspace/moved"), {"fs"}),
        ("rm", lambda: sh.run("rm /workspace/moved"), {"fs"}),
        # Not O_EXCL: the file may have existed before (the inspector cannot tell), so a change.
        ("file written and removed", lambda: sh.run("echo x > /tmp/t && rm /tmp/t"), {"fs"}),
        ("pip install", lambda: sh.run(
            "python3 -m pip install -q --no-index --no-deps --break-system-packages "
            "/workspace/pkg/dbxmini-1.0-py3-none-any.whl"), {"fs", "full"}),
        ("shell variable", lambda: sh.run("export STEP=1"), {"full"}),
        ("cd", lambda: sh.run("cd /tmp"), {"full"}),
        ("long-lived process allocates", alloc, {"full"}),
        ("background job", lambda: sh.run("sleep 1000 &"), {"full"}),
        ("job ends", lambda: sh.run("kill %1; wait"), {"full"}),
    ]
    for name, action, kinds in changing:
        c.turn(name, action, kinds)
    # A background process that writes later: started in one turn, writes (on a signal, so a
    # restored copy does not write by itself) and exits in the next. Not a job of the shell:
    # a finished job changes the shell's job table by itself.
    def start_writer() -> None:
        sh.run("( (trap 'echo late > /workspace/late; exit' USR1; echo $BASHPID > /tmp/writer; "
               "while :; do sleep 0.2; done) & )")
        # It writes its pid after the command has returned: by the checkpoint, or a copy
        # restored from it would write /tmp/writer again (a new mtime; not what the
        # observation after the checkpoint saw).
        wait_for(lambda: sbx.exec("test -s /tmp/writer").exit_code == 0)

    c.turn("writer started", start_writer, {"full"})

    def signal_writer() -> None:
        sbx.exec("kill -USR1 $(cat /tmp/writer)")
        wait_for(lambda: sbx.exec("test -s /workspace/late && ! kill -0 $(cat /tmp/writer)")
              .exit_code == 0)
        time.sleep(0.3)

    c.turn("writer wrote", signal_writer, {"full"})  # it ran and exited
    c.turn("nothing again", lambda: None, {"skipped"})

    assert "dbxmini" in sh.run("python3 -c 'import dbxmini; print(dbxmini.__name__)'").stdout
    # Every checkpoint, in reverse order and then a few out of order, restores exactly.
    ids = list(c.expect)
    order = ids[::-1] + ids[::3]
    for cp_id in order:
        res = sbx.rollback(cp_id)
        assert res.process_state == "restored", (cp_id, res)
        files, shell, counter = c.expect[cp_id]
        got = c.observe_files()
        assert got == files, (f"files differ after rollback to {cp_id} "
                              f"({c.kinds[c.names[cp_id]]} checkpoint after "
                              f"{c.names[cp_id]!r}):\n" + "\n".join(difflib.unified_diff(
                                  files.splitlines(), got.splitlines(), lineterm="")))
        assert c.observe_shell() == shell, f"shell state differs after rollback to {cp_id}"
        assert c.observe_counter() == counter, f"process memory differs at {cp_id}"
    skipped = sum(k == "skipped" for k in c.kinds.values())
    assert skipped >= len(read_only) + 4, c.kinds


def test_turn_effects_api_and_cli(sbx: Sandbox, ebpf: str, daemon) -> None:
    sh = sbx.session("main")
    sh.run("true")
    sbx.checkpoint()
    sh.run("echo data > /workspace/out.txt; sleep 1000 &")
    now = sbx.turn_effects()
    assert now.backend == ebpf and now.effects is not None
    assert "/workspace/out.txt" in now.effects.files_created
    cp = sbx.checkpoint()
    assert cp.kind == "full" and any("still running" in r for r in cp.reasons), cp
    closed = sbx.turn_effects(cp)
    assert closed.kind == "full" and closed.reasons == cp.reasons[:len(closed.reasons)]
    assert "/workspace/out.txt" in closed.effects.files_created
    # The CLI prints the same as JSON.
    out = subprocess.run([sys.executable, "-m", "deltabox.cli", "effects", sbx.id,
                          "--checkpoint", cp.id, "--json"], capture_output=True, text=True,
                         check=True).stdout
    doc = json.loads(out)
    assert doc["kind"] == "full" and "/workspace/out.txt" in doc["effects"]["files_created"]
    human = subprocess.run([sys.executable, "-m", "deltabox.cli", "effects", sbx.id],
                           capture_output=True, text=True, check=True).stdout
    assert "inspector: ebpf" in human
    with pytest.raises(deltabox.InvalidArgument):
        sbx.turn_effects("cp-0000000000x")
    with pytest.raises(deltabox.NotFound):
        sbx.turn_effects("cp-0000000000")


def test_forced_modes_and_reuse_after_rollback(sbx: Sandbox, ebpf: str) -> None:
    sh = sbx.session("main")
    sh.run("export A=1")
    full = sbx.checkpoint()
    assert full.kind == "full" and full.processes_from == full.id
    forced = sbx.checkpoint(mode="full")
    assert forced.kind == "full" and forced.processes_from == forced.id
    fs = sbx.checkpoint(mode="fs")
    assert fs.kind == "fs" and fs.processes_from is None
    # The parent (fs) holds no processes while the session runs: auto must capture them.
    again = sbx.checkpoint()
    assert again.kind == "full", again.reasons
    # After a rollback, the restored processes are the checkpoint's: nothing ran since, so
    # the next checkpoint aliases it, and rolling back to the alias restores them.
    sbx.rollback(full)
    alias = sbx.checkpoint()
    assert alias.kind == "skipped" and alias.processes_from == full.id, alias.reasons
    sh.run("export A=2")
    sbx.rollback(alias)
    assert sh.run("echo $A").stdout == "1\n"
    # Deleting the owner keeps the processes an alias still restores.
    sbx.delete_checkpoint(full)
    sh.run("export A=3")
    res = sbx.rollback(alias)
    assert res.process_state == "restored", res
    assert sh.run("echo $A").stdout == "1\n"


TIMED = {   # how to start it, a command that succeeds once it is armed, the reason said
    "alarm": ("nohup python3 -c \"import signal, time\nsignal.signal(signal.SIGALRM, "
              "lambda *_: None)\nsignal.alarm(600)\nopen('/workspace/armed', 'w').close()"
              "\ntime.sleep(1000)\" >/dev/null 2>&1 &", "test -e /workspace/armed",
              "an alarm (ITIMER_REAL) running"),
    "posix": ("nohup timeout 600 sleep 1000 >/dev/null 2>&1 &",
              "grep -q ID /proc/$(pgrep -x timeout)/timers", "a POSIX timer (timer 0) running"),
}


@pytest.mark.parametrize("kind", TIMED)
def test_a_running_timer_is_never_aliased(sbx: Sandbox, ebpf: str, kind: str) -> None:
    """A process whose alarm (ITIMER_REAL) or POSIX timer (`timeout`'s) runs has less time
    left at every checkpoint even if it never runs: a checkpoint after a rollback is
    captured afresh instead of aliasing the one restored (whose time left is older), with
    the reason said."""
    start, armed, reason = TIMED[kind]
    sbx.exec(start)
    wait_for(lambda: sbx.exec(armed).exit_code == 0)
    full = sbx.checkpoint()
    assert full.kind == "full"
    sbx.rollback(full)
    again = sbx.checkpoint()
    assert again.kind == "full" and any(reason in r for r in again.reasons), again.reasons


def test_fork_children_skip_until_they_change(sbx: Sandbox, ebpf: str) -> None:
    sh = sbx.session("main")
    sh.run("export WHO=parent")
    cp = sbx.checkpoint()
    kid = sbx.fork(cp)[0]
    try:
        assert kid.process_state == "restored"
        k = kid.checkpoint()
        assert k.kind == "skipped" and k.processes_from == cp.processes_from, k.reasons
        kid.session("main").run("export WHO=kid")
        k2 = kid.checkpoint()
        assert k2.kind == "full", k2.reasons
        kid.rollback(k)
        assert kid.session("main").run("echo $WHO").stdout == "parent\n"
    finally:
        kid.kill()


# Sleeps to an absolute deadline (Python >= 3.11: clock_nanosleep with TIMER_ABSTIME), so a
# copy restored after the deadline wakes the moment it is let go, writes the time, and sleeps
# on: all before the daemon can tell the inspector about it.
WAKER = """\
import time
time.sleep(1.0)
open('/workspace/woke', 'w').write(str(time.time_ns()))
time.sleep(1e6)
"""


@pytest.mark.parametrize("how", ["rollback", "fork"])
def test_a_restored_process_that_ran_before_the_watch_is_captured_afresh(
        sbx: Sandbox, ebpf: str, how: str) -> None:
    """A rollback or a fork lets its processes go before the inspector watches them: what
    one does at once (here: wake, write a file, sleep again) must not pass for an untouched
    turn. The next auto checkpoint captures it (not an alias of the checkpoint restored,
    which would bring back a process about to write the file again, with another time)."""
    sbx.files.write("/workspace/waker.py", WAKER)
    sbx.session("main").run("nohup python3 /workspace/waker.py >/dev/null 2>&1 &")
    time.sleep(0.3)
    before = sbx.checkpoint(mode="full")
    wait_for(lambda: sbx.exec("test -s /workspace/woke").exit_code == 0)
    if how == "rollback":
        box = sbx
        assert box.rollback(before).process_state == "restored"
    else:
        box = sbx.fork(before)[0]
        assert box.process_state == "restored", box.fork_note
    try:
        wait_for(lambda: box.exec("test -s /workspace/woke").exit_code == 0)
        woke = box.files.read("/workspace/woke")
        after = box.checkpoint()
        # Mostly before the watch (its deadline passed long ago); on a loaded machine
        # the restored process may run only once watched, which the turn sees as usual.
        assert after.kind == "full", after.reasons
        assert any("python3" in r for r in after.reasons), after.reasons
        box.exec("rm /workspace/woke")
        assert box.rollback(after).process_state == "restored"
        time.sleep(0.2)
        assert box.files.read("/workspace/woke") == woke
    finally:
        if box is not sbx:
            box.kill()


def test_without_inspector_every_auto_checkpoint_is_full(tmp_path: Path) -> None:
    from conftest import DaemonProc, leaks  # noqa: PLC0415 (the test's own daemon)

    d = DaemonProc(tmp_path / "state", str(tmp_path / "sock"), None, tmp_path / "log")
    d.start("--no-inspector")
    try:
        info = deltabox.info(socket=d.socket)
        assert info.inspector_backend.startswith("none: disabled"), info
        s = Sandbox.create(socket=d.socket)
        s.checkpoint()
        cp = s.checkpoint()
        assert cp.kind == "full" and "inspector: none" in cp.reasons[0], cp.reasons
        assert s.turn_effects().effects is None
        s.kill()
    finally:
        d.stop()
    assert not leaks(tmp_path)


def _start_counter(sbx: Sandbox, sh) -> None:
    """COUNTER, started from session `sh`, once its signal handlers are installed (before,
    SIGUSR1/2 would kill it): SigCgt has USR1 (bit 9) and USR2 (bit 11)."""
    sbx.files.write("/workspace/counter.py", COUNTER)
    sh.run("nohup python3 /workspace/counter.py >/dev/null 2>&1 &")
    probe = ("p=$(pgrep -x python3) && "
             "(( (0x$(awk '/^SigCgt/{print $2}' /proc/$p/status) & 0xa00) == 0xa00 ))")
    wait_for(lambda: sbx.exec(probe).exit_code == 0)


def _report(sbx: Sandbox) -> int:
    """The counter process's list length (it runs to answer)."""
    sbx.exec("rm -f /tmp/report; pkill -USR2 -f counter.py")
    wait_for(lambda: sbx.exec("test -s /tmp/report").exit_code == 0)
    return int(sbx.exec("cat /tmp/report; rm -f /tmp/report").stdout)


def test_a_process_that_did_not_run_keeps_its_template(sbx: Sandbox, ebpf: str) -> None:
    """A full checkpoint shares the parent's template of a process that did not run since
    (no new copy of its page tables), says so, and restores it exactly, also once the
    checkpoint that made the template is deleted."""
    sh = sbx.session("main")
    _start_counter(sbx, sh)
    sh.run("export A=0")
    sbx.exec("pkill -USR1 -f counter.py")
    assert _report(sbx) == 1
    first = sbx.checkpoint()
    assert first.kind == "full" and not any("kept" in r for r in first.reasons)
    sh.run("export A=1")                       # the shell runs; the counter waits
    second = sbx.checkpoint()
    kept = [r for r in second.reasons if r.startswith("templates kept")]
    assert second.kind == "full" and kept and "python3" in kept[0], second.reasons
    assert "bash" not in kept[0]
    sbx.exec("pkill -USR1 -f counter.py")      # the counter runs; the shell waits
    wait_for(lambda: True)
    assert _report(sbx) == 2
    third = sbx.checkpoint()
    kept = [r for r in third.reasons if r.startswith("templates kept")]
    assert third.kind == "full" and kept and "python3" not in kept[0], third.reasons
    sbx.delete_checkpoint(first)               # the template's maker goes; second keeps it
    for cp, want in ((second, 1), (third, 2), (second, 1)):
        res = sbx.rollback(cp)
        assert res.process_state == "restored", res
        assert _report(sbx) == want
        assert sh.run("echo $A").stdout == "1\n"


def test_a_shell_that_ran_is_captured_afresh_even_when_quiet(sbx: Sandbox, ebpf: str) -> None:
    """A session command that changed none of the shell's state gives a skipped checkpoint
    (the parent's template stands for the shell); the shell did run, though, so a later
    full checkpoint captures it afresh rather than keep that template."""
    sh = sbx.session("main")
    _start_counter(sbx, sh)
    assert _report(sbx) == 0
    assert sbx.checkpoint().kind == "full"
    sh.run("true")
    quiet = sbx.checkpoint()
    assert quiet.kind == "skipped", quiet.reasons
    sbx.exec("pkill -USR1 -f counter.py")
    assert _report(sbx) == 1
    after = sbx.checkpoint()
    assert after.kind == "full", after.reasons
    assert not any(r.startswith("templates kept") for r in after.reasons), after.reasons
    assert sh.run("echo ok").stdout == "ok\n"


def test_a_tty_session_command_that_changed_only_its_terminal_is_captured(
        sbx: Sandbox, ebpf: str) -> None:
    """`stty` in a tty session changes the terminal and none of the shell's variables: the
    session's state includes its terminal's settings and size, so the next checkpoint is
    not an alias of one that has the old ones (a rollback to it would give them back)."""
    sh = sbx.session("term", tty=True)
    sh.run("true")
    before = sbx.checkpoint()
    assert before.kind == "full"
    sh.run("true")
    assert sbx.checkpoint().kind == "skipped"   # (the digest alone changes nothing)
    sh.run("stty cols 100 -echo")
    after = sbx.checkpoint()
    assert after.kind == "full", after.reasons
    sbx.rollback(before)
    assert sh.run("stty size; stty -a | grep -o -- ' -echo '").stdout == "24 80\r\n"
    sbx.rollback(after)
    assert sh.run("stty size; stty -a | grep -o -- ' -echo '").stdout == "24 100\r\n -echo \r\n"


def test_a_session_command_that_changed_only_the_shells_descriptors_is_captured(
        sbx: Sandbox, ebpf: str) -> None:
    """`exec 9>log` opens a descriptor in the shell and changes none of its variables: the
    session's state includes its descriptors (and their offsets), so the next checkpoint
    captures the shell (before stop 51 it kept the parent's template, without fd 9: after
    a rollback to it `echo >&9` failed with "Bad file descriptor")."""
    sh = sbx.session("main")
    sh.run("printf 'a\\nb\\nc\\n' > lines")
    base = sbx.checkpoint()
    assert base.kind == "full"
    sh.run("exec 9>>log 8<lines")
    opened = sbx.checkpoint()
    assert opened.kind == "full", opened.reasons
    sh.run("read x <&8")
    moved = sbx.checkpoint()     # the offset of fd 8 moved
    assert moved.kind == "full", moved.reasons
    sh.run("exec 9>&- 8<&-")
    sbx.rollback(opened)
    assert sh.run("echo hi >&9 && read x <&8 && echo $x").stdout == "a\n"
    sbx.rollback(moved)
    assert sh.run("read x <&8 && echo $x").stdout == "b\n"
    sbx.rollback(base)
    assert sh.run("echo hi >&9").exit_code != 0
