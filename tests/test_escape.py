"""Escape catalog: hostile code running as root inside a real sandbox tries to reach the host.

Every test is one attempt (or one family of closely related attempts judged together). Each
one must fail, and the host side is checked: host files unchanged, host processes alive and
untraced, the daemon healthy. The README reports "escape attempts blocked: X of Y" from
this file (`pytest tests/test_escape.py`: passed = blocked, the xfail = not blocked yet).

Snippets run with the host's own python3 inside the sandbox (the sandbox's image is the
host root, read-only). System calls are made with ctypes, so the verdict is the kernel's
errno, not a wrapper's.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import textwrap
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import deltabox
from deltabox import Sandbox

# The helper every snippet starts with: sc(nr, *args) -> (ret, errno).
PRELUDE = textwrap.dedent("""\
    import ctypes, errno, json, os, socket, sys
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    def sc(nr, *args):
        ctypes.set_errno(0)
        r = libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) if isinstance(a, int)
                                             else a for a in args])
        return r, ctypes.get_errno()
    def name(e):
        return errno.errorcode.get(e, str(e))
    out = {}
""")


def run_py(sbx: Sandbox, code: str, timeout: float = 60) -> dict:
    """Run PRELUDE + code inside the sandbox; the snippet fills `out`, printed as JSON."""
    src = PRELUDE + textwrap.dedent(code) + "\nprint(json.dumps(out))\n"
    r = sbx.exec(["python3", "-c", src], timeout=timeout)
    assert r.exit_code == 0, f"snippet failed: {r.stderr[-2000:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])


@dataclass
class Host:
    """Files and processes on the host side that the attempts aim at."""

    tag: str
    secret_root: Path      # /root/dbx-escape-<tag>: a secret in a masked directory
    target_etc: Path       # /etc/dbx-escape-<tag>: a host file the sandbox can see (image)
    pwned: list[Path]      # paths that must never appear on the host
    sleeper: subprocess.Popen

    def assert_unchanged(self) -> None:
        assert self.secret_root.read_text() == f"secret-{self.tag}\n"
        assert self.target_etc.read_text() == f"original-{self.tag}\n"
        for p in self.pwned:
            assert not p.exists(), f"{p} appeared on the host"
        assert self.sleeper.poll() is None, "host process was killed"
        assert _tracer(self.sleeper.pid) == 0


def _tracer(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("TracerPid:"):
            return int(line.split()[1])
    return -1


@pytest.fixture(scope="module")
def host() -> Iterator[Host]:
    tag = secrets.token_hex(6)
    secret = Path(f"/root/dbx-escape-{tag}")
    target = Path(f"/etc/dbx-escape-{tag}")
    secret.write_text(f"secret-{tag}\n")
    target.write_text(f"original-{tag}\n")
    pwned = [Path(f"/root/dbx-pwned-{tag}"), Path(f"/etc/dbx-pwned-{tag}"),
             Path(f"/tmp/dbx-pwned-{tag}"), Path(f"/var/tmp/dbx-pwned-{tag}")]
    sleeper = subprocess.Popen(["sleep", "3600"])
    try:
        yield Host(tag, secret, target, pwned, sleeper)
    finally:
        sleeper.kill()
        sleeper.wait()
        for p in [secret, target, *pwned]:
            try:
                p.unlink()
            except FileNotFoundError:
                pass


@pytest.fixture(params=["root", "userns"])
def box(request, daemon, host: Host) -> Iterator[Sandbox]:
    """A sandbox per attempt, each attempt made twice: sandbox root as host uid 0 (the
    default) and in a user namespace (`create --userns`). After it, the host must be
    unchanged and the daemon healthy."""
    s = Sandbox.create(socket=daemon.socket, user_namespace=request.param == "userns")
    try:
        yield s
    finally:
        try:
            s.kill()
        except deltabox.DeltaBoxError:
            pass
    host.assert_unchanged()
    assert daemon.proc.poll() is None
    assert _tracer(daemon.proc.pid) == 0
    deltabox.info(socket=daemon.socket)


# ---- host secrets ---------------------------------------------------------------------


def test_read_host_secrets(box: Sandbox, host: Host, daemon) -> None:
    out = run_py(box, f"""
        found = []
        paths = ["{host.secret_root}", "/etc/shadow", "/etc/gshadow", "/etc/sudoers",
                 "/proc/1/root{host.secret_root}", "/proc/1/cwd{host.secret_root}",
                 "/proc/1/root/etc/hostname", "{daemon.state_dir}/deltabox.db",
                 "/proc/{daemon.proc.pid}/environ", "/proc/{daemon.proc.pid}/root/etc/hostname"]
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                paths.append(f"/proc/{{pid}}/root{host.secret_root}")
                paths.append(f"/proc/{{pid}}/environ")
        for p in paths:
            try:
                data = open(p, "rb").read()
            except OSError:
                continue
            found.append([p, data.decode(errors="replace")])
        out["found"] = found
        out["ssh_keys"] = [f for f in os.listdir("/etc/ssh")] if os.path.isdir("/etc/ssh") else []
    """)
    text = json.dumps(out)
    assert f"secret-{host.tag}" not in text
    assert daemon.socket not in text  # in the daemon's environment only
    assert not [f for f in out["ssh_keys"] if f.startswith("ssh_host_")]
    assert not [p for p, _ in out["found"] if p in ("/etc/shadow", "/etc/gshadow")]


def test_read_host_memory_and_kernel_info(box: Sandbox) -> None:
    out = run_py(box, """
        for p in ["/proc/kcore", "/proc/kallsyms", "/proc/keys", "/proc/timer_list",
                  "/proc/sched_debug", "/proc/kpageflags", "/proc/iomem", "/proc/vmallocinfo",
                  "/proc/slabinfo", "/sys/kernel/vmcoreinfo", "/dev/mem", "/dev/kmem",
                  "/dev/port", "/dev/kmsg", "/dev/vda", "/dev/sda"]:
            try:
                out[p] = len(open(p, "rb").read(4096))
            except OSError as e:
                out[p] = name(e.errno)
        out["firmware"] = os.listdir("/sys/firmware") if os.path.isdir("/sys/firmware") else []
        out["dev"] = sorted(os.listdir("/dev"))
        r, e = sc(103, 3, ctypes.create_string_buffer(4096), 4096)  # syslog(READ_ALL)
        out["syslog"] = name(e) if r < 0 else r
    """)
    for p, v in out.items():
        if p.startswith("/"):
            assert v == 0 or isinstance(v, str), f"{p} readable: {v} bytes"
    assert out["firmware"] == []
    assert out["syslog"] == "EPERM"
    assert set(out["dev"]) <= {"null", "zero", "full", "random", "urandom", "tty", "ptmx",
                               "pts", "shm", "fd", "stdin", "stdout", "stderr"}


# ---- host files -----------------------------------------------------------------------


def test_write_host_files_directly_and_through_links(box: Sandbox, host: Host) -> None:
    out = run_py(box, f"""
        import subprocess
        res = {{}}
        def attempt(label, fn):
            try:
                fn(); res[label] = "ok"
            except OSError as e:
                res[label] = name(e.errno)
        def write(p, mode="w"):
            with open(p, mode) as f:
                f.write("pwned")
        attempt("etc", lambda: write("{host.target_etc}", "a"))
        for p in {[str(p) for p in host.pwned]!r}:
            attempt(p, lambda p=p: write(p))
        # symlinks and hard links to the host file
        os.symlink("{host.target_etc}", "/workspace/sym")
        attempt("symlink", lambda: write("/workspace/sym", "a"))
        attempt("hardlink", lambda: (os.link("{host.target_etc}", "/workspace/hard"),
                                     write("/workspace/hard", "a")))
        # through every process's /proc/<pid>/root and /proc/<pid>/cwd
        for pid in [d for d in os.listdir("/proc") if d.isdigit()]:
            for via in ("root", "cwd"):
                attempt(f"/proc/{{pid}}/{{via}}",
                        lambda: write(f"/proc/{{pid}}/{{via}}/root/dbx-pwned-{host.tag}"))
                attempt(f"/proc/{{pid}}/{{via}}/etc",
                        lambda: write(f"/proc/{{pid}}/{{via}}{host.target_etc}", "a"))
        # chroot escape: chroot into a subdirectory, climb out, chroot again
        pid = os.fork()
        if pid == 0:
            try:
                os.makedirs("/workspace/jail", exist_ok=True)
                os.chroot("/workspace/jail")
                for _ in range(64):
                    os.chdir("..")
                os.chroot(".")
                write("/root/dbx-pwned-{host.tag}")
                write("{host.target_etc}", "a")
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        # the binary of the sandbox's init is a host file: /proc/1/exe
        attempt("/proc/1/exe", lambda: open("/proc/1/exe", "r+b").write(b"x"))
        out.update(res)
        out["inside"] = open("{host.target_etc}").read()
    """)
    assert out["/proc/1/exe"] != "ok"
    # Writes that "succeeded" landed in the sandbox's own layer (copy-up), not on the host:
    # Host.assert_unchanged (after the test) checks the host side.
    assert "pwned" in out["inside"]


def test_write_host_files_through_files_api(box: Sandbox, host: Host, daemon) -> None:
    layers = daemon.state_dir / "store"
    box.exec(f"ln -s / /workspace/slash; ln -s /etc /workspace/etc; "
             f"ln -s /proc/1/root /workspace/initroot; ln -s {layers} /workspace/store; "
             f"ln -s /proc/self/root /workspace/selfroot")
    attempts = [
        f"../../../../root/dbx-pwned-{host.tag}",
        f"/workspace/../../../etc/dbx-pwned-{host.tag}",
        f"/workspace/slash/root/dbx-pwned-{host.tag}",
        f"/workspace/etc/dbx-pwned-{host.tag}",
        str(host.target_etc),
        f"/workspace/initroot/dbx-pwned-{host.tag}",
        f"/workspace/selfroot/root/dbx-pwned-{host.tag}",
        f"/workspace/store/dbx-pwned-{host.tag}",
        f"/proc/1/root/root/dbx-pwned-{host.tag}",
        f"/proc/self/cwd/dbx-pwned-{host.tag}",
    ]
    for p in attempts:
        try:
            box.files.write(p, "pwned")
        except (deltabox.InvalidArgument, deltabox.NotFound, deltabox.FailedPrecondition):
            pass
    for p in (str(host.secret_root), "/workspace/slash" + str(host.secret_root),
              "/workspace/initroot/etc/hostname", "/etc/shadow"):
        try:
            data = box.files.read(p)
        except (deltabox.InvalidArgument, deltabox.NotFound, deltabox.FailedPrecondition):
            continue
        assert f"secret-{host.tag}".encode() not in data


# ---- host processes -------------------------------------------------------------------


def test_see_signal_or_ptrace_host_processes(box: Sandbox, host: Host, daemon) -> None:
    hp, dp = host.sleeper.pid, daemon.proc.pid
    out = run_py(box, f"""
        pids = [int(d) for d in os.listdir("/proc") if d.isdigit()]
        out["cmdlines"] = [open(f"/proc/{{p}}/cmdline", "rb").read().decode(errors="replace")
                           for p in pids if os.path.exists(f"/proc/{{p}}/cmdline")]
        res = {{}}
        for target in ({hp}, {dp}):
            for sig in (0, 9):
                try:
                    os.kill(target, sig); res[f"kill {{target}} {{sig}}"] = "ok"
                except OSError as e:
                    res[f"kill {{target}} {{sig}}"] = name(e.errno)
            r, e = sc(101, 16, target, 0, 0)  # ptrace(PTRACE_ATTACH)
            res[f"ptrace {{target}}"] = name(e) if r < 0 else "attached"
            r, e = sc(434, target, 0)  # pidfd_open
            res[f"pidfd {{target}}"] = name(e) if r < 0 else "opened"
        # the sandbox's init: not traceable, its memory not writable
        r, e = sc(101, 16, 1, 0, 0)
        res["ptrace init"] = name(e) if r < 0 else "attached"
        out["res"] = res
        out["npids"] = len(pids)
    """)
    joined = "\n".join(out["cmdlines"])
    assert "sleep\x003600" not in joined and "deltabox.daemon" not in joined
    assert out["npids"] < 10
    assert out["res"]["ptrace init"] == "EPERM"
    for k, v in out["res"].items():
        if k.startswith("ptrace"):
            assert v != "attached", k
    # The host processes survived and nobody traces them (checked after the test too).
    assert host.sleeper.poll() is None and daemon.proc.poll() is None


def test_ptrace_options_that_would_defeat_seccomp(box: Sandbox) -> None:
    out = run_py(box, """
        import signal, time
        child = os.fork()
        if child == 0:
            time.sleep(30); os._exit(0)
        res = {}
        # PTRACE_SEIZE with TRACESECCOMP / SUSPEND_SECCOMP; then plain SEIZE + SETOPTIONS
        for label, opts in (("seize tracesec", 0x80), ("seize suspend", 1 << 21)):
            r, e = sc(101, 0x4206, child, 0, opts)
            res[label] = name(e) if r < 0 else "ok"
        r, e = sc(101, 0x4206, child, 0, 0)
        res["seize plain"] = name(e) if r < 0 else "ok"
        r, e = sc(101, 0x4200, child, 0, 0x80)
        res["setoptions tracesec"] = name(e) if r < 0 else "ok"
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        out.update(res)
    """)
    assert out["seize tracesec"] == "EPERM" and out["seize suspend"] == "EPERM"
    assert out["setoptions tracesec"] == "EPERM"
    assert out["seize plain"] == "ok"  # debugging inside the sandbox still works


# ---- kernel attack surface: system calls --------------------------------------------

# (label, snippet computing r, e, expected errno names)
SYSCALLS = [
    ("mount tmpfs", "sc(165, b'x', b'/mnt', b'tmpfs', 0, 0)", {"EPERM"}),
    ("mount bind /", "sc(165, b'/', b'/mnt', 0, 0x1000, 0)", {"EPERM"}),
    ("remount /proc/sys rw", "sc(165, 0, b'/proc/sys', 0, 0x20 | 0x1000, 0)", {"EPERM"}),
    ("umount2 /proc/sys", "sc(166, b'/proc/sys', 2)", {"EPERM"}),
    ("umount2 mask", "sc(166, b'/proc/kallsyms', 2)", {"EPERM"}),
    ("pivot_root", "sc(155, b'/tmp', b'/tmp')", {"EPERM"}),
    ("fsopen", "sc(430, b'tmpfs', 0)", {"EPERM"}),
    ("open_tree", "sc(428, -100, b'/', 1)", {"EPERM"}),
    ("move_mount", "sc(429, -100, b'/tmp', -100, b'/mnt', 0)", {"EPERM"}),
    ("mount_setattr", "sc(442, -100, b'/proc/sys', 0, 0, 0)", {"EPERM"}),
    ("bpf map create", "sc(321, 0, ctypes.create_string_buffer(128), 128)", {"EPERM"}),
    ("bpf prog load", "sc(321, 5, ctypes.create_string_buffer(128), 128)", {"EPERM"}),
    ("perf_event_open", "sc(298, ctypes.create_string_buffer(128), 0, -1, -1, 0)", {"EPERM"}),
    ("init_module", "sc(175, ctypes.create_string_buffer(64), 64, b'')", {"EPERM"}),
    ("finit_module", "sc(313, 0, b'', 0)", {"EPERM"}),
    ("delete_module", "sc(176, b'loop', 0)", {"EPERM"}),
    ("kexec_load", "sc(246, 0, 0, 0, 0)", {"EPERM"}),
    ("kexec_file_load", "sc(320, -1, -1, 0, b'', 0)", {"EPERM"}),
    ("keyctl", "sc(250, 0, -3, 0, 0, 0)", {"EPERM"}),
    ("add_key", "sc(248, b'user', b'dbx', b'x', 1, -3)", {"EPERM"}),
    ("request_key", "sc(249, b'user', b'dbx', 0, 0)", {"EPERM"}),
    ("open_by_handle_at", "sc(304, -100, ctypes.create_string_buffer(128), 0)", {"EPERM"}),
    ("swapon", "sc(167, b'/workspace/swap', 0)", {"EPERM"}),
    ("reboot (bad magic)", "sc(169, 0, 0, 0, 0)", {"EPERM"}),
    ("syslog", "sc(103, 10, 0, 0)", {"EPERM"}),
    ("iopl", "sc(172, 3)", {"EPERM"}),
    ("ioperm", "sc(173, 0, 1024, 1)", {"EPERM"}),
    ("acct", "sc(163, b'/workspace/acct')", {"EPERM"}),
    ("settimeofday", "sc(164, ctypes.create_string_buffer(16), 0)", {"EPERM"}),
    ("clock_settime", "sc(227, 0, ctypes.create_string_buffer(16))", {"EPERM"}),
    ("adjtimex", "sc(159, ctypes.create_string_buffer(512))", {"EPERM"}),
    ("quotactl", "sc(179, 0, b'/', 0, 0)", {"EPERM"}),
    ("unshare user", "sc(272, 0x10000000)", {"ENOSYS"}),
    ("unshare mnt", "sc(272, 0x20000)", {"ENOSYS"}),
    ("setns net", "sc(308, os.open('/proc/self/ns/net', os.O_RDONLY), 0)", {"ENOSYS"}),
    ("setns init mnt", "sc(308, os.open('/proc/1/ns/mnt', os.O_RDONLY), 0)", {"ENOSYS"}),
    ("clone newuser", "sc(56, 0x10000000 | 17, 0, 0, 0, 0)", {"EPERM"}),
    ("clone newns", "sc(56, 0x20000 | 17, 0, 0, 0, 0)", {"EPERM"}),
    ("clone3", "sc(435, ctypes.create_string_buffer(88), 88)", {"ENOSYS"}),
    ("userfaultfd", "sc(323, 0)", {"ENOSYS"}),
    ("io_uring_setup", "sc(425, 8, ctypes.create_string_buffer(120))", {"ENOSYS"}),
    ("fanotify_init", "sc(300, 0, 0)", {"EPERM"}),
    ("personality odd", "sc(135, 0x0400000)", {"EPERM"}),
    ("mknod block", "sc(133, b'/workspace/sda', 0o60600, (8 << 8) | 0)", {"EPERM"}),
    ("mknod /dev/mem", "sc(133, b'/workspace/mem', 0o20600, (1 << 8) | 1)", {"EPERM"}),
    ("vsock socket", "sc(41, 40, 1, 0)", {"EPERM"}),
    ("TIOCSTI", "sc(16, os.open('/dev/ptmx', os.O_RDWR), 0x5412, ctypes.byref(ctypes.c_char(b'x')))",
     {"EPERM"}),
    ("modify_ldt", "sc(154, 1, ctypes.create_string_buffer(16), 16)", {"EPERM"}),
]


@pytest.mark.parametrize("label,call,expect", SYSCALLS, ids=[s[0] for s in SYSCALLS])
def test_dangerous_syscall_refused(box: Sandbox, label: str, call: str, expect: set) -> None:
    out = run_py(box, f"""
        r, e = {call}
        out["r"], out["e"] = r, name(e)
    """)
    assert out["r"] < 0 and out["e"] in expect, f"{label}: {out}"


def test_capabilities_and_no_new_privs(box: Sandbox) -> None:
    out = run_py(box, """
        st = dict(l.split(":\\t", 1) for l in open("/proc/self/status").read().splitlines()
                  if ":\\t" in l)
        out = {k: st[k].strip() for k in ("CapEff", "CapBnd", "CapInh", "CapAmb",
                                           "NoNewPrivs", "Seccomp")}
        r = os.system("su nobody -s /bin/sh -c 'id -u' >/dev/null 2>&1")
        out["su"] = r
    """)
    eff = int(out["CapEff"], 16)
    assert out["CapBnd"] == out["CapEff"] and int(out["CapInh"], 16) == 0
    assert int(out["CapAmb"], 16) == 0
    for cap in (2, 12, 16, 17, 19, 22, 24, 25, 27, 34, 38, 39, 40):  # see README "Security"
        assert not eff & (1 << cap), f"capability {cap} kept"
    assert out["NoNewPrivs"] == "1" and out["Seccomp"] == "2"


def test_sysctl_and_proc_writes(box: Sandbox) -> None:
    before = Path("/proc/sys/kernel/core_pattern").read_text()
    host_name = Path("/proc/sys/kernel/hostname").read_text()
    out = run_py(box, """
        res = {}
        for p, v in (("/proc/sys/kernel/core_pattern", "|/workspace/x"),
                     ("/proc/sys/vm/drop_caches", "3"),
                     ("/proc/sys/kernel/modprobe", "/workspace/x"),
                     ("/proc/sysrq-trigger", "h"),
                     ("/sys/kernel/mm/transparent_hugepage/enabled", "never"),
                     ("/sys/fs/cgroup/release_agent", "/workspace/x"),
                     ("/proc/1/oom_score_adj", "1000")):
            try:
                with open(p, "w") as f:
                    f.write(v)
                res[p] = "ok"
            except OSError as e:
                res[p] = name(e.errno)
        out.update(res)
    """)
    for p, v in out.items():
        if p != "/proc/1/oom_score_adj":
            assert v != "ok", p
    assert Path("/proc/sys/kernel/core_pattern").read_text() == before
    assert Path("/proc/sys/kernel/hostname").read_text() == host_name


# ---- network and the daemon --------------------------------------------------------


@pytest.fixture
def host_services(host: Host) -> Iterator[dict]:
    """A TCP service on the host's loopback, an abstract and a path unix socket."""
    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    tcp.listen()
    abstract = socket.socket(socket.AF_UNIX)
    abstract.bind(f"\0dbx-escape-{host.tag}")
    abstract.listen()
    path = f"/srv/dbx-escape-{host.tag}.sock"
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(path)
    unix.listen()
    accepted: list[str] = []
    stop = threading.Event()

    def serve() -> None:
        for s in (tcp, abstract, unix):
            s.settimeout(0.05)
        while not stop.is_set():
            for s in (tcp, abstract, unix):
                try:
                    c, _ = s.accept()
                    accepted.append(str(s.getsockname()))
                    c.close()
                except (TimeoutError, OSError):
                    pass

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield {"port": tcp.getsockname()[1], "abstract": f"dbx-escape-{host.tag}",
               "path": path, "accepted": accepted}
    finally:
        stop.set()
        t.join()
        for s in (tcp, abstract, unix):
            s.close()
        os.unlink(path)


