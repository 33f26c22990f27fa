"""What a process holds, and what its checkpoint and rollback cost: a plain python process
(the baseline) against one running an asyncio event loop (an epoll instance, its self-pipe
socket pair, an eventfd in its epoll set and a socket pair with bytes waiting:
deltabox/cr/eventloop.py), one holding a deleted temporary file (deltabox/cr/unlinked.py),
one with a pool of four idle worker threads (a ThreadPoolExecutor: native/threads.c) and
one sharing memory with a worker process it forked (multiprocessing's Value and two
semaphores, and --temp-mb of anonymous shared memory: copied at each checkpoint and mapped
again at each rollback, deltabox/cr/unlinked.py; the worker is forked before the parent
allocates its --mb, so it is a small second process) and one watching --watch-dirs
directories with inotify, as a dev server with hot reload watches its project
(deltabox/cr/watches.py: each watch's file found by path at the checkpoint and watched
again at the rollback), and a plain one a shell waits for (`cd dir && nohup prog &` leaves
a subshell in wait4: restored as that shell's own child from an image of its template,
its memory copied from the template, deltabox/cr/adoption.py; every other kind starts with
`cd dir; nohup prog &`, no shell waiting), and the plain one beside an idle bash session
(`session`) or a session with a small background job (`job`: `sleep 1000 &`, adopted by
the restored shell, checked to be its child after every rollback), or beside a detached
tmux session whose pane runs an idle interactive bash (`tmux`: the pty made again at its
index, the pane's shell taking it back as its controlling terminal, deltabox/cr/ptys.py;
checked after every rollback by typing into the pane), or beside an idle session on a
pseudo-terminal (`tty`: the daemon holds its master, a restore gives it a new one; checked
after every rollback to run on /dev/pts/0), or the plain one started by a python that polls it (`polled`: a program's
child, adopted by its restored parent whatever its size since stop 53: its memory copied
at every rollback, deltabox/cr/adoption.py; its parent's pid checked), or beside a JVM
(`jvm`: OpenJDK, a few dozen
threads, the NIO socket whose peer it closed, deltabox/cr/eventloop.py LoneSocket; its own
counter checked too), or the plain one run as another user (`user`: uid 1000 with setsid
and setpriv, as a database's server runs; its template rebuilt as root's from an image at
each checkpoint, its credentials given back last at each rollback: deltabox/cr/creds.py;
its uid checked), or the plain one with a bound UDP socket and one connected to it
(`udp`: made again bound and connected at each rollback, deltabox/cr/udp.py; a datagram
sent through the connected one checked to arrive from its port), or the plain one with
netlink sockets as Chromium's browser process holds them (`netlink`: a route socket in
three groups and a device monitor's uevent socket with SO_PASSCRED and an 11-instruction
filter, made again at each rollback, deltabox/cr/netlink.py; their port ids and filter
checked, and a dump of the links through the route socket), in the same run on one
private daemon, each in a sandbox of its own with the same memory (--mb).

Each rep, for every kind in turn (the order rotates): the process changes its state (a
counter and a page of its memory), pauses (--think: the warm pool prepares meanwhile),
`checkpoint()` is timed; once the checkpoint's background process dump is written and dirty
pages are flushed (untimed: no call pays for another's background work), the process changes
again, pauses, `rollback()` to that checkpoint is timed, and the process's report (counter, memory CRC, the bytes in its socket pair, or
the temporary file's hash and offset, the pool's thread ids and a job it ran, the shared
counter and memory's CRC: the worker bumps them at each change, the number of watches and
whether a file closed after writing in one of the directories is reported on its watch;
and its parent's pid, for every kind) must equal the one taken before the checkpoint.
Client-side latency through the SDK; the daemon's own duration
beside it; and per checkpoint, how long after its answer it settled (its templates and
snapshot made: a rollback to it waits for that) and how long its processes were held. JSON and a PNG to --out (default benchmarks/out).

    .venv/bin/python -m benchmarks.process_kinds [--reps 20] [--mb 50] [--temp-mb 8]
        [--watch-dirs 200]
"""

