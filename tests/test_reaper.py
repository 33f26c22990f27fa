"""The daemon reaps zombies that sandbox processes leave to it as their subreaper (or a
restored process could not get its pid back), and only those."""

from __future__ import annotations

import subprocess
import sys
import textwrap

# Run in a child interpreter: becoming a subreaper is for the life of the process.
SCENARIO = textwrap.dedent("""
    import ctypes, os, sys, time
    from deltabox.sandbox import reaper

    reaper.become_subreaper()
    libc = ctypes.CDLL(None, use_errno=True)
    CLONE_NEWPID = 0x20000000

    def orphan_in_nested_pidns(exit_code):
        # A (our child) makes a pid namespace and forks B there (pid 1 of it), then exits:
        # B is handed to us, the nearest subreaper, like a sandbox command whose dbx-enter
        # died. Returns the pipe that lets B exit.
        r, w = os.pipe()
        a = os.fork()
        if a == 0:
            if libc.unshare(CLONE_NEWPID) != 0:
                os._exit(3)
            b = os.fork()
            if b == 0:
                os.read(r, 1)           # until the test lets it go
                os._exit(exit_code)
            os._exit(0)
        os.waitpid(a, 0)
        return r, w

    # No zombie among our children: nothing reaped (the fast path).
    assert reaper.reap_orphans() == 0

    r, w = orphan_in_nested_pidns(7)
    kids = reaper._children()
    assert len(kids) == 1, kids
    (b,) = kids
    assert reaper.reap_orphans() == 0, "a running orphan is not reaped"
    os.write(w, b"x")                   # B exits: now an orphan zombie of ours
    deadline = time.monotonic() + 5
    while not reaper._zombie(b):
        assert time.monotonic() < deadline, "B did not exit"
        time.sleep(0.01)
    assert reaper.reap_orphans(skip={b}) == 0, "skipped children are left alone"
    assert reaper.reap_orphans() == 1
    assert not os.path.exists(f"/proc/{b}"), "the zombie is gone"

    # A zombie of our own pid namespace (a helper of ours) is left to whoever awaits it.
    h = os.fork()
    if h == 0:
        os._exit(0)
    while not reaper._zombie(h):
        time.sleep(0.01)
    assert reaper.reap_orphans() == 0
    assert os.waitpid(h, 0)[0] == h
    print("ok")
""")


def test_orphan_zombies_of_sandbox_namespaces_are_reaped_and_nothing_else():
    out = subprocess.run([sys.executable, "-c", SCENARIO], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "ok"


# A killed pid namespace's init waits in the kernel until every process of the namespace is
# reaped; a traced one that died can be reaped by its tracer only (the daemon traces process
# templates and carriers). Run in a child interpreter: it traces and forks.
TRACEE_SCENARIO = textwrap.dedent("""
    import ctypes, os, select, signal, time
    from deltabox.sandbox import reaper

    libc = ctypes.CDLL(None, use_errno=True)
    CLONE_NEWPID, PTRACE_SEIZE = 0x20000000, 0x4206

    def readable(fd, timeout):
        p = select.poll()
        p.register(fd, select.POLLIN)
        return bool(p.poll(timeout * 1000))

    r, w = os.pipe()
    a = os.fork()
    if a == 0:                          # A unshares; its child I is pid 1 of the namespace
        if libc.unshare(CLONE_NEWPID) != 0:
            os._exit(3)
        i = os.fork()
        if i == 0:
            if os.fork() == 0:          # C: a process of the namespace, to be traced by us
                time.sleep(600)
                os._exit(0)
            while True:                 # I reaps, as a sandbox's init does
                try:
                    os.wait()
                except ChildProcessError:
                    time.sleep(0.05)
        os.write(w, str(i).encode())    # I's pid as the host sees it
        os._exit(0)
    os.waitpid(a, 0)
    ipid = int(os.read(r, 64))
    ifd = os.pidfd_open(ipid)
    try:
        deadline = time.monotonic() + 5
        while not (kids := open(f"/proc/{ipid}/task/{ipid}/children").read().split()):
            assert time.monotonic() < deadline, "C was not forked"
            time.sleep(0.01)
        cpid = int(kids[0])
        assert libc.ptrace(PTRACE_SEIZE, cpid, 0, 0) == 0, ctypes.get_errno()
        cfd = os.pidfd_open(cpid)
        signal.pidfd_send_signal(cfd, signal.SIGKILL)
        assert readable(cfd, 5), "the traced process did not die"
    finally:
        signal.pidfd_send_signal(ifd, signal.SIGKILL)
    assert not readable(ifd, 0.5), "init exited with a traced zombie unreaped (kernel changed?)"
    reaped = reaper.reap_dead_tracees()
    assert [x.split()[0] for x in reaped] == [str(cpid)], reaped
    assert readable(ifd, 5), "init did not finish exiting once the tracee was reaped"
    print("ok")
""")


def test_a_dead_tracee_holds_its_namespace_init_until_reaped():
    """reap_dead_tracees (runtime.kill_all calls it when killed processes do not exit):
    a removal used to wait 5 s and leave the sandbox's cgroup when a carrier died
    outside the ptrace thread's jobs (seen in CI)."""
    out = subprocess.run([sys.executable, "-c", TRACEE_SCENARIO], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "ok"
