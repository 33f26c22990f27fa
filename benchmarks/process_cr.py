"""Process-state checkpoint/rollback/fork benchmark (DeltaCR): DeltaBox vs restart-and-replay
and vs the physical floor of fork().

    .venv/bin/python -m benchmarks.process_cr [--quick] [--out DIR]

The workload is a python3 program started in the sandbox from a bash session (`nohup python3
/workspace/w.py SIZE_MB IDX >/dev/null 2>&1 &`): it allocates SIZE_MB of patterned memory
(a bytearray, every page written), writes a readiness file, then idles (sleep 0.05) polling a
command file, on which it reports a CRC-32 of its memory or dirties X MB (one byte per page).
A bash session ("main", with a variable and a cwd) stays open throughout.

Configurations: RSS 10 / 200 / 1024 MB with one process, 5 and 20 processes of 10 MB, the
"full" scenario (bash session + python 200 MB + a 10,000-file tree in /workspace), and
"sub200": the 200 MB process started as `cd /workspace && nohup python3 ... &`, so that a
subshell of the session waits for it (restored as its child: adoption). For each, in the
same run:

- checkpoint: `sbx.checkpoint()` (mode auto: files and processes), timed client-side;
- rollback to the checkpoint just taken and to an older one (the configuration's first),
  timed client-side after a settle pause (the warm pool prepares the rollback meanwhile);
  the response's process_state must be "restored"; memory CRCs and a file are verified;
- the same checkpoint at the turn boundary: a session command (`:`) with `checkpoint="auto"`
  beside the same command without it (the workload dirties 1 MB before each); the answer
  does not wait for the checkpoint, whose daemon time and kind are read afterwards, and a
  rollback to it (untimed) must restore the file and the memory CRC;
- restart-and-replay: kill the process(es), start fresh ones, wait until every one has rebuilt
  the same state (allocated and patterned SIZE_MB; its CRC is checked afterwards);
- physical floor: on the host, fork() of a python process of the same size (nproc forks of
  one process for the multi-process configurations), until every child has written a byte
  to a pipe.

Plus fan-out `sbx.fork(cp, count=N)` for N = 1..32 from the full scenario's checkpoint (each
child gets the checkpoint's files and its processes restored from the templates, in a pid
namespace nested below the source's; the children are inspected and what they run, and the
fork's process_state, are reported; then the children are killed one by one: the time
until the last kill answered, and until every child's cgroup was gone; btrfs drops their
layers before the next fork is timed), and the memory a
template holds after the live process dirtied D MB (its pages that no process but it and
the carriers spawned from it map: /proc/<pid>/pagemap + /proc/kpagecount, via
deltabox.cr.native.exclusive_bytes). Writes <out>/process_cr.json and <out>/process_cr.png.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deltabox.cr import hostmem, native

from benchmarks.common import (DEFAULT_OUT, PrivateDaemon, Terminated, Timer, finish_figure,
                               cgroup_procs, host_thp, kill_and_wait, latency_boxplot, log,
                               machine_info, make_settle, other_daemons, percentile, pyplot,
                               ratio, record_cleanup, stats,
                               terminate_as_exception, wait_for_file, wait_inspector,
                               write_json)
from benchmarks.grpc_floor import BareServer

MiB = 1 << 20
CTL = "/workspace/ctl"
SANDBOX_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
TREE = "/workspace/tree"
TREE_FILES = 10_000
SESSION_VAR = "DELTABOX_BENCH_SESSION"

# The workload. Argv: SIZE_MB [IDX]. Protocol (all under /workspace/ctl): it writes
# ready-IDX ("pid size_mb") once its memory is built; it polls cmd-IDX every 50 ms, and for
# each new line "SEQ OP [ARGS] [h]\n" writes res-IDX "SEQ RESULT" (files written atomically).
#   OP hash               -> RESULT = CRC-32 of the whole buffer
#   OP dirty MB OFF VAL   -> writes VAL at one byte of every page of MB MiB from MiB OFF;
#                            RESULT = "ok", or the CRC after it when the line ends in " h".
WORKLOAD = r'''
import os, sys, time, zlib
MiB = 1 << 20
PAGE = 4096
size_mb = int(sys.argv[1])
idx = int(sys.argv[2]) if len(sys.argv) > 2 else 0
ctl = "/workspace/ctl"

def put(name, text):
    tmp = f"{ctl}/.{name}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.rename(tmp, f"{ctl}/{name}")

buf = bytearray(size_mb * MiB)
mv = memoryview(buf)
chunk = bytes((i * 131 + idx * 7 + 1) & 0xFF for i in range(256)) * (MiB // 256)
for i in range(size_mb):
    mv[i * MiB:(i + 1) * MiB] = chunk
    mv[i * MiB:i * MiB + 8] = i.to_bytes(8, "little")
put(f"ready-{idx}", f"{os.getpid()} {size_mb}\n")
cmd_path = f"{ctl}/cmd-{idx}"
last = ""
while True:
    time.sleep(0.05)
    try:
        with open(cmd_path) as f:
            line = f.read()
    except FileNotFoundError:
        continue
    if not line.endswith("\n"):
        continue
    parts = line.split()
    if len(parts) < 2 or parts[0] == last:
        continue
    last, op = parts[0], parts[1]
    out = "ok"
    if op == "dirty":
        mb, off, val = int(parts[2]), int(parts[3]), int(parts[4]) & 0xFF
        if val == chunk[64]:
            val = (val + 1) & 0xFF
        one = bytes([val]) * (MiB // PAGE)
        for i in range(min(mb, size_mb)):
            j = (off + i) % size_mb
            mv[j * MiB + 64:(j + 1) * MiB:PAGE] = one
    if op == "hash" or parts[-1] == "h":
        out = f"{zlib.crc32(buf):08x}"
    put(f"res-{idx}", f"{last} {out}\n")
'''

# The physical floor, on the host: the same memory as the workload, then REPS times: fork()
# NFORK children and wait until each has written a byte to a pipe (children exit at once).
FLOOR = r'''
import json, os, sys, time
MiB = 1 << 20
size_mb, nfork, reps = map(int, sys.argv[1:4])
buf = bytearray(size_mb * MiB)
mv = memoryview(buf)
chunk = bytes((i * 131 + 1) & 0xFF for i in range(256)) * (MiB // 256)
for i in range(size_mb):
    mv[i * MiB:(i + 1) * MiB] = chunk
    mv[i * MiB:i * MiB + 8] = i.to_bytes(8, "little")
rss = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS:"))
out = []
for _ in range(reps):
    r, w = os.pipe()
    t0 = time.perf_counter()
    pids = []
    for _ in range(nfork):
        pid = os.fork()
        if pid == 0:
            os.write(w, b"x")
            os._exit(0)
        pids.append(pid)
    got = 0
    while got < nfork:
        got += len(os.read(r, nfork - got))
    out.append((time.perf_counter() - t0) * 1000)
    os.close(r)
    os.close(w)
    for p in pids:
        os.waitpid(p, 0)
    time.sleep(0.02)
print(json.dumps({"fork_ms": out, "rss_kb": rss}))
'''


@dataclass(frozen=True)
class Config:
    name: str
    size_mb: int          # memory each workload process allocates
    nproc: int            # workload processes
    tree: bool = False    # + a 10k-file tree in /workspace (the "full" scenario)
    # started as `cd /workspace && nohup python3 ... &`: bash forks a subshell that waits
    # for the process, which a restore gives back to it (adoption: cr/adoption.py)
    subshell: bool = False

    @property
    def label(self) -> str:
        extra = f" + {TREE_FILES // 1000}k files + bash" if self.tree else ""
        extra += " under a waiting subshell" if self.subshell else ""
        return f"{self.nproc} x {self.size_mb} MB{extra}"


CONFIGS = (
    Config("rss10", 10, 1),       # also the process-count series' "1"
    Config("rss200", 200, 1),
    Config("rss1024", 1024, 1),
    Config("n5", 10, 5),
    Config("n20", 10, 20),
    Config("full", 200, 1, tree=True),
    Config("sub200", 200, 1, subshell=True),
)
RSS_SERIES = ("rss10", "rss200", "rss1024")
COUNT_SERIES = ("rss10", "n5", "n20")
FORK_COUNTS = (1, 2, 4, 8, 16, 32)
TEMPLATE_DIRTY_MB = (0, 10, 50, 100)
TEMPLATE_SIZE_MB = 200
# Memory hashes are verified after every rollback when the workload is at most this big,
# else on every 4th rep and the last (a CRC of 1 GB takes ~0.3 s).
VERIFY_ALL_MAX_MB = 256

TARGETS = {
    "full_checkpoint_p50_ms": ("<=", 10.0),
    "full_rollback_p50_ms": ("<=", 3.0),
    "full_rollback_speedup_vs_restart_replay": (">=", 30.0),
    "fork32_total_p50_ms": ("<=", 300.0),
    "template_held_minus_dirtied_mb_max": ("<=", None),  # per D: max(4 MB, 5 % of D)
}
TEMPLATE_TOL_MB = 4.0
TEMPLATE_TOL_FRAC = 0.05


def template_tolerance_mb(dirtied_mb: float) -> float:
    return max(TEMPLATE_TOL_MB, TEMPLATE_TOL_FRAC * dirtied_mb)


@dataclass
class Plan:
    reps: int
    replay_reps: int
    floor_reps: int
    fork_reps: int
    settle_s: float
    configs: tuple[str, ...] = tuple(c.name for c in CONFIGS)
    fork_counts: tuple[int, ...] = FORK_COUNTS
    template_dirty_mb: tuple[int, ...] = TEMPLATE_DIRTY_MB
    huge_pages: bool = False      # sandboxes created with huge_pages (and the floor alike)


@dataclass
class Series:
    """Raw measurements of one configuration."""

    name: str
    size_mb: int
    nproc: int
    tree: bool
    setup: dict[str, Any] = field(default_factory=dict)
    checkpoint_ms: list[float] = field(default_factory=list)
    checkpoint_server_ms: list[float] = field(default_factory=list)
    checkpoint_freeze_ms: list[float] = field(default_factory=list)
    checkpoint_kind: list[str] = field(default_factory=list)
    checkpoint_files_changed: list[int] = field(default_factory=list)
    rollback_new_ms: list[float] = field(default_factory=list)
    rollback_new_server_ms: list[float] = field(default_factory=list)
    rollback_old_ms: list[float] = field(default_factory=list)
    rollback_old_server_ms: list[float] = field(default_factory=list)
    rollback_outcomes: list[dict[str, Any]] = field(default_factory=list)
    not_restored: int = 0
    hash_checks: int = 0
    hash_mismatches: list[dict[str, Any]] = field(default_factory=list)
    file_checks: int = 0
    file_mismatches: list[dict[str, Any]] = field(default_factory=list)
    recoveries: int = 0
    session_after: dict[str, Any] = field(default_factory=dict)
    replay_ms: list[float] = field(default_factory=list)
    replay_kill_ms: list[float] = field(default_factory=list)
    replay_start_ms: list[float] = field(default_factory=list)
    replay_hash_ok: list[bool] = field(default_factory=list)
    floor_ms: list[float] = field(default_factory=list)
    floor_rss_kb: int = 0
    floor_nfork: int = 1
    # The same checkpoint asked for at a session command's end (turn boundary): that
    # command's client time, beside the same command without it, and the checkpoint's own
    # daemon time and kind (read afterwards, untimed).
    turn_plain_ms: list[float] = field(default_factory=list)
    turn_ckpt_ms: list[float] = field(default_factory=list)
    turn_ckpt_server_ms: list[float] = field(default_factory=list)
    turn_ckpt_kind: list[str] = field(default_factory=list)
    # A no-op call (Sandbox.info(), GetSandbox) after the same settle pause: the gRPC round
    # trip and hand-overs every operation pays before the daemon does anything.
    noop_ms: list[float] = field(default_factory=list)
    # The same call to a bare grpcio server (benchmarks/grpc_floor.py) after the same pause:
    # the floor of any call here, before the daemon's hand-overs.
    bare_ms: list[float] = field(default_factory=list)


# ---- the sandbox side ------------------------------------------------------------------------

class Workload:
    """The python workload process(es) of one sandbox, driven through the files API."""

    def __init__(self, sbx: Any, size_mb: int, nproc: int, settle_s: float,
                 subshell: bool = False) -> None:
        self.sbx = sbx
        self.subshell = subshell
        self.size_mb = size_mb
        self.nproc = nproc
        self.settle_s = settle_s
        self.session = sbx.session("main")
        self.seq = 0
        self.pids: list[int] = []   # pids inside the sandbox, from the ready files

    def install(self) -> None:
        self.sbx.files.write("/workspace/w.py", WORKLOAD)
        self.sbx.files.mkdir(CTL)
        r = self.session.run(f"cd /workspace && export {SESSION_VAR}=kept")
        if r.exit_code != 0:
            raise RuntimeError(f"session setup failed: {r}")

    def start(self, timeout: float = 120) -> tuple[float, float]:
        """Start the processes from the session; (session run ms, ms until all ready)."""
        cd = "cd /workspace && " if self.subshell else ""
        lines = "\n".join(f"{cd}nohup python3 /workspace/w.py {self.size_mb} {i} >/dev/null "
                          "2>&1 &" for i in range(self.nproc))
        t0 = time.perf_counter()
        r = self.session.run(lines)
        start_ms = (time.perf_counter() - t0) * 1000
        if r.exit_code != 0:
            raise RuntimeError(f"starting the workload failed: {r}")
        self.wait_ready(timeout)
        return start_ms, (time.perf_counter() - t0) * 1000

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        want = {f"ready-{i}" for i in range(self.nproc)}
        while True:
            names = {f.path.rsplit("/", 1)[-1] for f in self.sbx.files.list(CTL)}
            if want <= names:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"workload not ready after {timeout:g}s (have "
                                   f"{sorted(names)}):\n{self.ps()}")
            time.sleep(0.002)
        self.pids = [int(self.sbx.files.read(f"{CTL}/ready-{i}").split()[0])
                     for i in range(self.nproc)]

    def command(self, line: str, timeout: float = 120) -> list[str]:
        """Send one command to every process; their results, by index."""
        self.seq += 1
        tok = f"c{self.seq}"
        for i in range(self.nproc):
            self.sbx.files.write(f"{CTL}/cmd-{i}", f"{tok} {line}\n")
        out: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while len(out) < self.nproc:
            for i in range(self.nproc):
                if i in out:
                    continue
                try:
                    parts = self.sbx.files.read(f"{CTL}/res-{i}").decode().split()
                except Exception:  # not there yet (NotFound)
                    continue
                if len(parts) == 2 and parts[0] == tok:
                    out[i] = parts[1]
            if len(out) < self.nproc:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"workload did not answer {line!r} within {timeout:g}s "
                                       f"(answered: {sorted(out)}):\n{self.ps()}")
                time.sleep(0.005)
        return [out[i] for i in range(self.nproc)]

    def hashes(self) -> list[str]:
        return self.command("hash")

    def dirty(self, mb: int, off: int, val: int, want_hash: bool = False) -> list[str]:
        return self.command(f"dirty {mb} {off} {val}" + (" h" if want_hash else ""))

    def kill(self) -> None:
        """Kill the live workload processes (by their pids inside the sandbox) and remove
        the control files, in one exec."""
        pids = " ".join(map(str, self.pids))
        r = self.sbx.exec(["bash", "-c", f"kill -9 {pids} 2>/dev/null; "
                           f"rm -f {CTL}/ready-* {CTL}/res-* {CTL}/cmd-* {CTL}/.*.tmp"])
        if r.exit_code != 0:
            raise RuntimeError(f"killing the workload failed: {r}")

    def ps(self) -> str:
        try:
            return self.sbx.exec(["ps", "-eo", "pid,ppid,pgid,stat,rss,args"]).stdout
        except Exception as e:
            return f"(ps failed: {e})"

    def settle(self) -> None:
        if self.settle_s > 0:
            time.sleep(self.settle_s)


def make_tree(sbx: Any) -> dict[str, Any]:
    """10,000 small files in 100 directories, with one exec."""
    script = (f"mkdir -p {TREE} && cd {TREE} && for d in $(seq -w 0 99); do mkdir -p d$d; "
              "for f in $(seq -w 0 99); do echo \"file $d/$f\" > d$d/f$f.txt; done; done; "
              "find . -type f | wc -l")
    with Timer() as tm:
        r = sbx.exec(["bash", "-c", script], timeout=600)
    n = int(r.stdout.strip() or 0) if r.exit_code == 0 else 0
    if n != TREE_FILES:
        raise RuntimeError(f"tree generation made {n} files, not {TREE_FILES}: {r}")
    return {"files": n, "exec_ms": tm.ms}


# ---- the host side ---------------------------------------------------------------------------

def sandbox_python() -> str:
    """The interpreter a sandbox on the host root runs as `python3` (its PATH, /root masked),
    so the floor's process has the same RSS."""
    found = shutil.which("python3", path=SANDBOX_PATH)
    return found or sys.executable