from __future__ import annotations

import argparse
import os
import re
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (DEFAULT_OUT, PrivateDaemon, finish_figure, latency_boxplot, log,
                               machine_info, pyplot, record_cleanup, run_main, stats,
                               terminate_as_exception, wait_until, write_json)
from deltabox import Sandbox

KINDS = ("plain", "asyncio", "tempfile", "threads", "shared", "watcher", "waited",
         "session", "job", "tmux", "tty", "jvm", "polled", "user", "udp", "netlink")
# Kinds whose process is the plain one, beside a bash session: idle (`session`), with a
# background job (`job`: `sleep 1000 &`, adopted by the restored shell: adoption.py), or
# idle on a pseudo-terminal (`tty`).
SESSION_KINDS = {"session": "true", "job": "sleep 1000 &", "tty": "true"}

PROG = r"""
import asyncio, concurrent.futures, ctypes, hashlib, os, select, socket, struct, sys
import tempfile, time, zlib
kind, mb, temp_mb, dirs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
if kind == "shared":   # a worker sharing memory with its parent, forked while it is small
    import mmap, multiprocessing as mp
    ctx = mp.get_context("fork")
    val, go, done = ctx.Value("i", 0), ctx.Semaphore(0), ctx.Semaphore(0)
    shm = mmap.mmap(-1, temp_mb << 20)
    shm[:] = os.urandom(temp_mb << 20)
    if os.fork() == 0:
        while True:
            go.acquire()
            with val.get_lock():
                val.value += 1
            shm[val.value * 4096 % len(shm)] ^= 0xFF
            done.release()
buf = bytearray(os.urandom(1 << 20)) * mb
n = 0
extra = {}
if kind == "tempfile":
    t = tempfile.TemporaryFile(dir="/workspace")
    t.write(os.urandom(temp_mb << 20))
    t.seek(12345)
if kind == "watcher":   # a project tree watched directory by directory
    libc = ctypes.CDLL(None)
    ino = libc.inotify_init1(os.O_NONBLOCK)
    wds = []
    for i in range(dirs):
        os.makedirs(f"/workspace/tree/d{i}", exist_ok=True)
        wds.append(libc.inotify_add_watch(ino, f"/workspace/tree/d{i}".encode(), 0x108))

def events():
    out = []
    while select.select([ino], [], [], 0 if out else 2)[0]:
        try:
            buf = os.read(ino, 65536)
        except BlockingIOError:
            break
        at = 0
        while at < len(buf):
            wd, _mask, _cookie, size = struct.unpack_from("=iIII", buf, at)
            out.append((wd, buf[at + 16:at + 16 + size].rstrip(b"\0").decode()))
            at += 16 + size
    return out

def probe():   # whether a file closed after writing in one directory shows on its watch
    i = n % dirs
    open(f"/workspace/tree/d{i}/probe", "a").close()
    return (wds[i], "probe") in events()
if kind == "udp":   # a bound UDP socket and one connected to it (deltabox/cr/udp.py)
    us = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    us.bind(("127.0.0.1", 9200))
    uc = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    uc.connect(("127.0.0.1", 9200))
if kind == "netlink":   # Chromium's address tracker and device monitor (cr/netlink.py)
    nr = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, 0)
    nr.bind((0, 0x113))
    nu = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, 15)
    nu.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    accept_all = ctypes.create_string_buffer(b"".join(
        struct.pack("=HBBI", 0x06, 0, 0, 0xffff) for _ in range(11)))
    nu.setsockopt(socket.SOL_SOCKET, 26, struct.pack("=H6xQ", 11,
                                                     ctypes.addressof(accept_all)))
    nu.bind((0, 0))

def links():   # RTM_GETLINK dumped through the route socket: how many links
    nr.send(struct.pack("=IHHII", 32, 18, 0x301, n, 0) + bytes(16))
    count = 0
    while True:
        data, off = nr.recv(65536), 0
        while off < len(data):
            length, typ = struct.unpack_from("=IH", data, off)
            if typ == 3:
                return count
            count += typ == 16
            off += (length + 3) & ~3
if kind == "threads":   # four idle workers, each waiting on the pool's queue
    pool = concurrent.futures.ThreadPoolExecutor(4)
    for f in [pool.submit(time.sleep, 0.05) for _ in range(4)]:
        f.result()

def report():
    out = f"n={n} crc={zlib.crc32(buf)} ppid={os.getppid()}"
    if kind == "asyncio":
        a, b = extra["a"], extra["b"]
        data = a.recv(100)
        b.send(data)
        out += f" pair={data!r}"
    if kind == "tempfile":
        data = os.pread(t.fileno(), (temp_mb << 20) + 1, 0)
        out += f" temp={hashlib.sha1(data).hexdigest()} at={t.tell()}"
    if kind == "threads":
        tids = sorted(w.native_id for w in pool._threads)
        out += f" tids={tids} job={pool.submit(sum, buf[:4096]).result()}"
    if kind == "shared":
        out += f" val={val.value} shm={zlib.crc32(shm)}"
    if kind == "watcher":
        out += f" watches={len(set(wds))} seen={probe()}"
    if kind == "udp":   # sent through the connected one, from its own port
        uc.send(str(n).encode())
        got, came = us.recvfrom(100)
        out += f" udp={got.decode()} port={uc.getsockname()[1]} from={came == uc.getsockname()}"
    if kind == "netlink":
        flen = ctypes.c_uint(0)
        ctypes.CDLL(None).getsockopt(nu.fileno(), 1, 26, None, ctypes.byref(flen))
        out += f" nl={nr.getsockname()} {nu.getsockname()} filter={flen.value} links={links()}"
    return out

def step():
    global n
    if os.path.exists("/workspace/bump"):
        n += 1
        buf[(n * 4096) % len(buf)] ^= 0xFF
        if kind == "shared":   # the worker answers through the shared semaphores
            go.release()
            assert done.acquire(timeout=10), "the worker did not answer"
        os.remove("/workspace/bump")
    if os.path.exists("/workspace/report"):
        open("/workspace/.state", "w").write(report())
        os.rename("/workspace/.state", "/workspace/state")
        os.remove("/workspace/report")

async def loop_main():
    extra["ev"] = os.eventfd(0, os.EFD_NONBLOCK)   # in the epoll set, idle
    extra["a"], extra["b"] = socket.socketpair()
    extra["a"].setblocking(False)
    extra["b"].send(b"waiting")
    asyncio.get_running_loop().add_reader(extra["ev"], lambda: None)
    open("/workspace/ready", "w").write("1")
    while True:
        step()
        await asyncio.sleep(0.005)

if kind == "asyncio":
    asyncio.run(loop_main())
open("/workspace/ready", "w").write("1")
while True:
    step()
    time.sleep(0.005)
"""