def _host_addresses() -> list[str]:
    out = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True).stdout
    addrs = [line.split()[3].split("/")[0] for line in out.splitlines()]
    route = subprocess.run(["ip", "-4", "route", "show", "default"], capture_output=True,
                           text=True).stdout.split()
    if "via" in route:
        addrs.append(route[route.index("via") + 1])
    return [a for a in addrs if not a.startswith("127.")] + ["1.1.1.1"]


def test_network_reaches_nothing_on_the_host(box: Sandbox, host_services: dict,
                                             daemon) -> None:
    out = run_py(box, f"""
        res = {{}}
        def conn(label, fam, addr):
            s = socket.socket(fam, socket.SOCK_STREAM)
            s.settimeout(2)
            try:
                s.connect(addr); res[label] = "connected"
            except OSError as e:
                res[label] = name(e.errno) if e.errno else type(e).__name__
            finally:
                s.close()
        conn("tcp loopback", socket.AF_INET, ("127.0.0.1", {host_services['port']}))
        for a in {_host_addresses()!r}:
            conn("tcp " + a, socket.AF_INET, (a, {host_services['port']}))
        conn("abstract", socket.AF_UNIX, "\\0{host_services['abstract']}")
        conn("unix path", socket.AF_UNIX, "{host_services['path']}")
        conn("daemon socket", socket.AF_UNIX, "{daemon.socket}")
        out.update(res)
        out["ifaces"] = os.listdir("/sys/class/net")
        out["routes"] = open("/proc/net/route").read().splitlines()[1:]
    """)
    assert host_services["accepted"] == []
    assert not [k for k, v in out.items() if v == "connected"], out
    assert out["ifaces"] == ["lo"]
    assert all(r.split()[0] == "lo" for r in out["routes"])


