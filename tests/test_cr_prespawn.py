"""Rollbacks from carriers spawned ahead (daemon/warm.py, native carriers and keepers).

After a checkpoint the warm pool spawns a stopped *carrier* of every process into the
generation the next rollback to it will use; the rollback gives birth to the processes from
them (with their pids) and the carriers stay as *keepers* of the processes' memory, so that
the next rollback's kill is quick. These tests check what a user relies on: exact state
across repeated rollbacks, no descriptor or memory held for a process once it has exited.
Their programs start as `cd /workspace; nohup prog &` (no shell waits for them: a
process a shell waits for is given back to it instead, cr/adoption.py, and has no carrier).
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Callable

import pytest

from deltabox import Sandbox
from deltabox.cr import private_maps

from conftest import HELD, OWN_PS, wait_for
from test_cr import (FIFO_GOT, FIFO_PAIR, INTERLEAVED, LOCKER, NETLINK_HOLDER, PAGES, PMQ,
                     PMQ_SH, PRIVATE_AT_CP, _pmq_answer,
                     NAMED_PAIRS, PREFORK, PRIVATE_MAPS, REGISTRATIONS, SOCKET_OPTIONS, REWRITE_PAGES, SHARED_MEMORY, TCP_ENDS,
                     THREADED, TIMERS, TRY_LOCK, UDP_SERVER, UNIX_CLIENT, UNIX_SERVER, _ask,
                     _ask_client, _ask_prefork, _ask_udp, _count, _asked_report, _drain_fifos, _interleaved, _join, _report, _role,
                     _start_pty_harness, _state_of, _typed, _unix_request)

_libc = ctypes.CDLL(None, use_errno=True)
SYS_KCMP, KCMP_VM = 312, 1


def _carriers_ready(sbx: Sandbox) -> bool:
    """Whether a carrier (not yet born) waits for every template. Both hide their command
    line, so ps shows them as [dbx-template] / [dbx-carrier]; a keeper shows its process's
    (it shares the process's memory, where the command line lives)."""
    ps = sbx.exec(f"ps -C {','.join(HELD)} -o stat=,args=").stdout.splitlines()
    held = [line.split(None, 1) for line in ps]
    templates = sum(1 for st, args in held if st.startswith("t") and args == "[dbx-template]")
    carriers = sum(1 for st, args in held if st.startswith("t") and args == "[dbx-carrier]")
    return templates > 0 and carriers >= templates


def _host_procs(marker: str) -> dict[int, tuple[str, str]]:
    """Host pid -> (state, name) of every process whose command line contains `marker`."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                if marker.encode() not in f.read():
                    continue
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
            out[int(d)] = (stat[stat.rfind(")") + 2], stat[stat.find("(") + 1:stat.rfind(")")])
        except OSError:
            continue
    return out


def _same_vm(a: int, b: int) -> bool:
    return _libc.syscall(SYS_KCMP, a, b, KCMP_VM, 0, 0) == 0


PROG = REGISTRATIONS + r"""
import sys, time, zlib
marker = sys.argv[1]
buf = bytearray(os.urandom(1 << 16)) * 1600      # 100 MiB
d = {"n": 0}
open("/workspace/ready", "w").write(str(os.getpid()))
while not os.path.exists("/workspace/quit"):
    if os.path.exists("/workspace/bump"):
        d["n"] += 1
        buf[d["n"] * 4096] ^= 0xFF
        os.remove("/workspace/bump")
    if os.path.exists("/workspace/report"):
        os.remove("/workspace/report")
        tmp = "/workspace/.state"
        open(tmp, "w").write(f"{os.getpid()} {d['n']} {zlib.crc32(buf)} "
                             f"robust={robust()} cpus={cpus_ok()}")
        os.rename(tmp, "/workspace/state")
    time.sleep(0.01)
"""


def test_repeated_rollbacks_from_carriers_are_exact(sbx: Sandbox) -> None:
    """Each rollback gives birth to the process from a carrier (the previous one's keeper
    goes): same pid, the memory and dict as at the checkpoint, its robust futex list and
    rseq registration (sched_getcpu() right on every CPU), every time."""
    marker = "carrier-exact"
    sbx.files.write("prog.py", PROG)
    sbx.exec(f"nohup python3 /workspace/prog.py {marker} >/dev/null 2>&1 &")
    wait_for(lambda: sbx.files.exists("ready"), what="ready")
    _ask(sbx, "bump")
    at_cp = _report(sbx)
    assert " cpus=True" in at_cp and " robust=0/" not in at_cp, at_cp
    cp = sbx.checkpoint(mode="full")
    for i in range(4):
        # the template and a carrier spawned ahead for this rollback
        wait_for(lambda: _carriers_ready(sbx), what="a carrier")
        for _ in range(i + 1):
            _ask(sbx, "bump")
        assert _report(sbx) != at_cp
        r = sbx.rollback(cp)
        assert r.process_state == "restored", r.note
        assert _report(sbx) == at_cp, f"rollback {i}"
        live = [ln for ln in sbx.exec(f"{OWN_PS} args=").stdout.splitlines() if marker in ln]
        assert len(live) == 1, live


def test_keeper_goes_when_its_process_exits(sbx: Sandbox) -> None:
    """A process born from a carrier shares its memory with the carrier (its keeper);
    once the process exits, the keeper goes too (its memory is not held)."""
    marker = "carrier-exit"
    sbx.files.write("prog.py", PROG)
    sbx.exec(f"nohup python3 /workspace/prog.py {marker} >/dev/null 2>&1 &")
    wait_for(lambda: sbx.files.exists("ready"), what="ready")
    cp = sbx.checkpoint(mode="full")
    wait_for(lambda: _carriers_ready(sbx), what="a carrier")
    assert sbx.rollback(cp).process_state == "restored"
    procs = _host_procs(marker)
    live = [p for p, (_, name) in procs.items() if name not in HELD]
    assert len(live) == 1, procs

    def keepers() -> list[int]:
        return [p for p, (st, name) in _host_procs(marker).items()
                if (st, name) == ("t", "dbx-carrier") and _same_vm(live[0], p)]
    # Born from a carrier, which keeps its memory. The carrier becomes a keeper (drops its
    # copies of the process's descriptors, running injected calls) while the rollback
    # answers: stopped again a moment later.
    found: list[int] = []

    def one_keeper() -> bool:  # its pid as seen stopped: between injected calls it runs
        found[:] = keepers()
        return len(found) == 1
    wait_for(one_keeper, timeout=10, what="the keeper")
    keeper = found[0]
    sbx.files.write("quit", "1")
    wait_for(lambda: not os.path.exists(f"/proc/{live[0]}") or
          _host_procs(marker).get(live[0], ("Z",))[0] == "Z", what="the process to exit")
    wait_for(lambda: not os.path.exists(f"/proc/{keeper}"), timeout=10,
          what="the keeper to go")


def test_restored_pipeline_sees_eof(sbx: Sandbox) -> None:
    """Carriers and keepers hold no pipe ends: after a rollback, when the producer of a
    pipeline exits, its consumer reads EOF."""
    # A producer and its consumer on one pipe, their parent gone (a shell pipeline's
    # shell would wait for them: adopted, no carriers).
    sbx.files.write("pipeline.py", "import os, time\nr, w = os.pipe()\nif os.fork() == 0:\n"
                    "    os.close(r)\n    while not os.path.exists('/workspace/quit'):\n"
                    "        os.write(w, b'x\\n')\n        time.sleep(0.02)\n    os._exit(0)\n"
                    "if os.fork() == 0:\n    os.close(w)\n    f = os.fdopen(r)\n"
                    "    for line in f:\n        open('/workspace/last', 'w').write(line)\n"
                    "    open('/workspace/eof', 'w').write('eof')\n    os._exit(0)\n")
    sbx.exec("cd /workspace; nohup python3 pipeline.py >/dev/null 2>&1 &")
    wait_for(lambda: sbx.files.exists("last"), what="the pipeline")
    cp = sbx.checkpoint(mode="full")
    wait_for(lambda: _carriers_ready(sbx), what="carriers")
    assert sbx.rollback(cp).process_state == "restored"
    sbx.files.remove("last")
    wait_for(lambda: sbx.files.exists("last"), what="the restored pipeline")
    sbx.files.write("quit", "1")
    wait_for(lambda: sbx.files.exists("eof"), timeout=10, what="EOF at the consumer")


def test_processes_born_together_and_one_without_its_carrier(sbx: Sandbox) -> None:
    """A rollback of several processes, each with a carrier, gives birth to them in one
    go (engine._births); one whose carrier was killed comes back from its template
    instead, the other from its carrier. Every time: the session's cwd and variable, the
    process's pid, dict and memory as at the checkpoint."""
    marker = "carrier-pair"
    sbx.files.write("prog.py", PROG)
    sh = sbx.session("main")
    sh.run("cd /tmp && V=at-checkpoint")
    sh.run(f"nohup python3 /workspace/prog.py {marker} >/dev/null 2>&1 &")
    wait_for(lambda: sbx.files.exists("ready"), what="ready")
    _ask(sbx, "bump")
    at_cp = _report(sbx)
    cp = sbx.checkpoint(mode="full")
    for kill_a_carrier in (False, True, False):
        wait_for(lambda: _carriers_ready(sbx), what="carriers")
        sh.run("cd / && V=changed")
        _ask(sbx, "bump")
        assert _report(sbx) != at_cp
        if kill_a_carrier:
            ps = sbx.exec("ps -C dbx-carrier -o pid=,args=").stdout.splitlines()
            unborn = [int(ln.split()[0]) for ln in ps if ln.split()[1:] == ["[dbx-carrier]"]]
            assert len(unborn) == 2, ps
            sbx.exec(f"kill -9 {unborn[0]}")
        r = sbx.rollback(cp)
        assert r.process_state == "restored", r.note
        assert _report(sbx) == at_cp, f"killed a carrier: {kill_a_carrier}"
        assert sh.run("echo $V $PWD").stdout.split() == ["at-checkpoint", "/tmp"]
        live = [ln for ln in sbx.exec(f"{OWN_PS} args=").stdout.splitlines() if marker in ln]
        assert len(live) == 1, live


ASYNC_PROG = r"""
import asyncio, os, re, socket
n = 0
ev = os.eventfd(7, os.EFD_NONBLOCK | os.EFD_SEMAPHORE)
tick = os.eventfd(0, os.EFD_NONBLOCK)   # written by the loop's own timer: one wake-up each
a, b = socket.socketpair()
b.send(b"queued")

def state():
    count = os.eventfd_read(ev)       # semaphore mode: 1 per read
    os.eventfd_write(ev, count)
    a.setblocking(False)
    data = a.recv(100)
    b.send(data)
    fds = []
    for fd in sorted(int(x) for x in os.listdir("/proc/self/fd")):
        try:
            kind = re.sub(r"[0-9]+", "N", os.readlink(f"/proc/self/fd/{fd}"))
            flags = open(f"/proc/self/fdinfo/{fd}").read().split("flags:")[1].split()[0]
        except OSError:
            continue
        fds.append(f"{fd}:{kind}:{int(flags, 8) & 0o2004000:o}")
    return f"{os.getpid()} n={n} sem={count} pair={data.decode()} {','.join(fds)}"

async def main():
    global n
    loop = asyncio.get_running_loop()
    woke = asyncio.Event()

    def wake():
        os.eventfd_read(tick)
        woke.set()

    loop.add_reader(tick, wake)        # readable once written
    open("/workspace/ready", "w").write(str(os.getpid()))
    while True:
        loop.call_later(0.01, os.eventfd_write, tick, 1)
        await woke.wait()              # woken through the epoll set
        woke.clear()
        if os.path.exists("/workspace/bump"):
            n += 1
            os.remove("/workspace/bump")
        if os.path.exists("/workspace/report"):
            os.remove("/workspace/report")
            open("/workspace/.state", "w").write(state())
            os.rename("/workspace/.state", "/workspace/state")

asyncio.run(main())
"""


def test_asyncio_process_born_from_carriers(sbx: Sandbox) -> None:
    """An event loop's descriptors (epoll, eventfd in semaphore mode, socket pairs) made
    in a carrier spawned ahead: the process born from it waits on them as it did."""
    sbx.files.write("aprog.py", ASYNC_PROG)
    sbx.exec("nohup python3 /workspace/aprog.py >/dev/null 2>&1 &")
    wait_for(lambda: sbx.files.exists("ready"), what="ready")
    at_cp = _rollbacks_from_carriers(sbx, "bump", "bump", 2)
    assert " n=1 sem=1 pair=queued " in at_cp, at_cp


def _rollbacks_from_carriers(sbx: Sandbox, prepare: str, change: str, times: int,
                             after: Callable[[str, int], None] | None = None) -> str:
    """Ask the program to `prepare`, checkpoint; `times` over: once a carrier waits, ask
    it to `change`, roll back, and its report must be the checkpoint's again (then
    `after(report at the checkpoint, i)`). Returns that report."""
    _ask(sbx, prepare)
    at_cp = _report(sbx)
    cp = sbx.checkpoint(mode="full")
    for i in range(times):
        wait_for(lambda: _carriers_ready(sbx), what="a carrier")
        _ask(sbx, change)
        assert _report(sbx) != at_cp
        r = sbx.rollback(cp)
        assert r.process_state == "restored", r.note
        assert _report(sbx) == at_cp, f"rollback {i}"
        if after is not None:
            after(at_cp, i)
    return at_cp


def test_a_listener_shared_by_processes_born_from_carriers(sbx: Sandbox) -> None:
    """Two workers accepting on one port their parent bound before it exited, each born
    from a carrier: the carriers get one socket made ahead, bound once at each rollback
    (each got a copy of its own before, and the second bind failed). Every worker answers
    on with its count from the checkpoint, rollback after rollback."""
    sbx.files.write("prefork.py", PREFORK)
    sbx.exec("cd /workspace && nohup python3 prefork.py orphaned >/dev/null 2>&1 &")
    wait_for(lambda: sbx.files.exists("listening"))
    counts = dict(_ask_prefork(sbx) for _ in range(6))
    cp = sbx.checkpoint(mode="full")
    for i in range(2):
        wait_for(lambda: _carriers_ready(sbx), what="a carrier")
        for _ in range(3):
            _ask_prefork(sbx)
        r = sbx.rollback(cp)
        assert r.process_state == "restored", r.note
        seen = dict(counts)
        for _ in range(4):
            pid, n = _ask_prefork(sbx)
            assert n == seen[pid] + 1, (i, pid, n, seen)
            seen[pid] = n


def test_udp_sockets_born_from_carriers(sbx: Sandbox) -> None:
    """The carrier's UDP sockets are made ahead unbound (the live process holds the
    ports) and bound, connected, at each rollback: the server answers with its count from
    the checkpoint, its connected socket keeps its port and peer, rollback after rollback."""
    sbx.files.write("udp.py", UDP_SERVER)
    sbx.exec("cd /workspace; nohup python3 udp.py >/dev/null 2>&1 &")
    wait_for(lambda: sbx.files.exists("udp-ready"))
    at_cp = _ask_udp(sbx, "state")
    cp = sbx.checkpoint(mode="full")
    for _ in range(2):
        wait_for(lambda: _carriers_ready(sbx), what="a carrier")
        _ask_udp(sbx, "relay")
        r = sbx.rollback(cp)
        assert r.process_state == "restored", r.note
        assert _ask_udp(sbx, "state") == [at_cp[0] + 1, at_cp[1]]
        assert _ask_udp(sbx, "relay", v6=True) == [at_cp[0] + 2, True]


@pytest.mark.parametrize("prog", [NETLINK_HOLDER, SOCKET_OPTIONS, NAMED_PAIRS],
                         ids=["netlink-and-filters", "socket-options", "named-pairs"])
def test_sockets_made_ahead_keep_what_they_had(sbx: Sandbox, prog: str) -> None:
    """A carrier's sockets are made ahead (unbound, unnamed: the live process holds their
    ports, port ids and names) and bound at each rollback, with what they had at the
    checkpoint: netlink sockets their port ids, groups, options and filters, a UDP socket
    its filter; every kind its timeouts and linger, a unix socket its SO_PASSCRED and peek
    offset, a connection its user timeout; a socket pair's ends their abstract names.
    Rollback after rollback."""
    sbx.files.write("prog.py", prog)
    sbx.exec("cd /workspace; nohup python3 prog.py >/dev/null 2>&1 &")
    wait_for(lambda: sbx.files.exists("ready"))
    _asked_report(sbx)   # (a pair's end passing credentials is named at its first send)
    cp = sbx.checkpoint(mode="full")
    at_cp = _asked_report(sbx)
    for _ in range(2):
        wait_for(lambda: _carriers_ready(sbx), what="a carrier")
        r = sbx.rollback(cp)
        assert r.process_state == "restored", r.note
        assert _asked_report(sbx) == at_cp


def test_shared_memory_born_from_carriers(sbx: Sandbox) -> None:
    """Processes sharing memory (multiprocessing's Value and semaphores, anonymous shared
    memory, a memfd) born from carriers: each carrier maps the new object before the birth
    (which shares the carrier's address space), so both come back sharing it, with the
    checkpoint's content, at every rollback. (The worker is left to init: a child of the
    process is adopted instead, restored from an image, not born from a carrier.)"""
    sbx.files.write("shm.py", SHARED_MEMORY)
    sbx.exec("cd /workspace; nohup python3 shm.py detached >/dev/null 2>&1 &")
    wait_for(lambda: sbx.files.exists("shm-ready"), what="ready")

    def shared(at_cp: str, i: int) -> None:
        _ask(sbx, "bump")   # the child, asleep on the semaphore, shares the new memory
        assert _report(sbx) == at_cp.replace("v=141", "v=241").replace(r"\x01", r"\x02")

    _rollbacks_from_carriers(sbx, "bump", "mutate", 3, shared)


def test_timers_born_from_carriers_run_from_the_rollback(sbx: Sandbox) -> None:
    """A carrier is spawned ahead, with its timerfds made but not armed: they start when
    the rollback lets the process run, so a timer's time left is the checkpoint's, not
    what remained of it when the carrier was made (seconds earlier)."""
    sbx.files.write("timers.py", TIMERS)
    sbx.exec("cd /workspace; nohup python3 timers.py no-signalfd-watch >/dev/null 2>&1 &")
    wait_for(lambda: sbx.files.exists("timers-ready"), what="ready")
    at_cp = _report(sbx)
    _ask(sbx, "left")
    left_at_cp = float(sbx.files.read("state"))
    cp = sbx.checkpoint(mode="full")
    wait_for(lambda: _carriers_ready(sbx), what="a carrier")
    time.sleep(2)
    _ask(sbx, "mutate")
    r = sbx.rollback(cp)
    assert r.process_state == "restored", r.note
    assert _report(sbx) == at_cp
    _ask(sbx, "left")
    assert left_at_cp - float(sbx.files.read("state")) < 1.5


def test_threaded_process_born_from_carriers(sbx: Sandbox) -> None:
    """A multi-threaded process born from a carrier: its threads are cloned in the new
    process with their tids, and its main thread's rseq is registered again (a birth is a
    clone(CLONE_VM), which drops it). Exact at every rollback; afterwards its threads work
    and can be joined, and the carrier keeps its memory."""
    marker = "carrier-threads"
    sbx.files.write("thr.py", THREADED)
    sbx.exec(f"cd /workspace; nohup python3 thr.py {marker} >/dev/null 2>&1 &")
    wait_for(lambda: sbx.files.exists("thr-ready"), what="ready")

    def cpus(at_cp: str, i: int) -> None:
        _ask(sbx, "cpus")
        assert sbx.files.read("state") == b"cpus=True True", f"rollback {i}"

    _rollbacks_from_carriers(sbx, "feed", "feed", 3, cpus)
    live = [p for p, (_, name) in _host_procs(marker).items() if name not in HELD]
    assert len(live) == 1, live
    wait_for(lambda: any(_same_vm(live[0], p) for p, (st, name) in _host_procs(marker).items()
                      if name == "dbx-carrier"), what="its keeper")
    _ask(sbx, "wake")
    joined = _join(sbx)
    assert joined.startswith("alive=[] took=True "), joined


def _born_from_carrier(marker: str) -> bool:
    """Whether the one live process whose command line holds `marker` shares its memory
    with a carrier (its keeper): it was born from one, not spawned from its template."""
    procs = _host_procs(marker)
    live = [p for p, (_, name) in procs.items() if name not in HELD]
    assert len(live) == 1, procs
    return any(_same_vm(live[0], p) for p, (_, name) in procs.items() if name == "dbx-carrier")


def test_file_locks_born_from_carriers(sbx: Sandbox) -> None:
    """flock, POSIX and OFD locks of processes born from carriers: the carrier reopened
    the files ahead, the born process takes the locks (a POSIX lock is its own, not the
    carrier's, and stays when the carrier, now a keeper, closes its copies), at every
    rollback."""
    sbx.files.write("locker.py", LOCKER)
    sbx.files.write("go", "")
    for kind in ("flock", "posix", "ofd"):
        sbx.exec(f"cd /workspace; nohup python3 locker.py {kind} /workspace/lk-{kind} "
                 f"/workspace/go >/dev/null 2>&1 &")
        wait_for(lambda: sbx.files.exists("locked"), what=f"{kind} locked")
        sbx.files.remove("locked")
    cp = sbx.checkpoint(mode="full")
    for i in range(2):
        wait_for(lambda: _carriers_ready(sbx), what="a carrier")
        assert sbx.rollback(cp).process_state == "restored"
        for kind in ("flock", "posix", "ofd"):
            assert _born_from_carrier(f"lk-{kind}"), kind
            assert sbx.exec(TRY_LOCK + f"{kind} /workspace/lk-{kind}").stdout == "held\n", \
                f"rollback {i}: {kind}"
    sbx.files.write("release", "")
    for kind in ("flock", "posix", "ofd"):
        wait_for(lambda: sbx.exec(TRY_LOCK + f"{kind} /workspace/lk-{kind}").stdout
                 == "free\n", what=f"{kind} free", timeout=5)


def test_shared_log_born_from_carriers(sbx: Sandbox) -> None:
    """Two processes writing into one `> log 2>&1`, born from carriers: the plan opened
    the shared description once ahead, both carriers got it, and so do the born
    processes; every line lands after the last one, at every rollback."""
    sbx.files.write("il.py", INTERLEAVED)
    # A left to init (not B's child: a restored parent's children are not born from
    # carriers, cr/adoption.py).
    sbx.exec("cd /workspace; nohup sh -c '(python3 il.py A &); exec python3 il.py B' "
             "> log 2>&1 &")
    wait_for(lambda: min(_interleaved(sbx.files.read("log")).values()) >= 5)
    cp = sbx.checkpoint(mode="full")
    at_cp = _interleaved(sbx.files.read("log"))
    for i in range(2):
        wait_for(lambda: _carriers_ready(sbx), what="a carrier")
        assert sbx.rollback(cp).process_state == "restored"
        assert _born_from_carrier("il.py\0B"), f"rollback {i}"   # its command line
        wait_for(lambda: min(_interleaved(sbx.files.read("log")).values())
                 >= max(at_cp.values()) + 10, timeout=10, what=f"rollback {i}: lines")


def test_a_carrier_made_before_a_write_in_place_is_not_used(sbx: Sandbox) -> None:
    """A process mapping a file privately that is written in place after its carrier was
    made: that carrier's pages show the new bytes, so the rollback spawns the process
    from its template instead, mapping the restored tree's file again. The next carrier,
    made after the write, maps it again itself and is used."""
    sbx.files.write("pages", PAGES)
    sbx.files.write("pm.py", PRIVATE_MAPS)
    sbx.exec("cd /workspace; nohup python3 pm.py >/dev/null 2>&1 &")
    assert _report(sbx) == PRIVATE_AT_CP
    # A file changed within SLACK_NS before the checkpoint counts as changed after it:
    # its carrier maps it again ahead and is rightly used (CI met that window, ~75 ms).
    time.sleep(private_maps.SLACK_NS / 1e9)
    cp = sbx.checkpoint(mode="full")
    wait_for(lambda: _carriers_ready(sbx), what="a carrier")
    sbx.exec(REWRITE_PAGES)
    assert sbx.rollback(cp).process_state == "restored"
    assert not _born_from_carrier("pm.py")
    assert _report(sbx) == PRIVATE_AT_CP
    sbx.exec(REWRITE_PAGES)
    wait_for(lambda: _carriers_ready(sbx), what="a carrier")
    assert sbx.rollback(cp).process_state == "restored"
    assert _born_from_carrier("pm.py")
    assert _report(sbx) == PRIVATE_AT_CP


def test_a_stopped_process_born_from_a_carrier_stops_again(sbx: Sandbox) -> None:
    """A process in a job-control stop, born from its carrier: it enters the stop before
    running any of its code, at every rollback."""
    # init's child, with no child of its own (a child's exit would make its kernel send
    # the orphaned, stopped group SIGCONT)
    sbx.files.write("loop.py", "import os, time\nopen('pid', 'w').write(str(os.getpid()))\n"
                    "i = 0\nwhile True:\n    i += 1\n    open('count', 'w').write(str(i))\n"
                    "    time.sleep(0.05)\n")
    sbx.exec("cd /workspace && (nohup python3 loop.py >/dev/null 2>&1 &)")
    wait_for(lambda: _count(sbx) >= 3)
    sbx.exec("kill -STOP $(cat /workspace/pid)")
    wait_for(lambda: _state_of(sbx) == "T", what="stopped")
    at_cp = sbx.files.read("count")
    cp = sbx.checkpoint(mode="full")
    for i in range(2):
        sbx.exec("kill -CONT $(cat /workspace/pid)")
        wait_for(lambda: _carriers_ready(sbx), what="a carrier")
        assert sbx.rollback(cp).process_state == "restored"
        assert _born_from_carrier("loop.py"), f"rollback {i}"
        assert _state_of(sbx) == "T", f"rollback {i}"
        assert sbx.files.read("count") == at_cp


def test_named_pipes_born_from_carriers(sbx: Sandbox) -> None:
    """A writer and a reader of two named pipes, born from carriers: the plan made ahead
    opened the pipes in the generation the rollback takes (the live ones are another
    tree's) and put the checkpoint's bytes back; at every rollback the reader gets them,
    the writer's later line and EOF."""
    sbx.files.write("fifos.py", FIFO_PAIR)
    sbx.exec("cd /workspace && mkfifo q jobs && "
             "(nohup python3 fifos.py reader >/dev/null 2>&1 &) && "
             "(nohup python3 fifos.py writer >/dev/null 2>&1 &)")
    wait_for(lambda: sbx.files.exists("written"), what="written")
    cp = sbx.checkpoint(mode="full")
    for i in range(2):
        wait_for(lambda: _carriers_ready(sbx), what="a carrier")
        assert sbx.rollback(cp).process_state == "restored"
        assert _born_from_carrier("fifos.py\0reader"), f"rollback {i}"
        assert _drain_fifos(sbx) == FIFO_GOT, f"rollback {i}"


def test_a_shell_on_a_pseudo_terminal_born_from_a_carrier_takes_its_terminal(
        sbx: Sandbox) -> None:
    """An interactive bash on a pty whose driver is not its parent (its starter exited):
    its carrier holds the pty's slave made ahead in the generation the rollback takes, and
    its birth leads a session again and takes the slave as its controlling terminal (the
    carrier, which cannot hand a terminal on, never took it)."""
    _start_pty_harness(sbx, "orphan")
    assert _typed(sbx, "cd /tmp; X=before; stty rows 33 cols 99; echo @$(tty)") == \
        "/dev/pts/0"
    cp = sbx.checkpoint(mode="full")
    _typed(sbx, "X=after; echo @ok")
    for i in range(2):
        wait_for(lambda: _carriers_ready(sbx), what="a carrier")
        assert sbx.rollback(cp).process_state == "restored"
        assert _born_from_carrier("bash\0--norc"), f"rollback {i}"
        assert _typed(sbx, 'echo "@$X $PWD $(stty size) $(cut -d" " -f7 /proc/$$/stat)"') \
            == f"before /tmp 33 99 {136 << 8}", f"rollback {i}"


def test_named_unix_listener_born_from_carriers(sbx: Sandbox) -> None:
    """A server on a unix socket file and a client's connection, born from carriers: the
    plan made the listener ahead, bound in the generation the rollback takes (the live
    server's file is another tree's), and the pair; at every rollback the connection
    carries on from the checkpoint and a new client connects."""
    sbx.files.write("usrv.py", UNIX_SERVER)
    sbx.files.write("ucli.py", UNIX_CLIENT)
    sbx.exec("cd /workspace; nohup python3 usrv.py /tmp/app.sock >/dev/null 2>&1 &")
    wait_for(lambda: sbx.files.exists("listening"), what="listening")
    sbx.exec("cd /workspace; nohup python3 ucli.py /tmp/app.sock >/dev/null 2>&1 &")
    wait_for(lambda: sbx.files.exists("connected"), what="connected")
    assert _ask_client(sbx, 0) == "ping 1"
    cp = sbx.checkpoint(mode="full")
    assert _ask_client(sbx, 1) == "ping 2"
    for i in range(2):
        wait_for(lambda: _carriers_ready(sbx), what="a carrier")
        assert sbx.rollback(cp).process_state == "restored"
        assert _born_from_carrier("usrv.py"), f"rollback {i}"
        assert _ask_client(sbx, 1) == "ping 2", f"rollback {i}"
        r = sbx.exec(_unix_request("/tmp/app.sock", "new"))
        assert (r.exit_code, r.stdout) == (0, "new 3\n"), (i, r)


def test_tcp_connection_born_from_carriers(sbx: Sandbox) -> None:
    """A client and a server connected over loopback, the server still listening beside
    its accepted connection: each carrier holds its end, and the server's carrier its
    listener, as fresh sockets made ahead; the rollback connects the ends and binds the
    listener once the killed processes' sockets are gone, before either runs. At every
    rollback the unread bytes wait again, the two talk on, and the listener takes a new
    connection."""
    sbx.files.write("tcp.py", TCP_ENDS)
    sbx.exec("cd /workspace; nohup python3 tcp.py server 0 >/dev/null 2>&1 &")
    wait_for(lambda: sbx.files.exists("listening"), what="the listener")
    sbx.exec("cd /workspace; nohup python3 tcp.py client 29 >/dev/null 2>&1 &")
    wait_for(lambda: sbx.files.exists("server-ready") and sbx.files.exists("client-ready"),
          what="ready")
    before = (_role(sbx, "server", "report"), _role(sbx, "client", "report"))
    cp = sbx.checkpoint(mode="full")
    for i in range(2):
        wait_for(lambda: _carriers_ready(sbx), what="a carrier")
        _role(sbx, "server", "mutate")
        _role(sbx, "client", "mutate")
        r = sbx.rollback(cp)
        assert r.process_state == "restored", r.note
        assert (_role(sbx, "server", "report"), _role(sbx, "client", "report")) == before, i
        wait_for(lambda: _born_from_carrier("tcp.py\x00server"), timeout=5, what="its keeper")
    assert _role(sbx, "server", "talk") == "1700 b'hello-from-clienthel' b'om-client'"
    assert _role(sbx, "client", "talk") == "29 b'greeting-from-server' b'pong:1700'"
    # The restored listener's backlog takes a connection (the server accepts no more).
    r = sbx.exec("python3 -c \"import socket; socket.create_connection(('127.0.0.1', 7070), "
                 "timeout=5)\"")
    assert r.exit_code == 0, r.stderr


ASYNC_SERVER = r"""
import asyncio, os, socket
state = {"n": 0}
servers = []

async def answer(reader, writer):
    what = (await reader.readline()).strip()
    if what == b"bump":
        state["n"] += 1
    extra = ""
    if what == b"options":
        extra = " reuse=%s" % [s.sockets[0].getsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR)
                               for s in servers]
    writer.write(b"%d %d%s\n" % (os.getpid(), state["n"], extra.encode()))
    await writer.drain()
    writer.close()

async def main():
    srv = await asyncio.start_server(answer, "127.0.0.1", 8013, reuse_address=False)
    srv6 = await asyncio.start_server(answer, "::1", 8014)
    servers.extend((srv, srv6))
    open("/workspace/aserver-ready", "w").close()
    await asyncio.gather(srv.serve_forever(), srv6.serve_forever())

asyncio.run(main())
"""


def test_listening_servers_born_from_carriers(sbx: Sandbox) -> None:
    """An asyncio server listening on IPv4 (without SO_REUSEADDR) and IPv6, its
    listeners watched by its epoll set: its carrier holds them unbound, the rollback binds
    them once the killed server's ports are free, and the server born from the carrier
    (its keeper shares its memory) answers on both with the checkpoint's state, at every
    rollback."""
    sbx.files.write("aserver.py", ASYNC_SERVER)
    sbx.exec("cd /workspace; nohup python3 aserver.py >/dev/null 2>&1 &")
    wait_for(lambda: sbx.files.exists("aserver-ready"), what="ready")

    def ask(what: str, host: str = "127.0.0.1", port: int = 8013) -> str:
        r = sbx.exec(f"python3 -c \"import socket; s = socket.create_connection(('{host}', "
                     f"{port}), timeout=5); s.sendall(b'{what}\\n'); "
                     "print(s.makefile().readline().strip())\"")
        assert r.exit_code == 0, r.stderr
        return r.stdout.strip()

    pid = ask("bump").split()[0]
    cp = sbx.checkpoint(mode="full")
    assert cp.kind == "full", cp.reasons
    for i in range(2):
        wait_for(lambda: _carriers_ready(sbx), what="a carrier")
        assert ask("bump") == f"{pid} 2"
        r = sbx.rollback(cp)
        assert r.process_state == "restored", r.note
        assert ask("look") == f"{pid} 1", i
        assert ask("look", "::1", 8014) == f"{pid} 1", i
        wait_for(lambda: _born_from_carrier("aserver.py"), timeout=5, what="its keeper")
    assert ask("options") == f"{pid} 1 reuse=[0, 1]"   # as the listeners had them


def test_a_posix_queue_holder_is_born_from_its_carrier_with_the_made_queues(
        sbx: Sandbox) -> None:
    """A carrier is spawned before the rollback makes the POSIX message queues again: it is
    given its process's queue descriptors, opened on the made queues, just before the
    birth (native carrier_install_fds). Before, such a process got no carrier (spawned
    from its template: ~1.8 ms more per rollback in benchmarks/ipc_cr.py)."""
    sbx.files.write("pmq.py", PMQ)
    sbx.exec(f"cd /workspace; nohup {PMQ_SH} serve >/dev/null 2>&1 &")
    wait_for(lambda: sbx.files.exists("ready"), what="the queue holder")
    report = f"{PMQ_SH} report jobs results left"
    before = sbx.exec(report).stdout
    cp = sbx.checkpoint(mode="full")
    assert cp.kind == "full", cp.reasons
    for i in range(2):
        wait_for(lambda: _carriers_ready(sbx), what="a carrier")
        sbx.exec(f"{PMQ_SH} take jobs && {PMQ_SH} unlink left")
        assert sbx.rollback(cp).process_state == "restored"
        [live] = [p for p, (_, name) in _host_procs("pmq.py\0serve").items()
                  if name not in HELD]
        wait_for(lambda: any(st == "t" and name == "dbx-carrier" and _same_vm(live, p)
                             for p, (st, name) in _host_procs("pmq.py\0serve").items()),
                 what=f"its keeper (rollback {i}: born from its carrier)")
        assert sbx.exec(report).stdout == before, f"rollback {i}"
        assert _pmq_answer(sbx) == (f"{oct(os.O_RDWR | os.O_NONBLOCK)} 8x64 "
                                    f"{oct(os.O_WRONLY | os.O_NONBLOCK)} 4x128 "
                                    "5:b,5:d,1:a,1:c"), f"rollback {i}"