# The `jvm` kind: beside the plain process, a JVM (OpenJDK: a few dozen threads, its NIO
# socket whose peer it closed, a perf-data file mapped shared) counting in its heap.
JVM_PROG = """
import java.nio.file.*;
public class Count {
    public static void main(String[] args) throws Exception {
        Path w = Path.of("/workspace");
        java.util.List<int[]> kept = new java.util.ArrayList<>();
        Files.writeString(w.resolve("jready"), "1");
        while (true) {
            if (Files.exists(w.resolve("jbump"))) {
                kept.add(new int[1024]);
                Files.delete(w.resolve("jbump"));
            }
            if (Files.exists(w.resolve("jreport"))) {
                Files.writeString(w.resolve(".jstate"), " jvm=" + kept.size());
                Files.move(w.resolve(".jstate"), w.resolve("jstate"),
                           StandardCopyOption.ATOMIC_MOVE);
                Files.delete(w.resolve("jreport"));
            }
            Thread.sleep(5);
        }
    }
}
"""


def _ask(sbx: Sandbox, what: str) -> None:
    sbx.files.write(what, "1")
    wait_until(lambda: not sbx.files.exists(what), what)


def _report(sbx: Sandbox, kind: str = "") -> str:
    """The process's report (and the JVM's, for `jvm`)."""
    out = ""
    for name in ("state", "jstate") if kind == "jvm" else ("state",):
        if sbx.files.exists(name):
            sbx.files.remove(name)
        _ask(sbx, "report" if name == "state" else "jreport")
        wait_until(lambda: sbx.files.exists(name), "the report")
        out += sbx.files.read(name).decode()
    return out