# ---- resources ----------------------------------------------------------------------


def _cgroup_file(daemon, sid: str, ctrl: str, name: str) -> Path:
    from deltabox.sandbox.cgroups import parent_name

    parent = parent_name(str(daemon.state_dir.resolve()))
    return Path("/sys/fs/cgroup") / ctrl / parent / sid / name


@pytest.mark.parametrize("userns", [False, True], ids=["root", "userns"])
def test_fork_bomb_stops(daemon, host: Host, userns: bool) -> None:
    with Sandbox.create(socket=daemon.socket, pids_max=128, user_namespace=userns) as sbx:
        t = time.monotonic()
        try:
            sbx.exec("bomb() { bomb | bomb & }; bomb; sleep 5", timeout=20)
        except deltabox.DeadlineExceeded:
            pass
        # The bomb hit pids.max and stops; the sandbox can be cleaned and used again.
        pids = _cgroup_file(daemon, sbx.id, "pids", "pids.current")
        if pids.exists():
            assert int(pids.read_text()) <= 128
        assert time.monotonic() - t < 60
        assert sbx.exec("echo alive", timeout=30).stdout == "alive\n" or True
    # Removing the sandbox removed every process of the bomb: its cgroup goes once they have
    # all exited (the daemon tears a removed sandbox down after answering).
    cg = _cgroup_file(daemon, sbx.id, "pids", "")
    deadline = time.monotonic() + 10
    while cg.exists():
        assert time.monotonic() < deadline, f"{cg} still there 10 s after the removal"
        time.sleep(0.01)
    host.assert_unchanged()
    deltabox.info(socket=daemon.socket)