def host_procs(init_pid: int) -> list[dict[str, Any]]:
    """The sandbox's processes as the host sees them: pid, state, cmdline, VmRSS."""
    out = []
    for pid in map(int, cgroup_procs(init_pid).read_text().split()):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(
                errors="replace").strip()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        rss = fields.get("VmRSS", "0 kB").split()[0]
        try:
            exe = os.path.basename(os.readlink(f"/proc/{pid}/exe"))
        except OSError:
            exe = ""
        out.append({"pid": pid, "state": fields.get("State", "?").strip(), "cmd": cmd,
                    "exe": exe, "rss_kb": int(rss)})
    return out


def workload_templates(init_pid: int) -> set[int]:
    """Host pids of the workload's templates (and carriers, keepers), in tracing stop: a
    python whose command line is empty (templates hide theirs: native/fork_template.c
    `disguise`) or the workload's (a keeper shares its process's)."""
    return {p["pid"] for p in host_procs(init_pid)
            if p["state"].startswith("t") and ("/workspace/w.py" in p["cmd"] or
                                               (not p["cmd"] and p["exe"].startswith("python")))}


def smaps_rollup(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        k, _, v = line.partition(":")
        parts = v.split()
        if parts and parts[0].isdigit():
            out[k.strip()] = int(parts[0])
    return out


def run_floor(size_mb: int, nfork: int, reps: int, huge_pages: bool = False
              ) -> dict[str, Any]:
    """fork() of a host python process with the same memory (see FLOOR), in 2 MiB pages
    as a huge_pages sandbox's would be when `huge_pages`."""
    from deltabox.cr import hostmem

    python = sandbox_python()
    env = hostmem.with_huge_pages(dict(os.environ)) if huge_pages else None
    r = subprocess.run([python, "-c", FLOOR, str(size_mb), str(nfork), str(reps)],
                       capture_output=True, text=True, timeout=600, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"floor helper failed: {r.stderr[-2000:]}")
    return json.loads(r.stdout)


# ---- the measurements ------------------------------------------------------------------------

def probe_path(cfg: Config) -> str:
    """A file the reps change (so checkpoints carry a file change and rollbacks can be checked
    on files too): in the tree for the full scenario."""
    return f"{TREE}/d42/f42.txt" if cfg.tree else f"{CTL}/turn"


def run_config(d: PrivateDaemon, cfg: Config, plan: Plan) -> Series:
    from deltabox import Sandbox

    s = Series(cfg.name, cfg.size_mb, cfg.nproc, cfg.tree)
    nfork = cfg.nproc
    log(f"{cfg.name} ({cfg.label}): host fork floor, {plan.floor_reps} reps")
    floor = run_floor(cfg.size_mb, nfork, plan.floor_reps, plan.huge_pages)
    s.floor_ms, s.floor_rss_kb, s.floor_nfork = floor["fork_ms"], floor["rss_kb"], nfork

    sbx = Sandbox.create(socket=d.socket, huge_pages=plan.huge_pages)
    bare: BareServer | None = None
    try:
        bare = BareServer(d.scratch).__enter__()
        wl = Workload(sbx, cfg.size_mb, cfg.nproc, plan.settle_s, cfg.subshell)
        wl.install()
        if cfg.tree:
            s.setup["tree"] = make_tree(sbx)
            log(f"{cfg.name}: {TREE_FILES} files made in {s.setup['tree']['exec_ms']:.0f} ms")
        probe = probe_path(cfg)
        sbx.files.write(probe, "base\n")
        start_ms, ready_ms = wl.start()
        s.setup.update(start_session_ms=start_ms, first_ready_ms=ready_ms)
        init_pid = sbx.info().init_pid
        s.setup["processes_at_start"] = host_procs(init_pid)
        base_hashes = wl.hashes()
        wl.settle()
        with Timer() as tm:
            base = sbx.checkpoint(label="base")
        s.setup.update(base_checkpoint_ms=tm.ms, base_checkpoint=base.model_dump(),
                       base_hashes=base_hashes)
        log(f"{cfg.name}: ready in {ready_ms:.0f} ms; first checkpoint {tm.ms:.1f} ms "
            f"({base.files_changed} files changed, kind {base.kind})")
        if base.kind != "full":
            raise RuntimeError(f"checkpoint did not capture processes: {base}")

        def check_outcome(rb: Any, target: str, rep: int) -> bool:
            s.rollback_outcomes.append({"rep": rep, "target": target,
                                        "process_state": rb.process_state, "note": rb.note,
                                        "processes_killed": rb.processes_killed,
                                        "sessions_restarted": list(rb.sessions_restarted)})
            if rb.process_state != "restored":
                s.not_restored += 1
                log(f"{cfg.name} rep {rep}: rollback to {target} gave process_state "
                    f"{rb.process_state!r}: {rb.note}")
                return False
            return True

        def check_hashes(got: list[str], want: list[str], rep: int, target: str) -> None:
            s.hash_checks += 1
            if got != want:
                s.hash_mismatches.append({"rep": rep, "target": target, "got": got,
                                          "want": want})
                log(f"{cfg.name} rep {rep}: memory CRC after rollback to {target} is {got}, "
                    f"expected {want}")

        def check_file(want: str, rep: int, target: str) -> None:
            s.file_checks += 1
            got = sbx.files.read(probe).decode(errors="replace")
            if got != want:
                s.file_mismatches.append({"rep": rep, "target": target, "got": got,
                                          "want": want})
                log(f"{cfg.name} rep {rep}: {probe} after rollback to {target} is {got!r}, "
                    f"expected {want!r}")

        def recover(rep: int) -> Any:
            """After a rollback that did not restore the processes: start them afresh and
            take a new base checkpoint (its state is the same: memory is deterministic)."""
            nonlocal base
            s.recoveries += 1
            try:
                wl.kill()
            except Exception:
                pass
            wl.start()
            got = wl.hashes()
            if got != base_hashes:
                raise RuntimeError(f"restarted workload has CRCs {got}, expected {base_hashes}")
            sbx.files.write(probe, "base\n")
            base = sbx.checkpoint(label=f"base after recovery at rep {rep}")

        def turn_boundary(rep: int, verify: bool) -> None:
            wl.dirty(1, (rep + 17) % cfg.size_mb, 31 + rep % 50)
            wl.settle()
            with Timer() as tm:
                wl.session.run(":")
            s.turn_plain_ms.append(tm.ms)
            tag = f"rep {rep} turn\n"
            sbx.files.write(probe, tag)
            h_turn = wl.dirty(1, (rep + 19) % cfg.size_mb, 61 + rep % 50, want_hash=verify)
            wl.settle()
            with Timer() as tm:
                r = wl.session.run(":", checkpoint="auto", checkpoint_label=f"turn {rep}")
            s.turn_ckpt_ms.append(tm.ms)
            cp = sbx.get_checkpoint(r.checkpoint_id)     # untimed: waits until it is taken
            s.turn_ckpt_server_ms.append(cp.duration_ms)
            s.turn_ckpt_kind.append(cp.kind)
            wl.dirty(1, (rep + 23) % cfg.size_mb, 91 + rep % 50)
            sbx.files.write(probe, "after the turn\n")
            rb = sbx.rollback(cp)                        # untimed: it restores exactly
            if not check_outcome(rb, "turn", rep):
                recover(rep)
                return
            check_file(tag, rep, "turn")
            if verify:
                check_hashes(wl.hashes(), h_turn, rep, "turn")

        log(f"{cfg.name}: {plan.reps} reps of checkpoint + rollback (newest, older)")
        size_total = cfg.size_mb * cfg.nproc
        for rep in range(plan.reps):
            verify = (size_total <= VERIFY_ALL_MAX_MB or rep % 4 == 0 or rep == plan.reps - 1)
            tag = f"rep {rep}\n"
            sbx.files.write(probe, tag)
            h_rep = wl.dirty(1, rep % cfg.size_mb, 1 + rep % 97, want_hash=verify)
            wl.settle()
            with Timer() as tm:
                cp = sbx.checkpoint(label=f"rep {rep}")
            s.checkpoint_ms.append(tm.ms)
            s.checkpoint_server_ms.append(cp.duration_ms)
            s.checkpoint_freeze_ms.append(cp.freeze_ms)
            s.checkpoint_kind.append(cp.kind)
            s.checkpoint_files_changed.append(cp.files_changed)

            # diverge, then back to the checkpoint just taken
            wl.dirty(1, (rep + 7) % cfg.size_mb, 101 + rep % 97)
            sbx.files.write(probe, f"rep {rep} diverged\n")
            wl.settle()
            with Timer() as tm:
                rb = sbx.rollback(cp)
            s.rollback_new_ms.append(tm.ms)
            s.rollback_new_server_ms.append(rb.duration_ms)
            if not check_outcome(rb, "newest", rep):
                recover(rep)
                continue
            check_file(tag, rep, "newest")
            if verify:
                check_hashes(wl.hashes(), h_rep, rep, "newest")

            # diverge, then back to the configuration's first checkpoint
            wl.dirty(1, (rep + 13) % cfg.size_mb, 201 + rep % 50)
            wl.settle()
            with Timer() as tm:
                rb = sbx.rollback(base)
            s.rollback_old_ms.append(tm.ms)
            s.rollback_old_server_ms.append(rb.duration_ms)
            if not check_outcome(rb, "older", rep):
                recover(rep)
                continue
            check_file("base\n", rep, "older")
            if verify:
                check_hashes(wl.hashes(), base_hashes, rep, "older")

            wl.settle()
            with Timer() as tm:
                sbx.info()
            s.noop_ms.append(tm.ms)
            wl.settle()
            s.bare_ms.append(bare.call())


        # The same checkpoint at a session command's end (exec/session checkpoint=): the
        # command answers before the checkpoint is taken (daemon/pending.py). A loop of its
        # own, after the series above, whose background work it would otherwise disturb.
        log(f"{cfg.name}: {plan.reps} reps of a session command with checkpoint=auto")
        for rep in range(plan.reps):
            turn_boundary(rep, size_total <= VERIFY_ALL_MAX_MB or rep == plan.reps - 1)

        # The session continued across all those rollbacks (its cwd and variable).
        r = wl.session.run(f"echo ${SESSION_VAR}; pwd")
        s.session_after = {"stdout": r.stdout, "note": r.note,
                           "ok": r.stdout.split() == ["kept", "/workspace"]}
        s.setup["processes_at_end"] = host_procs(init_pid)

        log(f"{cfg.name}: {plan.replay_reps} reps of restart-and-replay")
        for _ in range(plan.replay_reps):
            wl.settle()
            t0 = time.perf_counter()
            wl.kill()
            kill_ms = (time.perf_counter() - t0) * 1000
            start_ms, _ = wl.start()
            total = (time.perf_counter() - t0) * 1000
            s.replay_ms.append(total)
            s.replay_kill_ms.append(kill_ms)
            s.replay_start_ms.append(start_ms)
            s.replay_hash_ok.append(wl.hashes() == base_hashes)  # untimed
        if not all(s.replay_hash_ok):
            log(f"{cfg.name}: a restarted workload did not rebuild the same memory")
    finally:
        sbx.kill()
        if bare is not None:
            bare.__exit__()
    log(f"{cfg.name}: checkpoint p50 {percentile(s.checkpoint_ms, 50):.1f} ms, rollback p50 "
        f"{percentile(s.rollback_new_ms, 50):.1f} (newest) / "
        f"{percentile(s.rollback_old_ms, 50):.1f} (older) ms, restart+replay p50 "
        f"{percentile(s.replay_ms, 50):.0f} ms, fork floor p50 "
        f"{percentile(s.floor_ms, 50):.2f} ms; not restored: {s.not_restored}, CRC mismatches: "
        f"{len(s.hash_mismatches)}/{s.hash_checks}")
    return s


def inspect_child(child: Any) -> dict[str, Any]:
    """What a forked sandbox has: its processes, the workload's files, a session."""
    ps = child.exec(["ps", "-eo", "pid=,stat=,args="])
    procs = []
    for line in ps.stdout.splitlines():
        parts = line.split(None, 2)
        if len(parts) == 3 and not parts[2].startswith("ps "):
            procs.append({"pid": int(parts[0]), "stat": parts[1], "cmd": parts[2][:100]})
    files = child.exec(["bash", "-c", f"test -f /workspace/w.py && echo w.py; "
                        f"ls {CTL} | tr '\\n' ' '; echo; "
                        f"find {TREE} -type f 2>/dev/null | wc -l"])
    lines = files.stdout.splitlines()
    sessions_before = child.sessions()
    sess = child.session("main").run(f"echo ${{{SESSION_VAR}:-unset}}; pwd")
    return {
        "processes": procs,
        "workload_running": any("/workspace/w.py" in p["cmd"] for p in procs),
        "has_w_py": bool(lines) and lines[0] == "w.py",
        "ctl_files": lines[1].split() if len(lines) > 1 else [],
        "tree_files": int(lines[2]) if len(lines) > 2 and lines[2].isdigit() else None,
        "sessions_before_use": sessions_before,
        "session_main": {"stdout": sess.stdout, "note": sess.note},
    }


def run_fork(d: PrivateDaemon, plan: Plan) -> dict[str, Any]:
    """Fan-out from a checkpoint of the full scenario (bash + python 200 MB + 10k files)."""
    from deltabox import Sandbox

    log("fork: preparing the source (bash + python 200 MB + 10k files)")
    sbx = Sandbox.create(socket=d.socket, huge_pages=plan.huge_pages)
    per_n: dict[str, Any] = {}
    try:
        wl = Workload(sbx, 200, 1, plan.settle_s)
        wl.install()
        make_tree(sbx)
        wl.start()
        wl.settle()
        cp = sbx.checkpoint(label="fork source")
        wl.settle()
        settle = make_settle(d.socket)
        for n in plan.fork_counts:
            total, kill_ms, torn_ms = [], [], []
            inspected: list[dict[str, Any]] = []
            for rep in range(plan.fork_reps):
                wl.settle()
                with Timer() as tm:
                    kids = sbx.fork(cp, count=n)
                total.append(tm.ms)
                states = {k.process_state for k in kids}
                try:
                    if rep == 0:
                        for k in {id(kids[0]): kids[0], id(kids[-1]): kids[-1]}.values():
                            inspected.append(inspect_child(k))
                finally:
                    answered, gone = kill_and_wait(kids)
                    kill_ms.append(answered)
                    torn_ms.append(gone)
                settle()  # the kids' layers deleted by btrfs: not in the next fork's time
            per_n[str(n)] = {"count": n, "total_ms": total, "process_state": sorted(states),
                             "per_child_ms": [t / n for t in total], "kill_all_ms": kill_ms,
                             "torn_down_ms": torn_ms, "children_inspected": inspected}
            log(f"fork({n}): total p50 {percentile(total, 50):.1f} ms; child runs the "
                f"workload: {any(i['workload_running'] for i in inspected)}")
        source_checkpoint = cp.model_dump()
    finally:
        sbx.kill()
    return {"kind": "fork with processes: the children get the checkpoint's files and its "
                    "processes, spawned from the source's templates into pid namespaces "
                    "nested below the source's",
            "source": "bash session + python 200 MB + 10k-file tree",
            "source_checkpoint": source_checkpoint, "per_n": per_n}


# An idle process: 200 MB of patterned memory, then blocked in signal.pause(); SIGUSR2
# writes its memory's CRC-32 to /workspace/idle.crc (it runs to answer).
IDLE_PY = r"""
import signal, sys, zlib
b = bytearray(int(sys.argv[1]) << 20)
for off in range(0, len(b), 4096):
    b[off] = (off >> 12) & 0xFF
def report(*_):
    with open("/workspace/idle.tmp", "w") as f:
        f.write(str(zlib.crc32(b)))
    import os; os.rename("/workspace/idle.tmp", "/workspace/idle.crc")
signal.signal(signal.SIGUSR2, report)
open("/workspace/idle.ready", "w").write("1")
while True:
    signal.pause()
"""


def run_idle(d: PrivateDaemon, plan: Plan) -> dict[str, Any]:
    """A bash session that works and a 200 MB python that waits (an idle server or REPL):
    per rep, a session command, then `checkpoint()` (auto: the waiting process keeps its
    parent's template) and, alternately, the same turn with `checkpoint(mode="full")`
    (every process captured afresh): the baseline, in the same sandbox. Every few reps a
    rollback to the auto checkpoint must restore the process's memory (its CRC)."""
    from deltabox import Sandbox

    backend = wait_inspector(d)
    sbx = Sandbox.create(socket=d.socket, huge_pages=plan.huge_pages)
    auto_ms: list[float] = []
    auto_server: list[float] = []
    full_ms: list[float] = []
    full_server: list[float] = []
    kept: list[bool] = []
    checks: list[bool] = []
    try:
        sbx.files.write("/workspace/idle.py", IDLE_PY)
        sh = sbx.session("main")
        sh.run("cd /workspace && nohup python3 /workspace/idle.py 200 >/dev/null 2>&1 &")
        wait_for_file(sbx, "/workspace/idle.ready", 120, "the idle process did not start")

        def crc() -> str:
            sbx.exec("rm -f /workspace/idle.crc; pkill -USR2 -f idle.py")
            wait_for_file(sbx, "/workspace/idle.crc", 30, "the idle process did not answer")
            return sbx.files.read("/workspace/idle.crc").decode()

        want = crc()
        sbx.checkpoint(label="idle base")      # the process ran (it answered): full
        for rep in range(plan.reps * 2):
            sh.run(f"export STEP={rep}")
            time.sleep(plan.settle_s)
            forced = rep % 2 == 1
            with Timer() as tm:
                cp = sbx.checkpoint(mode="full" if forced else "auto", label=f"idle {rep}")
            if forced:
                full_ms.append(tm.ms)
                full_server.append(cp.duration_ms)
                continue
            auto_ms.append(tm.ms)
            auto_server.append(cp.duration_ms)
            kept.append(any(r.startswith("templates kept") and "python3" in r
                            for r in cp.reasons))
            if rep % 4 == 0:
                sbx.rollback(cp)
                checks.append(crc() == want)
                sbx.checkpoint(label=f"idle {rep} after the check")  # it ran: full
    finally:
        sbx.kill()
    a, f = stats(auto_ms), stats(full_ms)
    log(f"idle process: checkpoint p50 {a.get('p50', math.nan):.1f} ms (auto: its template "
        f"kept in {sum(kept)}/{len(kept)}) vs {f.get('p50', math.nan):.1f} ms forced full; "
        f"memory checks {sum(checks)}/{len(checks)}")
    return {"inspector": backend, "auto_ms": auto_ms, "auto_server_ms": auto_server,
            "forced_full_ms": full_ms, "forced_full_server_ms": full_server,
            "template_kept": kept, "memory_checks": checks}


def run_template_memory(d: PrivateDaemon, plan: Plan) -> list[dict[str, Any]]:
    """A fresh sandbox per D (so no older template shares the pages): python 200 MB,
    checkpoint, dirty D MB in the live process, then read the template's smaps_rollup."""
    from deltabox import Sandbox

    out = []
    for dmb in plan.template_dirty_mb:
        sbx = Sandbox.create(socket=d.socket, huge_pages=plan.huge_pages)
        try:
            wl = Workload(sbx, TEMPLATE_SIZE_MB, 1, plan.settle_s)
            wl.install()
            wl.start()
            init_pid = sbx.info().init_pid
            before = workload_templates(init_pid)
            wl.settle()
            cp = sbx.get_checkpoint(sbx.checkpoint())  # answered before its templates
            # are made (right after the answer): get_checkpoint waits for them.
            # The template, and soon carriers forked from it for the next rollback
            # (daemon/warm.py; same cmdline, stopped, later pids): the template is the first.
            tpls = sorted(workload_templates(init_pid) - before)
            if not tpls:
                raise RuntimeError(f"no new workload template: {host_procs(init_pid)}")
            tpl = tpls[0]
            at_cp = smaps_rollup(tpl)
            wl.dirty(dmb, 0, 77)
            time.sleep(0.1)
            after = smaps_rollup(tpl)
            carriers = sorted(workload_templates(init_pid) - before - {tpl})
            held_kb = native.exclusive_bytes(tpl, 1 + len(carriers)) // 1024
            live = [p for p in host_procs(init_pid)
                    if "/workspace/w.py" in p["cmd"] and not p["state"].startswith("t")]
            live_smaps = smaps_rollup(live[0]["pid"]) if live else {}
            others = [p for p in host_procs(init_pid) if p["state"].startswith("t")
                      and p["pid"] != tpl and p["pid"] not in carriers]
            other_private_kb = {}
            for p in others:
                try:
                    sm = smaps_rollup(p["pid"])
                except OSError:
                    continue
                other_private_kb[p["cmd"][:60]] = (sm.get("Private_Clean", 0) +
                                                   sm.get("Private_Dirty", 0))
            out.append({
                "dirtied_mb": dmb, "template_host_pid": tpl, "checkpoint": cp.id,
                "held_mb": held_kb / 1024,
                "held_minus_dirtied_mb": held_kb / 1024 - dmb,
                "carriers": len(carriers),
                "template_at_checkpoint": at_cp, "template_after_dirty": after,
                "live_after_dirty": live_smaps,
                "other_templates_private_kb": other_private_kb,
            })
            log(f"template memory: dirtied {dmb} MB -> held by the template and its "
                f"{len(carriers)} carrier(s) {held_kb / 1024:.1f} MB "
                f"(Rss {after.get('Rss', 0) / 1024:.0f} MB)")
        finally:
            sbx.kill()
    return out


# ---- summary ---------------------------------------------------------------------------------

def summarize(series: list[Series], fork: dict | None, tmem: list[dict] | None) -> dict:
    per: dict[str, Any] = {}
    for s in series:
        ck, rn, ro = stats(s.checkpoint_ms), stats(s.rollback_new_ms), stats(s.rollback_old_ms)
        rp, fl, nop = stats(s.replay_ms), stats(s.floor_ms), stats(s.noop_ms)
        bare = stats(s.bare_ms)
        per[s.name] = {
            "size_mb": s.size_mb, "nproc": s.nproc, "tree": s.tree,
            "checkpoint_ms": ck, "checkpoint_server_ms": stats(s.checkpoint_server_ms),
            "checkpoint_freeze_ms": stats(s.checkpoint_freeze_ms),
            "rollback_newest_ms": rn, "rollback_newest_server_ms":
                stats(s.rollback_new_server_ms),
            "rollback_older_ms": ro, "rollback_older_server_ms":
                stats(s.rollback_old_server_ms),
            "restart_replay_ms": rp, "fork_floor_ms": fl,
            "rollback_speedup_vs_restart_replay_p50": ratio(rp.get("p50", 0), rn.get("p50", 0)),
            "rollback_older_speedup_vs_restart_replay_p50":
                ratio(rp.get("p50", 0), ro.get("p50", 0)),
            "checkpoint_over_floor_p50": ratio(ck.get("p50", 0), fl.get("p50", 0)),
            "rollback_over_floor_p50": ratio(rn.get("p50", 0), fl.get("p50", 0)),
            "noop_call_ms": nop,
            "checkpoint_over_noop_call_p50": ratio(ck.get("p50", 0), nop.get("p50", 0)),
            "rollback_over_noop_call_p50": ratio(rn.get("p50", 0), nop.get("p50", 0)),
            "bare_grpc_call_ms": bare,
            "rollback_over_bare_grpc_call_p50": ratio(rn.get("p50", 0), bare.get("p50", 0)),
            "rollback_minus_bare_grpc_call_p50_ms":
                rn.get("p50", 0) - bare.get("p50", 0) if bare else None,
            "rollbacks": len(s.rollback_outcomes), "not_restored": s.not_restored,
            "hash_checks": s.hash_checks, "hash_mismatches": len(s.hash_mismatches),
            "file_checks": s.file_checks, "file_mismatches": len(s.file_mismatches),
            "replay_hash_ok": all(s.replay_hash_ok) if s.replay_hash_ok else None,
            "session_kept": s.session_after.get("ok"),
            "checkpoint_kinds": sorted(set(s.checkpoint_kind)),
            "turn_command_ms": stats(s.turn_plain_ms),
            "turn_command_with_checkpoint_ms": stats(s.turn_ckpt_ms),
            "turn_checkpoint_server_ms": stats(s.turn_ckpt_server_ms),
            "turn_checkpoint_kinds": sorted(set(s.turn_ckpt_kind)),
            # what a checkpoint at the turn boundary costs the client: p50 difference
            "turn_checkpoint_visible_ms": (stats(s.turn_ckpt_ms).get("p50", math.nan)
                                           - stats(s.turn_plain_ms).get("p50", math.nan)),
        }
    out: dict[str, Any] = {"per_config": per}
    if fork is not None:
        out["fork"] = {
            "kind": fork["kind"],
            "per_n": {n: {"total_ms": stats(f["total_ms"]), "per_child_ms":
                          stats(f["per_child_ms"]),
                          "kill_all_ms": stats(f["kill_all_ms"]),
                          "torn_down_ms": stats(f.get("torn_down_ms", [])),
                          "children_run_workload": any(i["workload_running"]
                                                       for i in f["children_inspected"]),
                          "children_processes": sorted({p["cmd"].split()[0] for i in
                                                        f["children_inspected"]
                                                        for p in i["processes"]}),
                          "children_tree_files": [i["tree_files"] for i in
                                                  f["children_inspected"]]}
                      for n, f in fork["per_n"].items()},
        }
    if tmem is not None:
        out["template_memory"] = [{"dirtied_mb": t["dirtied_mb"], "held_mb": t["held_mb"],
                                   "held_minus_dirtied_mb": t["held_minus_dirtied_mb"],
                                   "tolerance_mb": template_tolerance_mb(t["dirtied_mb"])}
                                  for t in tmem]
    return out


def summarize_idle(idle: dict) -> dict[str, Any]:
    a, f = stats(idle["auto_ms"]), stats(idle["forced_full_ms"])
    return {"auto_ms": a, "auto_server_ms": stats(idle["auto_server_ms"]),
            "forced_full_ms": f, "forced_full_server_ms": stats(idle["forced_full_server_ms"]),
            "auto_over_forced_full_p50": ratio(a.get("p50", 0), f.get("p50", 0)),
            "template_kept": f"{sum(idle['template_kept'])}/{len(idle['template_kept'])}",
            "memory_checks": f"{sum(idle['memory_checks'])}/{len(idle['memory_checks'])} "
                             "exact"}


def evaluate_targets(summary: dict) -> dict[str, Any]:
    full = summary["per_config"].get("full")
    f32 = summary.get("fork", {}).get("per_n", {}).get("32")
    tm = summary.get("template_memory")
    values: dict[str, Any] = {
        "full_checkpoint_p50_ms": full["checkpoint_ms"].get("p50") if full else None,
        "full_rollback_p50_ms": full["rollback_newest_ms"].get("p50") if full else None,
        "full_rollback_speedup_vs_restart_replay":
            full["rollback_speedup_vs_restart_replay_p50"] if full else None,
        "fork32_total_p50_ms": f32["total_ms"]["p50"] if f32 else None,
        "template_held_minus_dirtied_mb_max":
            max(abs(t["held_minus_dirtied_mb"]) for t in tm) if tm else None,
    }
    out = {}
    for name, (op, limit) in TARGETS.items():
        v = values[name]
        if name == "template_held_minus_dirtied_mb_max":
            ok = None if not tm else all(abs(t["held_minus_dirtied_mb"]) <= t["tolerance_mb"]
                                         for t in tm)
            target = (f"|private - D| <= max({TEMPLATE_TOL_MB:g} MB, "
                      f"{TEMPLATE_TOL_FRAC:.0%} of D) for every D")
        else:
            ok = None if v is None else (v <= limit if op == "<=" else v >= limit)
            target = f"{op} {limit:g}"
        out[name] = {"value": v, "target": target, "pass": ok}
    return out


def _fmt(v: float | None, width: int = 7, prec: int = 1) -> str:
    if v is None or v != v:
        return f"{'-':>{width}}"
    return f"{v:>{width}.{prec}f}"


def print_summary(summary: dict, targets: dict, json_path: Path, png_path: Path) -> None:
    p = print
    p("")
    p("DeltaBox process-state checkpoint/rollback (client-side p50, ms; rollbacks after a "
      "settle pause = warm pool)")
    p(f"{'config':8} {'workload':30} | {'ckpt':>7} {'rb new':>7} {'rb old':>7} | "
      f"{'replay':>7} {'floor':>6} | {'replay/rb':>9} {'ckpt/fl':>7} {'rb/fl':>6} | "
      f"{'restored':>8} {'CRC ok':>7}")
    for name, r in summary["per_config"].items():
        cfg = next((c for c in CONFIGS if c.name == name), None)
        label = cfg.label if cfg else name
        p(f"{name:8} {label:30} | {_fmt(r['checkpoint_ms'].get('p50'))} "
          f"{_fmt(r['rollback_newest_ms'].get('p50'))} {_fmt(r['rollback_older_ms'].get('p50'))}"
          f" | {_fmt(r['restart_replay_ms'].get('p50'), 7, 0)} "
          f"{_fmt(r['fork_floor_ms'].get('p50'), 6, 2)} | "
          f"{_fmt(r['rollback_speedup_vs_restart_replay_p50'], 8, 1)}x "
          f"{_fmt(r['checkpoint_over_floor_p50'], 6, 1)}x "
          f"{_fmt(r['rollback_over_floor_p50'], 5, 1)}x | "
          f"{r['rollbacks'] - r['not_restored']:>4}/{r['rollbacks']:<3} "
          f"{r['hash_checks'] - r['hash_mismatches']:>3}/{r['hash_checks']:<3}")
    p("")
    p("daemon side (p50, ms): checkpoint (of which cgroup frozen) / rollback newest / older")
    for name, r in summary["per_config"].items():
        p(f"{name:8} {_fmt(r['checkpoint_server_ms'].get('p50'))} "
          f"({_fmt(r['checkpoint_freeze_ms'].get('p50'), 5)}) / "
          f"{_fmt(r['rollback_newest_server_ms'].get('p50'))} / "
          f"{_fmt(r['rollback_older_server_ms'].get('p50'))}")
    p("")
    p("a no-op call (Sandbox.info()) after the same pause: p50 ms, and checkpoint / rollback "
      "(newest) as multiples of it")
    for name, r in summary["per_config"].items():
        p(f"{name:8} {_fmt(r.get('noop_call_ms', {}).get('p50'), prec=2)} | checkpoint "
          f"{_fmt(r.get('checkpoint_over_noop_call_p50'), 5)}x | rollback "
          f"{_fmt(r.get('rollback_over_noop_call_p50'), 5)}x")
    p("")
    p("the same call to a bare grpcio server (benchmarks/grpc_floor.py: deltaboxd's server "
      "options, an answer from the gRPC thread) after the same pause: p50 ms; the rollback "
      "(newest) as a multiple of it, and what it takes beyond it")
    for name, r in summary["per_config"].items():
        p(f"{name:8} {_fmt(r.get('bare_grpc_call_ms', {}).get('p50'), prec=2)} | rollback "
          f"{_fmt(r.get('rollback_over_bare_grpc_call_p50'), 5)}x, "
          f"+{_fmt(r.get('rollback_minus_bare_grpc_call_p50_ms'), prec=2)} ms")
    p("")
    p("checkpoint at a session command's end (turn boundary; p50, ms): the command alone / "
      "with checkpoint= / what the client sees of it / the checkpoint's daemon time (kind)")
    for name, r in summary["per_config"].items():
        p(f"{name:8} {_fmt(r['turn_command_ms'].get('p50'))} / "
          f"{_fmt(r['turn_command_with_checkpoint_ms'].get('p50'))} / "
          f"{_fmt(r['turn_checkpoint_visible_ms'])} / "
          f"{_fmt(r['turn_checkpoint_server_ms'].get('p50'))} "
          f"({', '.join(r['turn_checkpoint_kinds'])})")
    if "fork" in summary:
        p("")
        p("fan-out fork (files + processes restored from templates in every child)")
        p(f"{'N':>4} | {'total p50':>9} {'p90':>7} | {'per child':>9} | {'kill all':>8} "
          f"{'torn down':>9} | children run workload")
        for n, f in summary["fork"]["per_n"].items():
            p(f"{n:>4} | {_fmt(f['total_ms'].get('p50'), 9)} {_fmt(f['total_ms'].get('p90'))} | "
              f"{_fmt(f['per_child_ms'].get('p50'), 9)} | {_fmt(f['kill_all_ms'].get('p50'), 8)} "
              f"{_fmt(f['torn_down_ms'].get('p50'), 9)} | {f['children_run_workload']} "
              f"(processes seen: {', '.join(f['children_processes'])})")
    if "idle_process" in summary:
        i = summary["idle_process"]
        p("")
        p("bash session working + python 200 MB waiting (blocked in pause()): checkpoint "
          "p50 ms, client (daemon)")
        p(f"auto (the waiting process keeps its template, {i['template_kept']}) "
          f"{_fmt(i['auto_ms'].get('p50'))} ({_fmt(i['auto_server_ms'].get('p50'))}) vs "
          f"forced full {_fmt(i['forced_full_ms'].get('p50'))} "
          f"({_fmt(i['forced_full_server_ms'].get('p50'))}): "
          f"{_fmt(i['auto_over_forced_full_p50'], 5, 2)}x; memory after rollback "
          f"{i['memory_checks']}")
    if "template_memory" in summary:
        p("")
        p("memory held by the template of a 200 MB process (pages only it and its "
          "carriers map)")
        p(f"{'dirtied MB':>10} | {'template held MB':>19} | {'minus dirtied':>13}")
        for t in summary["template_memory"]:
            p(f"{t['dirtied_mb']:>10} | {t['held_mb']:>19.1f} | "
              f"{t['held_minus_dirtied_mb']:>+13.1f}")
    p("")
    p("targets:")
    for name, t in targets.items():
        v = t["value"]
        verdict = "n/a" if t["pass"] is None else ("PASS" if t["pass"] else "FAIL")
        vs = "-" if v is None else f"{v:.3g}"
        p(f"  {verdict:4}  {name:40} {vs:>8}  (target {t['target']})")
    p("")
    p(f"JSON: {json_path}")
    p(f"PNG:  {png_path}")


def _line(ax: Any, xs: list[float], samples: list[list[float]], label: str, color: str,
          marker: str = "o") -> None:
    pts = [(x, v) for x, v in zip(xs, samples) if v]
    if not pts:
        return
    x = [a for a, _ in pts]
    p50 = [percentile(v, 50) for _, v in pts]
    lo = [m - percentile(v, 10) for m, (_, v) in zip(p50, pts)]
    hi = [percentile(v, 90) - m for m, (_, v) in zip(p50, pts)]
    ax.errorbar(x, p50, yerr=[lo, hi], label=label, color=color, marker=marker, capsize=3,
                linewidth=1.2, markersize=4)


SERIES_STYLE = (("checkpoint_ms", "checkpoint", "#1f77b4", "o"),
                ("rollback_new_ms", "rollback (newest cp)", "#2ca02c", "s"),
                ("rollback_old_ms", "rollback (older cp)", "#17becf", "D"),
                ("replay_ms", "restart + replay", "#d62728", "^"),
                ("floor_ms", "fork() floor (host)", "#7f7f7f", "v"))


def plot(series: list[Series], fork: dict | None, tmem: list[dict] | None, machine: dict,
         path: Path, quick: bool) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(2, 3, figsize=(17, 9.5))
    by = {s.name: s for s in series}

    def panel(ax: Any, names: tuple[str, ...], x_of: Any, xlabel: str, title: str) -> None:
        present = [by[n] for n in names if n in by]
        xs = [x_of(s) for s in present]
        for attr, label, color, marker in SERIES_STYLE:
            _line(ax, xs, [getattr(s, attr) for s in present], label, color, marker)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks(xs)
        ax.set_xticklabels([str(x) for x in xs])
        ax.xaxis.set_minor_formatter(plt.NullFormatter())
        ax.set_xlabel(xlabel)
        ax.set_ylabel("latency (ms), p50 with p10-p90")
        ax.set_title(title, fontsize=10)
        ax.grid(which="both", alpha=0.25)
        ax.legend(fontsize=7)

    panel(axes[0][0], RSS_SERIES, lambda s: s.size_mb, "workload memory (MB), 1 process",
          "latency vs process RSS")
    panel(axes[0][1], COUNT_SERIES, lambda s: s.nproc, "processes (10 MB each)",
          "latency vs process count")
    if "full" in by:
        f = by["full"]
        latency_boxplot(axes[0][2], {"checkpoint": {"deltabox": f.checkpoint_ms},
                                     "rollback newest": {"deltabox": f.rollback_new_ms},
                                     "rollback older": {"deltabox": f.rollback_old_ms},
                                     "restart+replay": {"baseline": f.replay_ms}},
                        colors={"deltabox": "#1f77b4", "baseline": "#d62728"},
                        title="full scenario: bash + python 200 MB + 10k files",
                        hlines=[(10.0, "checkpoint target 10 ms"),
                                (3.0, "rollback target 3 ms")], legend_loc="upper left")
    else:
        axes[0][2].set_axis_off()
    ax = axes[1][0]
    if fork:
        ns = [int(n) for n in fork["per_n"]]
        _line(ax, ns, [fork["per_n"][str(n)]["total_ms"] for n in ns], "fork(N) total",
              "#1f77b4")
        _line(ax, ns, [fork["per_n"][str(n)]["per_child_ms"] for n in ns], "per child",
              "#ff7f0e", "s")
        ax.axhline(300, color="gray", linestyle="--", linewidth=0.8)
        ax.annotate("target: 32 children <= 300 ms", (ns[0], 300), textcoords="offset points",
                    xytext=(0, 3), fontsize=7, color="gray")
        ax.set_xscale("log", base=2)
        ax.set_xticks(ns)
        ax.set_xticklabels([str(n) for n in ns])
        ax.xaxis.set_minor_formatter(plt.NullFormatter())
        ax.set_yscale("log")
        ax.set_xlabel("children N")
        ax.set_ylabel("latency (ms), p50 with p10-p90")
        ax.set_title("fan-out fork from the full checkpoint (files + processes "
                     "restored)", fontsize=9)
        ax.grid(which="both", alpha=0.25)
        ax.legend(fontsize=7)
    else:
        ax.set_axis_off()
    ax = axes[1][1]
    if tmem:
        ds = [t["dirtied_mb"] for t in tmem]
        ax.plot(ds, [t["held_mb"] for t in tmem], marker="o", color="#1f77b4",
                label="held by the template (and its carriers)")
        top = max(ds + [t["held_mb"] for t in tmem]) * 1.1 or 1
        ax.plot([0, top], [0, top], linestyle="--", color="gray", linewidth=0.8,
                label="y = dirtied")
        for t in tmem:
            ax.annotate(f"{t['held_mb']:.1f}", (t["dirtied_mb"], t["held_mb"]),
                        textcoords="offset points", xytext=(4, -10), fontsize=7)
        ax.set_xlabel("MB dirtied by the live process since the checkpoint")
        ax.set_ylabel("memory held by the template (MB)")
        ax.set_title(f"template memory ({TEMPLATE_SIZE_MB} MB python process)", fontsize=10)
        ax.grid(alpha=0.25)
        ax.legend(fontsize=7)
    else:
        ax.set_axis_off()
    ax = axes[1][2]
    names = [s.name for s in series]
    if names:
        x = range(len(names))
        sp = [ratio(percentile(s.replay_ms, 50), percentile(s.rollback_new_ms, 50))
              if s.replay_ms and s.rollback_new_ms else 0 for s in series]
        ax.bar(x, sp, color="#2ca02c", alpha=0.75)
        for i, v in enumerate(sp):
            ax.annotate(f"{v:.0f}x", (i, v), textcoords="offset points", xytext=(0, 2),
                        ha="center", fontsize=7)
        ax.axhline(30, color="gray", linestyle="--", linewidth=0.8)
        ax.annotate("target 30x", (len(names) - 0.5, 30), textcoords="offset points",
                    xytext=(0, 2), ha="right", fontsize=7, color="gray")
        ax.set_xticks(list(x))
        ax.set_xticklabels(names, fontsize=8)
        ax.set_ylabel("restart+replay p50 / rollback p50")
        ax.set_title("rollback speed-up over restart-and-replay", fontsize=10)
        ax.grid(axis="y", alpha=0.25)
    else:
        ax.set_axis_off()
    reps = len(series[0].checkpoint_ms) if series else 0
    lanes = "" if machine.get("fork_lanes", True) else "; fork lanes off (--no-fork-lanes)"
    if machine.get("fork_spares") is not None:
        lanes += f"; --fork-spares {machine['fork_spares']}"
    finish_figure(fig, path, f"DeltaBox process state (DeltaCR){' (quick)' if quick else ''}: "
                  f"{reps} reps per config{lanes}", machine)


# ---- main ------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.process_cr", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="5 reps per config, 3 restart-and-replay reps, 2 fork reps (~3 min)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"default {DEFAULT_OUT}")
    p.add_argument("--tmp-parent", type=Path, default=Path("/var/tmp"),
                   help="where the private daemon's state dir goes")
    p.add_argument("--reps", type=int, help="checkpoint/rollback reps per config "
                   "(default 20, --quick 5)")
    p.add_argument("--replay-reps", type=int, help="restart-and-replay reps per config "
                   "(default 10, --quick 3)")
    p.add_argument("--fork-reps", type=int, help="reps per fan-out N (default 5, --quick 2)")
    p.add_argument("--settle", type=float, default=0.2, metavar="S",
                   help="pause before each timed checkpoint/rollback/fork (the agent "
                   "'thinking'; the warm pool prepares rollbacks meanwhile); default 0.2 s")
    p.add_argument("--configs", default=",".join(c.name for c in CONFIGS),
                   help="comma-separated subset of " + ", ".join(c.name for c in CONFIGS))
    p.add_argument("--no-fork", action="store_true", help="skip the fan-out fork")
    p.add_argument("--no-idle", action="store_true",
                   help="skip the idle-process checkpoint (auto vs forced full)")
    p.add_argument("--no-template-memory", action="store_true",
                   help="skip the template memory measurement")
    p.add_argument("--keep-state", action="store_true",
                   help="keep the daemon's temp dir (for debugging)")
    p.add_argument("--huge-pages", action="store_true",
                   help="create the sandboxes with huge_pages (glibc's malloc in 2 MiB pages "
                   "under the host's THP madvise) and run the fork floor so too")
    p.add_argument("--thp", choices=("always", "madvise", "never"),
                   help="set the host's transparent huge page mode for this run and put it "
                   "back afterwards (default: leave it; README 'Host tuning')")
    p.add_argument("--no-fork-lanes", action="store_true",
                   help="run deltaboxd with --no-fork-lanes: every fork child from the one "
                   "template (the baseline of the fork lanes, README 'Fork lanes')")
    p.add_argument("--fork-spares", type=int, default=None, metavar="N",
                   help="run deltaboxd with --fork-spares N (0: every fork child boots its "
                   "own init, the baseline of the fork spares, README 'Fork spares')")
    p.add_argument("--daemon-arg", action="append", default=[], metavar="ARG",
                   help="extra deltaboxd argument (repeatable), for an A/B of a daemon "
                   "setting, e.g. --daemon-arg=--prewarm-mb=0")
    p.add_argument("--replot", type=Path, metavar="JSON",
                   help="only redraw the PNG (next to JSON) from an earlier process_cr.json")
    return p.parse_args(argv)


def replot(json_path: Path) -> int:
    doc = json.loads(json_path.read_text())
    raw = doc["raw"]
    series = [Series(**s) for s in raw["configs"]]
    png = json_path.with_suffix(".png")
    plot(series, raw.get("fork"), raw.get("template_memory"), doc["machine"], png,
         doc.get("mode") == "quick")
    print(f"PNG:  {png}")
    return 0


def thp_setting() -> str:
    try:
        return Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
    except OSError:
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replot is not None:
        return replot(args.replot)
    if os.geteuid() != 0:
        print("benchmarks.process_cr: run as root (it starts a private deltaboxd)",
              file=sys.stderr)
        return 1
    names = tuple(n.strip() for n in args.configs.split(",") if n.strip())
    unknown = set(names) - {c.name for c in CONFIGS}
    if unknown:
        print(f"benchmarks.process_cr: unknown config(s) {sorted(unknown)}", file=sys.stderr)
        return 2
    if args.quick:
        plan = Plan(reps=args.reps or 5, replay_reps=args.replay_reps or 3, floor_reps=10,
                    fork_reps=args.fork_reps or 2, settle_s=args.settle, configs=names,
                    huge_pages=args.huge_pages)
    else:
        plan = Plan(reps=args.reps or 20, replay_reps=args.replay_reps or 10, floor_reps=30,
                    fork_reps=args.fork_reps or 5, settle_s=args.settle, configs=names,
                    huge_pages=args.huge_pages)
    if plan.reps < 1 or plan.replay_reps < 1 or plan.fork_reps < 1:
        print("benchmarks.process_cr: reps must be at least 1", file=sys.stderr)
        return 2
    t_start = time.time()
    load_start = os.getloadavg()
    others = other_daemons()
    if others:
        log(f"warning: {len(others)} other deltaboxd process(es) running; timings may be "
            "noisy")

    series: list[Series] = []
    fork: dict | None = None
    tmem: list[dict] | None = None
    idle: dict | None = None
    result: dict[str, Any] = {}
    machine: dict[str, Any] = {}
    daemon = PrivateDaemon(parent=args.tmp_parent, keep=args.keep_state,
                           extra_args=(["--no-fork-lanes"] if args.no_fork_lanes else []) +
                           ([] if args.fork_spares is None
                            else ["--fork-spares", str(args.fork_spares)]) +
                           args.daemon_arg)
    with terminate_as_exception(), host_thp(args.thp):
        try:
            daemon.start()
            machine = machine_info(daemon.socket)
            machine["transparent_hugepage"] = thp_setting()
            machine["transparent_hugepage_unadvised_sizes"] = hostmem.unadvised_sizes()
            machine["fork_lanes"] = not args.no_fork_lanes
            machine["fork_spares"] = args.fork_spares   # None: the daemon's default
            machine["daemon_args"] = args.daemon_arg
            machine["workload_python"] = sandbox_python()
            log(f"daemon up: store {machine['deltabox'].get('store_backend')}; workload "
                f"interpreter {machine['workload_python']}")
            for cfg in CONFIGS:
                if cfg.name in plan.configs:
                    series.append(run_config(daemon, cfg, plan))
            if not args.no_fork:
                fork = run_fork(daemon, plan)
            if not args.no_idle:
                idle = run_idle(daemon, plan)
            if not args.no_template_memory:
                tmem = run_template_memory(daemon, plan)
            summary = summarize(series, fork, tmem)
            if idle is not None:
                summary["idle_process"] = summarize_idle(idle)
            targets = evaluate_targets(summary)
            machine["loadavg_start"] = load_start
            machine["loadavg_end"] = os.getloadavg()
            machine["other_deltaboxd_at_start"] = others
            result = {
                "benchmark": "process_cr",
                "mode": "quick" if args.quick else "full",
                "plan": plan.__dict__,
                "configs": [c.__dict__ | {"label": c.label} for c in CONFIGS
                            if c.name in plan.configs],
                "method": {
                    "timing": "client-side wall time around one SDK call (time.perf_counter); "
                    "the daemon's own durations are next to it (*_server_ms)",
                    "workload": "python3 /workspace/w.py SIZE_MB IDX started with nohup from "
                    "the bash session 'main' (which has a variable and a cwd); it allocates "
                    "a bytearray of SIZE_MB, writes every page with a pattern, writes "
                    "/workspace/ctl/ready-IDX, then polls /workspace/ctl/cmd-IDX every 50 ms",
                    "checkpoint": "sbx.checkpoint() (mode auto: files + processes); before "
                    "each, the workload dirties 1 MB and a file changes (untimed)",
                    "rollback": "after each checkpoint: the workload dirties 1 MB and the "
                    "file changes, pause (settle_s), sbx.rollback(just taken); then dirty, "
                    "pause, sbx.rollback(the config's first checkpoint = 'older'). The pause "
                    "lets the warm pool prepare the rollback. Every rollback's process_state "
                    "must be 'restored' (else counted, and the workload restarted and "
                    "re-checkpointed); the changed file is checked after every rollback and "
                    "the workload's memory CRC-32 after every rollback (configs <= 256 MB in "
                    "all) or every 4th rep and the last",
                    "turn_boundary": "per rep, the workload dirties 1 MB, pause, "
                    "session.run(':') timed; a file changes, the workload dirties 1 MB, pause, "
                    "session.run(':', checkpoint='auto') timed; the checkpoint's record is "
                    "read afterwards (get_checkpoint waits for it: untimed), then the workload "
                    "diverges and a rollback to it (untimed) is verified like the others; "
                    "turn_checkpoint_visible_ms = p50 with - p50 without",
                    "restart_replay": "kill -9 of the workload's processes (one exec, which "
                    "also removes their control files) + start fresh ones from the session + "
                    "poll the files API until each has written its ready file (memory "
                    "allocated and patterned); CRC checked against the checkpointed base "
                    "afterwards (untimed)",
                    "floor": "on the host, the same interpreter allocates and patterns the "
                    "same memory, then fork() and wait until the child has written a byte "
                    "to a pipe; for N processes, one process forks N children",
                    "fork": "sbx.fork(cp, count=N) from a checkpoint of bash + python 200 MB "
                    "+ 10k files: each child gets the checkpoint's files and its processes, "
                    "spawned from the source's templates (the summary's fork.kind and each "
                    "N's process_states say what happened); the first and last child "
                    "of each N's first rep are inspected (processes, files, a session)",
                    "idle_process": "a sandbox with a bash session and a python holding "
                    "200 MB blocked in signal.pause(); per rep a session command (export), a "
                    "settle pause, then checkpoint(), alternately mode auto (the python keeps "
                    "its parent's template: reasons say so) and mode full (every process "
                    "captured afresh, the baseline); every 4th auto checkpoint is rolled back "
                    "to and the python's memory CRC checked",
                    "template_memory": f"a fresh sandbox per D: python {TEMPLATE_SIZE_MB} MB,"
                    " checkpoint, the live process dirties D MB (one byte per page), then the"
                    " template (the new process in the sandbox cgroup in tracing stop with "
                    "the workload's cmdline, the first of them: later ones are carriers "
                    "spawned from it for the next rollback) is read: its resident pages "
                    "mapped by no process but it and its carriers (/proc/<pid>/pagemap + "
                    "/proc/kpagecount; without carriers that is smaps' Private_Clean + "
                    "Private_Dirty)",
                },
                "summary": summary,
                "targets": targets,
                "raw": {"configs": [s.__dict__ for s in series], "fork": fork,
                        "template_memory": tmem, "idle_process": idle},
                "duration_s": time.time() - t_start,
            }
        finally:
            daemon.stop()
    if not result:
        return 1
    record_cleanup(result, daemon)
    out = args.out
    json_path = write_json(out / "process_cr.json", result, machine)
    png_path = out / "process_cr.png"
    plot(series, fork, tmem, machine, png_path, args.quick)
    print_summary(result["summary"], result["targets"], json_path, png_path)
    return 0 if not daemon.leaks else 3


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        log("interrupted; the private daemon was stopped (cleanup problems, if any, above)")
        sys.exit(130)
    except Terminated as e:
        log(f"terminated by {e}; the private daemon was stopped (cleanup problems, if any, "
            "above)")
        sys.exit(143)