def _bump(sbx: Sandbox, kind: str) -> None:
    _ask(sbx, "bump")
    if kind == "jvm":
        _ask(sbx, "jbump")


def start(d: PrivateDaemon, kind: str, mb: int, temp_mb: int, dirs: int) -> Sandbox:
    """The kind's process, started so that no shell waits for it (`cd dir; nohup prog &`),
    but for `waited`: `cd dir && nohup prog &` leaves a subshell waiting for it, so a
    restore gives it back to that shell (deltabox/cr/adoption.py: its memory copied)."""
    sbx = Sandbox.create(socket=d.socket)
    sbx.files.write("prog.py", PROG)
    then = "&&" if kind == "waited" else ";"
    prog = "plain" if kind in SESSION_KINDS or kind in ("tmux", "jvm", "polled", "user") \
        else kind
    args = f"prog.py {prog} {mb} {temp_mb} {dirs}"
    if kind == "polled":   # the child of a python that polls it (adopted: adoption.py)
        sbx.files.write("poll.py", "import subprocess, sys, time\n"
                        f"p = subprocess.Popen([sys.executable] + {args.split()!r})\n"
                        "while p.poll() is None:\n    time.sleep(0.05)\n")
        args = "poll.py"
    python = "python3"
    if kind == "user":   # another user's server (deltabox/cr/creds.py)
        sbx.exec("chmod 777 /workspace")
        python = "setsid setpriv --reuid 1000 --regid 1000 --clear-groups python3"
    sbx.exec(f"cd /workspace {then} nohup {python} {args} >/dev/null 2>&1 &")
    wait_until(lambda: sbx.files.exists("ready"), f"the {kind} process")
    if kind in SESSION_KINDS:
        sbx.session("main", tty=kind == "tty").run(SESSION_KINDS[kind])
    if kind == "tmux":
        sbx.exec("tmux new-session -d -s main -x 100 -y 30 'bash --norc --noprofile -i'")
        _pane_is_back(sbx, 0)
    if kind == "jvm":
        sbx.files.write("Count.java", JVM_PROG)
        r = sbx.exec("cd /workspace && javac Count.java && "
                     "(nohup java -Xmx64m -cp . Count >/dev/null 2>&1 &)", timeout=120)
        if r.exit_code != 0:
            raise RuntimeError(f"starting the JVM failed: {r.stderr}")
        wait_until(lambda: sbx.files.exists("jready"), "the JVM")
    return sbx


def _pane_is_back(sbx: Sandbox, n: int) -> None:
    """The tmux pane's shell answers what is typed into it, on /dev/pts/0, its
    controlling terminal (tty_nr 136:0)."""
    mark = f"@{n} /dev/pts/0 {136 << 8}"
    sbx.exec(f"""tmux send-keys -t main 'echo "@{n} $(tty) $(cut -d" " -f7 /proc/$$/stat)"' """
             "Enter")
    wait_until(lambda: mark in [x.rstrip() for x in
                                sbx.exec("tmux capture-pane -p -t main").stdout.split("\n")],
               f"the tmux pane's answer {mark!r}")


def _job_is_the_shells(sbx: Sandbox) -> None:
    """The session's background job is the restored shell's own child, still running."""
    r = sbx.session("main").run('echo "$(ps -o ppid= -p $(jobs -p)) $BASHPID"; jobs')
    ids = r.stdout.split("\n")[0].split()
    if len(ids) != 2 or ids[0] != ids[1] or "Running" not in r.stdout:
        raise RuntimeError(f"after the rollback the session's job is not its child: {r.stdout!r}")