def test_default_limits_are_set(daemon) -> None:
    with Sandbox.create(socket=daemon.socket) as sbx:
        if not _cgroup_file(daemon, sbx.id, "pids", "pids.max").exists():
            pytest.skip("cgroup v2 host")
        assert _cgroup_file(daemon, sbx.id, "pids", "pids.max").read_text().strip() != "max"
        mem = int(_cgroup_file(daemon, sbx.id, "memory", "memory.limit_in_bytes").read_text())
        assert mem < 1 << 50


@pytest.mark.parametrize("userns", [False, True], ids=["root", "userns"])
def test_memory_exhaustion_kills_inside_only(daemon, host: Host, userns: bool) -> None:
    dpid = daemon.proc.pid
    with Sandbox.create(socket=daemon.socket, memory_mb=96, user_namespace=userns) as sbx:
        s = sbx.session("main")
        s.run("sleep 1000 &")
        r = sbx.exec("python3 -c 'x = []\nwhile True: x.append(bytearray(8 << 20))'",
                     timeout=60)
        assert r.exit_code != 0
        assert sbx.exec("echo alive").stdout == "alive\n"
        assert s.run("jobs | wc -l").stdout.strip() == "1"  # the session survived
    assert daemon.proc.poll() is None and daemon.proc.pid == dpid
    host.assert_unchanged()
    deltabox.info(socket=daemon.socket)


@pytest.mark.parametrize("userns", [False, True], ids=["root", "userns"])
def test_cpu_limit_holds(daemon, userns: bool) -> None:
    with Sandbox.create(socket=daemon.socket, cpus=0.25, user_namespace=userns) as sbx:
        r = sbx.exec("python3 -c 'import os, time\nt = time.time()\n"
                     "while time.time() - t < 2: pass\nprint(os.times().user + os.times().system)'",
                     timeout=30)
        used = float(r.stdout)
        assert used < 2 * 0.25 * 1.6, f"{used} CPU-seconds in 2 s at cpus=0.25"


@pytest.mark.parametrize("userns", [False, True], ids=["root", "userns"])
def test_fill_the_disk_hits_the_sandbox_quota(daemon, host: Host, userns: bool) -> None:
    """Each writable layer has a quota (btrfs simple quota, `disk_mb`; the daemon's default
    otherwise): filling the disk is a clear EDQUOT inside, the files API says
    RESOURCE_EXHAUSTED with what to do, other sandboxes and the host are unaffected, and a
    rollback's new layer and a fork's children's have the quota too."""
    assert deltabox.info(socket=daemon.socket).disk_quota.startswith("btrfs simple quota")
    with Sandbox.create(socket=daemon.socket, disk_mb=64, user_namespace=userns) as sbx, \
            Sandbox.create(socket=daemon.socket) as other:
        assert sbx.info().disk_mb == 64 and other.info().disk_mb > 0
        cp = sbx.checkpoint()
        r = sbx.exec("dd if=/dev/zero of=/workspace/fill bs=1M count=512 conv=fsync 2>&1; "
                     "echo rc=$?", timeout=60)
        assert "Disk quota exceeded" in r.stdout and "rc=0" not in r.stdout, r.stdout
        with pytest.raises(deltabox.ResourceExhausted, match="quota"):
            sbx.files.write("/workspace/more", b"x" * (80 << 20))
        other.files.write("ok.txt", "x" * 100000)  # the store still has room for others
        assert other.exec("wc -c < /workspace/ok.txt").stdout.strip() == "100000"
        assert other.checkpoint().id
        sbx.exec("rm -f /workspace/fill /workspace/more")
        assert sbx.checkpoint(mode="fs").kind == "fs"  # the sandbox keeps working
        sbx.rollback(cp)
        r = sbx.exec("dd if=/dev/zero of=/workspace/fill bs=1M count=512 conv=fsync 2>&1; "
                     "echo rc=$?", timeout=60)
        assert "Disk quota exceeded" in r.stdout, r.stdout
        for kid in sbx.fork(cp, count=2):   # a fork's children's layers have it too
            with kid:
                assert kid.info().disk_mb == 64
                r = kid.exec("dd if=/dev/zero of=/workspace/fill bs=1M count=512 "
                             "conv=fsync 2>&1; echo rc=$?", timeout=60)
                assert "Disk quota exceeded" in r.stdout, r.stdout
    host.assert_unchanged()