def _dump_done(sbx: Sandbox, cp_id: str) -> None:
    """Until the checkpoint's background process dump is no longer pending."""
    def done() -> bool:
        cp = sbx.get_checkpoint(cp_id)
        return not any(r.startswith("process dump:") and "pending" in r for r in cp.reasons)
    wait_until(done, "the process dump")


def _settled(sbx: Sandbox, cp_id: str) -> tuple[float, float]:
    """(ms after the checkpoint's answer until its templates and snapshot were made: the
    checkpoint is pending until then, 0 if made before the answer; ms its sandbox was
    frozen or its processes held in their stops), from its reasons and freeze_ms."""
    deadline = time.monotonic() + 10
    while True:
        cp = sbx.get_checkpoint(cp_id)
        made = [m for r in cp.reasons if (m := re.search(r"made ([\d.]+) ms after the answer",
                                                          r))]
        if made or not any("right after this answer" in r for r in cp.reasons) \
                or time.monotonic() > deadline:
            return (float(made[0][1]) if made else 0.0), cp.freeze_ms
        time.sleep(0.02)


def one_rep(sbx: Sandbox, think: float, kind: str = "", dump_wait: bool = True
            ) -> dict[str, float]:
    """Change, checkpoint; change, roll back; check. Latencies in ms. Between the timed
    calls the checkpoint's process dump is waited for and dirty pages are written out
    (untimed), so no call pays for another's background work. (Not btrfs's cleaner of the
    layers rollbacks drop: on this VM it can take minutes with the CPUs idle.)"""
    os.sync()
    _bump(sbx, kind)
    want = _report(sbx, kind)
    time.sleep(think)
    t0 = time.perf_counter()
    cp = sbx.checkpoint()
    ck = (time.perf_counter() - t0) * 1000
    if cp.kind != "full":
        raise RuntimeError(f"checkpoint kind {cp.kind}: {cp.reasons}")
    settled, held = _settled(sbx, cp.id)
    if dump_wait:
        _dump_done(sbx, cp.id)
    os.sync()
    _bump(sbx, kind)
    time.sleep(think)
    t0 = time.perf_counter()
    rb = sbx.rollback(cp)
    rb_ms = (time.perf_counter() - t0) * 1000
    if rb.process_state != "restored":
        raise RuntimeError(f"rollback: {rb.process_state}: {rb.note}")
    got = _report(sbx, kind)
    if got != want:
        raise RuntimeError(f"after the rollback the process reports {got!r}, not {want!r}")
    if kind == "job":
        _job_is_the_shells(sbx)
    if kind == "tmux":
        _pane_is_back(sbx, int(time.time() * 1000) % 1_000_000)
    if kind == "tty":
        out = sbx.session("main", tty=True).run("tty").stdout
        if out != "/dev/pts/0\r\n":
            raise RuntimeError(f"after the rollback the tty session says {out!r}")
    if kind == "user":
        uids = sbx.exec("ps -o uid= -C python3").stdout.split()
        if uids != ["1000"]:
            raise RuntimeError(f"after the rollback the process runs as uid {uids}")
    return {"checkpoint": ck, "checkpoint_server": cp.duration_ms,
            "rollback": rb_ms, "rollback_server": rb.duration_ms,
            "settled_after_answer": settled, "held": held}


OPS = ("checkpoint", "checkpoint_server", "rollback", "rollback_server")
# Per checkpoint, not timed by the client: how long after its answer it settled, and how
# long its processes were held (a rebuilt template, `user`, is made in between).
SETTLE_OPS = ("settled_after_answer", "held")


def summarize(runs: list[dict[str, Any]], kinds: tuple[str, ...] = KINDS) -> dict[str, Any]:
    s: dict[str, Any] = {k: {op: stats([r[op] for r in runs if r["kind"] == k])
                             for op in OPS + SETTLE_OPS} for k in kinds}
    s["p50_over_plain"] = {k: {op: s[k][op]["p50"] / s["plain"][op]["p50"] for op in OPS}
                           for k in kinds if k != "plain"}
    return s