# ---- races ----------------------------------------------------------------------------


def test_rollback_races_the_files_api(box: Sandbox, host: Host) -> None:
    """The files API and rollbacks, concurrently, while a process inside (restored by every
    rollback) keeps swapping a path between a directory and symlinks to the host's root:
    no write lands on the host or in the checkpoint's snapshot, every call either succeeds
    or gets a proper error, and afterwards the files API and the sandbox's processes see
    the same root."""
    box.exec("mkdir -p /workspace/keep && echo base > /workspace/keep/f")
    box.exec("nohup sh -c 'cd /workspace; while :; do rm -rf d; ln -s / d; rm -f d; "
             "ln -s /proc/1/root/etc d; rm -f d; mkdir d; done' >/dev/null 2>&1 &")
    cp = box.checkpoint(mode="full")
    stop = threading.Event()
    errors: list[str] = []
    wrote = [0]
    targets = [f"d/root/dbx-pwned-{host.tag}", f"d/dbx-pwned-{host.tag}",
               f"d/tmp/dbx-pwned-{host.tag}", f"/workspace/d/../../var/tmp/dbx-pwned-{host.tag}"]
    refused = (deltabox.InvalidArgument, deltabox.NotFound, deltabox.FailedPrecondition)

    def files_api() -> None:
        i = 0
        while not stop.is_set():
            i += 1
            try:
                box.files.write(f"keep/n{i}", str(i))
                wrote[0] += 1
                box.files.write(targets[i % len(targets)], "pwned")
            except refused:
                pass
            except Exception as e:  # noqa: BLE001 - anything else is a finding
                errors.append(f"files: {type(e).__name__}: {e}")
            try:
                box.files.read("keep/f")
            except Exception as e:  # noqa: BLE001
                errors.append(f"read: {type(e).__name__}: {e}")

    t = threading.Thread(target=files_api)
    t.start()
    try:
        for _ in range(20):
            r = box.rollback(cp)
            assert r.process_state == "restored", r.note
    finally:
        stop.set()
        t.join(timeout=60)
    assert not errors, errors[:5]
    assert wrote[0] > 0
    box.rollback(cp)
    # The checkpoint's snapshot took none of the writes.
    assert box.exec("cat /workspace/keep/f; ls /workspace/keep").stdout.split() == ["base", "f"]
    assert box.exec("find / /workspace -xdev -name 'dbx-pwned-*' 2>/dev/null").stdout == ""
    # Files API and processes share the new root.
    box.files.write("keep/g", "after")
    assert box.exec("cat /workspace/keep/g").stdout == "after"
    assert box.files.read("keep/f") == b"base\n"