def plot(runs: list[dict[str, Any]], path: Path, machine: dict[str, Any]) -> Path | None:
    try:
        plt = pyplot()
    except ImportError:
        return None
    kinds = [k for k in KINDS if any(r["kind"] == k for r in runs)]
    groups = {op: {k: [r[op] for r in runs if r["kind"] == k] for k in kinds} for op in OPS}
    fig, ax = plt.subplots(figsize=(10, 4.5))
    latency_boxplot(ax, groups, log_scale=False)
    finish_figure(fig, path, "by what the process holds (client; _server: daemon)", machine)
    return path


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.process_kinds", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--mb", type=int, default=50, help="memory of each process (MiB)")
    p.add_argument("--temp-mb", type=int, default=8,
                   help="size of the deleted temp file and of the shared memory (MiB)")
    p.add_argument("--watch-dirs", type=int, default=200,
                   help="directories the watcher kind watches with inotify")
    p.add_argument("--think", type=float, default=0.3, help="pause before each op (s)")
    p.add_argument("--kinds", default=",".join(KINDS),
                   help="comma-separated subset of " + ", ".join(KINDS) + " (plain always)")
    p.add_argument("--no-dump-wait", action="store_true",
                   help="roll back without waiting for the checkpoint's process dump (a "
                        "restore that adopts then makes its own image of the child)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args()
    kinds = tuple(k for k in KINDS if k == "plain" or k in args.kinds.split(","))
    if unknown := set(args.kinds.split(",")) - set(KINDS):
        p.error(f"unknown kinds: {', '.join(sorted(unknown))}")
    wait = not args.no_dump_wait
    runs: list[dict[str, Any]] = []
    with terminate_as_exception(), PrivateDaemon() as d:
        boxes: dict[str, Sandbox] = {}
        try:
            for k in kinds:
                boxes[k] = start(d, k, args.mb, args.temp_mb, args.watch_dirs)
            for k in kinds:  # warm-up: first checkpoint and rollback of each
                one_rep(boxes[k], args.think, k, wait)
            for rep in range(args.reps):
                order = kinds[rep % len(kinds):] + kinds[:rep % len(kinds)]
                for k in order:
                    runs.append({"kind": k, "rep": rep,
                                 **one_rep(boxes[k], args.think, k, wait)})
                if rep % 5 == 4:
                    log(f"rep {rep + 1}/{args.reps}")
        finally:
            for b in boxes.values():
                b.kill()
        result: dict[str, Any] = {"benchmark": "process_kinds", "reps": args.reps,
                                  "mb": args.mb, "temp_mb": args.temp_mb,
                                  "watch_dirs": args.watch_dirs,
                                  "think_s": args.think, "dump_wait": wait, "runs": runs,
                                  "summary": summarize(runs, kinds)}
        info = machine_info(d.socket)
    record_cleanup(result, d)
    path = write_json(args.out / "process_kinds.json", result, info)
    png = plot(runs, args.out / "process_kinds.png", info)
    s = result["summary"]
    for k in kinds:
        print(f"{k:9s} checkpoint p50 {s[k]['checkpoint']['p50']:6.2f} ms "
              f"(daemon {s[k]['checkpoint_server']['p50']:5.2f}; settled "
              f"{s[k]['settled_after_answer']['p50']:5.1f} after the answer, held "
              f"{s[k]['held']['p50']:4.1f}) | rollback p50 "
              f"{s[k]['rollback']['p50']:6.2f} ms (daemon {s[k]['rollback_server']['p50']:5.2f})")
    for k, r in s["p50_over_plain"].items():
        print(f"{k} / plain (p50): checkpoint {r['checkpoint']:.2f}x, rollback "
              f"{r['rollback']:.2f}x")
    print(f"wrote {path}" + (f" and {png}" if png else ""))
    return 0


if __name__ == "__main__":
    run_main(main)
