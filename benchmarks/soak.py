"""Soak benchmark (issue 7 part 4): many concurrent sandboxes doing random exec / session /
checkpoint / rollback / fork / delete cycles against one private deltaboxd, with the state
verified against a model after every rollback and in every fork child.

    .venv/bin/python -m benchmarks.soak [--quick] [--out DIR] [--sandboxes 32] [--cycles 200]
                                         [--seed 1] [--time-limit S]

One thread per sandbox drives the SDK. Each sandbox does `cycles` operations chosen with
random.Random(seed * 1000 + index):

- exec: write a random file (`sh -c printf`), append a line to a log, run python3 (writes a
  file whose content the model computes too), or remove a file; all under /workspace/w;
- session: `sbx.session("main").run(...)`: assign a string variable, add to an integer
  variable, export one, define a function, `cd` somewhere;
- checkpoint: mode auto (80 %), full (10 %) or fs (10 %);
- rollback to a random checkpoint of its own (any still alive);
- fork: 1-2 children from a random checkpoint; each child is verified and removed;
- delete of an old checkpoint (never the newest two).

With --processes each session also runs a key-value server (KV_SERVER: python3 on loopback,
its dict and a ballast whose CRC is a function of it live only in its memory), and the ops
add kv_set (a key set through bash's /dev/tcp), session_job (a background job that ends by
itself a few ms later), exec_timeout (a command with a child killed at its 0.1 s timeout)
and session_timeout (the session restarted by the daemon: its state, the server with it,
adopted as the model).

The model: per sandbox, the expected state now and at each checkpoint: the contents of every
file under /workspace/w and the session's variables, function and cwd. Verification: the
files are hashed inside the sandbox (python3, sha256 per file) and compared with the model;
the session prints its variables, function output and cwd. A rollback (or fork) whose
process_state is not "restored" legitimately loses the session: then only files are verified
(counted as `session_restarted`), and the session's actual state is adopted as the model.

Recorded: cycles completed, verifications passed/failed (each failure logged with sandbox,
op, checkpoint and what differed), client-side latency per op type, errors by gRPC status,
the daemon's RSS and open fds every second, and after the daemon stopped what it left behind
(mounts, loop devices, cgroups, processes). Writes DIR/soak.json and DIR/soak.png. Exit
status: 0 if every verification passed and nothing leaked, 1 otherwise.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import random
import re
import signal
import sys
import threading
import time
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deltabox import DeadlineExceeded

from benchmarks.common import (DEFAULT_OUT, PrivateDaemon, finish_figure, latency_boxplot, log,
                               machine_info, other_daemons, pyplot, record_cleanup, run_main,
                               stats, terminate_as_exception, write_json)

WORK = "/workspace/w"
N_FILES = 24
SUBDIRS = ("", "", "a/", "b/c/")
CWDS = ("/workspace", WORK, "/tmp", "/")
UNSET = "__unset__"
NOFN = "__nofn__"

HASH_SCRIPT = r"""
import hashlib, json, os
base = '/workspace/w'
r = {}
for d, _, fs in os.walk(base):
    for f in fs:
        p = os.path.join(d, f)
        with open(p, 'rb') as fh:
            r[os.path.relpath(p, base)] = hashlib.sha256(fh.read()).hexdigest()
print(json.dumps(r, sort_keys=True))
"""

PY_WRITE = ("import hashlib, sys; open('/workspace/w/' + sys.argv[1], 'w').write("
            "hashlib.sha256(sys.argv[2].encode()).hexdigest() * int(sys.argv[3]))")

# --processes: a key-value server in each sandbox's session, started as a background job: its
# dict and a ballast of BALLAST_MB, whose pages 0..N_KEYS-1 hold each key's value repeated
# (so its content is a function of the dict alone), live only in its memory. It serves
# line requests on loopback TCP and on a named unix socket, any number of connections at
# once (selectors). A pinger (PINGER) holds one connection of each kind for its whole life
# and pings on both every PING_S, so a checkpoint often falls with a request or an answer
# on its way: each side checks the other's numbers follow on, and the server keeps, per
# channel, the last number, the pinger's count of bad answers, its own count of gaps, and
# how long ago the last ping came (dump).
KV_PORT = 7070
KV_SOCK = "/workspace/kv.sock"
N_KEYS = 24
BALLAST_MB = 8
PING_S = 0.025
HISTORY = 30    # ops of a worker kept for a failure's context (Worker.history)
CHANNELS = ("tcp", "unix")
KV_SERVER = f"""
import json, os, selectors, socket, time, zlib
PAGE = 4096
ballast = bytearray(bytes(range(256)) * ({BALLAST_MB} << 12))
d = {{}}
talk = {{}}   # channel -> [last ping number, the pinger's bad answers, gaps seen here, when]
sel = selectors.DefaultSelector()


def listen(s):
    s.listen(16)
    sel.register(s, selectors.EVENT_READ, "listener")


# The unix listener first: KV_START waits for the TCP port alone before it starts the
# pinger, which connects to both (the other order raced it: "the pinger started is not
# heard", its connect to the unix socket failing with ENOENT).
if os.path.exists("{KV_SOCK}"):
    os.unlink("{KV_SOCK}")
u = socket.socket(socket.AF_UNIX)
u.bind("{KV_SOCK}")
listen(u)
t = socket.socket()
t.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
t.bind(("127.0.0.1", {KV_PORT}))
listen(t)


def answer(words):
    if words[:1] == ["set"] and len(words) == 3:
        k, v = words[1], words[2]
        d[k] = v
        i = int(k[1:])
        ballast[i * PAGE:(i + 1) * PAGE] = (v.encode() * PAGE)[:PAGE]
        return "ok"
    if words[:1] == ["ping"] and len(words) == 4:
        ch, n, bad = words[1], int(words[2]), int(words[3])
        last = talk.get(ch)
        gaps = 0 if last is None else last[2] + (n != last[0] + 1)
        talk[ch] = [n, bad, gaps, time.monotonic()]
        return "pong %s %d" % (ch, n)
    if words[:1] == ["dump"]:
        now = time.monotonic()
        seen = {{c: v[:3] + [round((now - v[3]) * 1000)] for c, v in talk.items()}}
        return json.dumps([d, zlib.crc32(ballast), os.getpid(), seen], sort_keys=True)
    return "what"


bufs = {{}}
while True:
    for key, _ in sel.select():
        s = key.fileobj
        if key.data == "listener":
            c, _ = s.accept()
            bufs[c] = b""
            sel.register(c, selectors.EVENT_READ, "conn")
            continue
        data = s.recv(65536)
        if not data:
            sel.unregister(s)
            del bufs[s]
            s.close()
            continue
        bufs[s] += data
        while b"\\n" in bufs[s]:
            line, bufs[s] = bufs[s].split(b"\\n", 1)
            s.sendall(answer(line.decode().split()).encode() + b"\\n")
"""
PINGER = f"""
import socket, time


def connect(ch):
    if ch == "tcp":
        s = socket.create_connection(("127.0.0.1", {KV_PORT}))
    else:
        s = socket.socket(socket.AF_UNIX)
        s.connect("{KV_SOCK}")
    # No timeout: a restored process keeps the deadline of the timed wait it was stopped
    # in (README, Threads), so a rollback to a checkpoint taken while it waited for a pong
    # more than that long ago timed the wait out at once; the pinger then reconnected,
    # closing its connection with the pong unread, and that RST killed the server. A lost
    # answer still shows: the server stops hearing this channel (Kv.talking).
    return s.makefile("rwb")


files = {{ch: connect(ch) for ch in {CHANNELS!r}}}
n = dict.fromkeys(files, 0)
bad = 0
while True:
    for ch in files:
        n[ch] += 1
        try:
            f = files[ch]
            f.write(b"ping %s %d %d\\n" % (ch.encode(), n[ch], bad))
            f.flush()
            ok = f.readline().split() == [b"pong", ch.encode(), b"%d" % n[ch]]
        except OSError:
            ok = False
        if not ok:
            bad += 1
            try:
                files[ch] = connect(ch)
            except OSError:
                pass
    time.sleep({PING_S})
"""
KV_LOG = "/workspace/kv.log"    # the server's and the pinger's stderr (a failed start's)
KV_START = (f"nohup python3 /workspace/kv.py >>{KV_LOG} 2>&1 &\n"
            f"for i in $(seq 200); do (exec 7<>/dev/tcp/127.0.0.1/{KV_PORT}) 2>/dev/null "
            "&& break; sleep 0.01; done\n"
            f"nohup python3 /workspace/pinger.py >>{KV_LOG} 2>&1 &")


def kv_request(line: str) -> str:
    """A session command that sends `line` to the server and prints its answer (bash's
    /dev/tcp: no program started); nothing when no server answers (the session's last
    answer printed again made a server gone after a rollback look like one answering
    `dump` with `ok`)."""
    return (f"kvans=; exec 7<>/dev/tcp/127.0.0.1/{KV_PORT} && printf '%s\\n' '{line}' >&7 && "
            "IFS= read -r kvans <&7; exec 7>&-; printf '%s\\n' \"$kvans\"")


def kv_crc(kv: dict[str, str]) -> int:
    """The server's ballast CRC for dict `kv` (its pages computed as the server does)."""
    ballast = bytearray(bytes(range(256)) * (BALLAST_MB << 12))
    for k, v in kv.items():
        i = int(k[1:])
        ballast[i * 4096:(i + 1) * 4096] = (v.encode() * 4096)[:4096]
    return zlib.crc32(ballast)


SESSION_PROBE = ('printf "%s\\n" "${S0-' + UNSET + '}" "${S1-' + UNSET + '}" "${S2-' + UNSET
                 + '}" "$(soakfn 2>/dev/null || echo ' + NOFN + ')" "$(pwd)"')

# op -> weight
OPS = {
    "exec_write": 12, "exec_append": 9, "exec_python": 7, "exec_rm": 4,
    "session": 14,
    "checkpoint": 22,
    "rollback": 14,
    "fork": 8,
    "delete": 7,
}
# with --processes: op -> weight
PROCESS_OPS = {"kv_set": 12, "session_job": 4, "exec_timeout": 2, "session_timeout": 1}


@dataclass
class State:
    files: dict[str, str] = field(default_factory=dict)   # path under WORK -> content
    vars: dict[str, str] = field(default_factory=dict)    # S0, S1, S2 -> value
    fn: str | None = None                                 # what soakfn prints
    cwd: str | None = "/workspace"                        # None: not known, not verified
    kv: dict[str, str] | None = None                      # the server's dict (--processes)
    kv_pid: int | None = None                             # and its pid in the sandbox

    def copy(self) -> State:
        return State(dict(self.files), dict(self.vars), self.fn, self.cwd,
                     None if self.kv is None else dict(self.kv), self.kv_pid)

    def file_hashes(self) -> dict[str, str]:
        return {p: hashlib.sha256(c.encode()).hexdigest() for p, c in self.files.items()}

    def session_view(self) -> list[str]:
        return [self.vars.get("S0", UNSET), self.vars.get("S1", UNSET),
                self.vars.get("S2", UNSET), self.fn or NOFN, self.cwd or "?"]


@dataclass
class Kv:
    """What the key-value server answers to `dump`."""
    kv: dict[str, str]
    crc: int
    pid: int
    talk: dict[str, list[int]]    # channel -> last ping number, bad answers, gaps, age (ms)

    def talking(self) -> bool:
        """The pinger was heard on every channel lately."""
        return all(ch in self.talk and self.talk[ch][3] <= PING_S * 8000 for ch in CHANNELS)

    def clean(self) -> bool:
        """Neither side saw a lost, repeated or wrong message."""
        return all(v[1] == 0 and v[2] == 0 for v in self.talk.values())


class Recorder:
    """Shared, thread-safe record of the run."""

    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self.lock = threading.Lock()
        self.lat: dict[str, list[float]] = {}
        self.timeline: list[tuple[float, str, float]] = []   # (t, op, ms)
        self.errors: Counter[str] = Counter()                # "op:CODE"
        self.error_samples: list[dict[str, Any]] = []
        self.verify: Counter[str] = Counter()
        self.failures: list[dict[str, Any]] = []
        self.anomalies: list[dict[str, Any]] = []
        self.counts: Counter[str] = Counter()
        self.restart_reasons: Counter[str] = Counter()       # "op: note, ids blanked"
        self.cycles = 0
        self.cycle_times: list[float] = []

    def op(self, name: str, ms: float) -> None:
        with self.lock:
            self.lat.setdefault(name, []).append(ms)
            self.timeline.append((time.monotonic() - self.t0, name, ms))

    def error(self, sbx: str, op: str, e: BaseException) -> None:
        code = getattr(getattr(e, "code", None), "name", None) or type(e).__name__
        with self.lock:
            self.errors[f"{op}:{code}"] += 1
            if len(self.error_samples) < 200:
                self.error_samples.append({"t": time.monotonic() - self.t0, "sandbox": sbx,
                                           "op": op, "code": code, "message": str(e)[:2000]})
        log(f"error: sandbox {sbx} op {op}: {code}: {str(e)[:500]}")

    def anomaly(self, kind: str, detail: dict[str, Any]) -> None:
        with self.lock:
            self.counts[kind] += 1
            if len(self.anomalies) < 200:
                self.anomalies.append({"t": time.monotonic() - self.t0, "kind": kind,
                                       **detail})
        log(f"anomaly {kind}: {json.dumps(detail)[:1500]}")

    def count(self, what: str, n: int = 1) -> None:
        with self.lock:
            self.counts[what] += n

    def restarted(self, op: str, note: str) -> None:
        """A restore restarted processes: why, as its note says (ids and numbers blanked so
        that the same cause counts once), to tell a checkpoint taken without processes from
        process state lost under load."""
        why = re.sub(r"\d+", "N", re.sub(r"\bcp-[0-9a-f]+", "cp-X", note or "(no note)"))
        with self.lock:
            self.restart_reasons[f"{op}: {why[:200]}"] += 1

    def verified(self, kind: str, ok: bool, detail: dict[str, Any] | None = None) -> None:
        with self.lock:
            self.verify[f"{kind}_{'passed' if ok else 'failed'}"] += 1
            if not ok and detail is not None:
                self.failures.append(detail)
        if not ok:
            log(f"VERIFICATION FAILED: {json.dumps(detail)[:3000]}")

    def cycle_done(self) -> None:
        with self.lock:
            self.cycles += 1
            self.cycle_times.append(time.monotonic() - self.t0)


class RssSampler(threading.Thread):
    """The daemon's VmRSS (and open fds, threads) every `period` seconds."""

    def __init__(self, pid: int, t0: float, period: float = 1.0) -> None:
        super().__init__(daemon=True, name="rss-sampler")
        self.pid, self.t0, self.period = pid, t0, period
        self.samples: list[dict[str, float]] = []
        self.stop_event = threading.Event()

    def sample(self) -> dict[str, float] | None:
        try:
            rss = threads = 0
            with open(f"/proc/{self.pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        rss = int(line.split()[1])
                    elif line.startswith("Threads:"):
                        threads = int(line.split()[1])
            fds = len(os.listdir(f"/proc/{self.pid}/fd"))
        except OSError:
            return None
        return {"t": time.monotonic() - self.t0, "rss_mb": rss / 1024, "fds": fds,
                "threads": threads}

    def fd_kinds(self) -> dict[str, int]:
        """The daemon's open fds by kind (socket, pipe, anon_inode:..., a path's top dir)."""
        kinds: Counter[str] = Counter()
        try:
            for fd in os.listdir(f"/proc/{self.pid}/fd"):
                try:
                    target = os.readlink(f"/proc/{self.pid}/fd/{fd}")
                except OSError:
                    continue
                if target.startswith("/"):
                    parts = target.split("/")
                    kind = "/".join(parts[:3]) if len(parts) > 2 else target
                    if "dbx-bench-" in target:
                        kind = "state dir: " + "/".join(target.split("/state/", 1)[-1]
                                                        .split("/")[:2])
                else:
                    kind = target.split(":[", 1)[0] if ":[" in target else target
                kinds[kind] += 1
        except OSError:
            pass
        return dict(kinds.most_common())

    def run(self) -> None:
        while not self.stop_event.is_set():
            s = self.sample()
            if s is not None:
                self.samples.append(s)
            self.stop_event.wait(self.period)

    def stop(self) -> None:
        self.stop_event.set()
        self.join(5)


def slope_per_min(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope (y per minute) of (t seconds, y) points."""
    if len(points) < 3:
        return None
    n = len(points)
    mt = sum(t for t, _ in points) / n
    my = sum(y for _, y in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    if var == 0:
        return None
    return 60.0 * sum((t - mt) * (y - my) for t, y in points) / var


def _take_view(state: State, got: list[str]) -> None:
    """Make `state`'s session what the session probe printed (its cwd too, if printed)."""
    state.vars = {k: v for k, v in zip(("S0", "S1", "S2"), got[:3]) if v != UNSET}
    state.fn = None if got[3] == NOFN else got[3]
    if len(got) > 4:
        state.cwd = got[4]


# ---- one sandbox ------------------------------------------------------------------------------

class Worker:
    def __init__(self, idx: int, socket: str, cycles: int, seed: int, rec: Recorder,
                 stop_at: float | None, stop_event: threading.Event,
                 processes: bool = False) -> None:
        self.idx = idx
        self.processes = processes
        self.socket = socket
        self.cycles = cycles
        self.rng = random.Random(seed * 1000 + idx)
        self.rec = rec
        self.stop_at = stop_at
        self.stop_event = stop_event
        self.sbx: Any = None
        self.name = f"#{idx}"
        self.cur = State()
        self.cps: dict[str, State] = {}      # live checkpoints of ours -> model
        self.cp_order: list[str] = []        # oldest first
        self.done = 0
        self.seq = 0
        self.last_op = ""
        self.restore_note = ""      # the last rollback's or fork child's note (anomalies)
        # The last ops, each with what it asked and got (a failure's context: the fault
        # may lie a few ops back, a checkpoint that captured something else than it said)
        self.history: collections.deque[str] = collections.deque(maxlen=HISTORY)
        self.said = ""              # what the current op adds to its history line

    # -- helpers --
    def timed(self, op: str, fn: Any, *a: Any, **kw: Any) -> Any:
        t = time.perf_counter()
        r = fn(*a, **kw)
        self.rec.op(op, (time.perf_counter() - t) * 1000)
        return r

    def session_run(self, op: str, command: str) -> Any:
        """Run `command` in the session "main"; a restart the daemon notes (its shell had
        exited: nothing here asked for it) is an error, after which the model adopts the
        sandbox's actual state (resync)."""
        r = self.timed(op, self.sbx.session("main").run, command, timeout=120)
        if "restarted" in r.note:
            raise RuntimeError(f"the session restarted unasked: {r.note}")
        return r

    def token(self, n: int = 8) -> str:
        return "%0*x" % (n, self.rng.getrandbits(4 * n))

    def read_files(self, box: Any, retry: bool = True) -> dict[str, str]:
        r = self.timed("verify_files", box.exec, ["python3", "-c", HASH_SCRIPT], timeout=120)
        if r.exit_code != 0:
            raise RuntimeError(f"hash script exited {r.exit_code}: {r.stderr[-500:]}")
        try:
            return json.loads(r.stdout)
        except ValueError:
            # The script always prints a JSON line: an exit 0 without it is the daemon's
            # (output lost). Recorded with what came back, then retried once.
            detail = {"sandbox": self.sbx.id, "checked": box.id, "exit_code": r.exit_code,
                      "stdout": r.stdout[:300], "stdout_bytes": len(r.stdout_bytes),
                      "stderr": r.stderr[-300:], "stdout_truncated": r.stdout_truncated,
                      "duration_ms": r.duration_ms, "last_op": self.last_op}
            self.rec.anomaly("exec_output_lost", detail)
            if not retry:
                raise RuntimeError(f"hash script printed no JSON twice: {detail}") from None
            again = self.read_files(box, retry=False)
            self.rec.count("exec_output_lost_retry_ok")
            return again

    def read_session(self, box: Any) -> list[str]:
        r = self.timed("verify_session", box.session("main").run, SESSION_PROBE, timeout=120)
        if r.exit_code != 0:
            raise RuntimeError(f"session probe exited {r.exit_code}: {r.stderr[-500:]}")
        return r.stdout.rstrip("\n").split("\n")

    def check(self, box: Any, model: State, op: str, cp: str, with_session: bool,
              where: str) -> int | None:
        """Compare `box` with `model`; record passes/failures. Returns the key-value
        server's pid as found (None if not read)."""
        files = self.read_files(box)
        want = model.file_hashes()
        ok = files == want
        detail = None
        if not ok:
            detail = {"sandbox": self.sbx.id, "worker": self.idx, "checked": box.id,
                      "where": where, "op": op, "checkpoint": cp, "what": "files",
                      "missing": sorted(set(want) - set(files)),
                      "unexpected": sorted(set(files) - set(want)),
                      "differing": sorted(p for p in set(want) & set(files)
                                          if want[p] != files[p])}
        self.rec.verified("files", ok, detail)
        if not with_session:
            return None
        got = self.read_session(box)
        exp = model.session_view()
        if model.cwd is None:   # cwd unknown (not set since a restart): not verified
            got, exp = got[:-1], exp[:-1]
        ok = got == exp
        detail = None
        if not ok:
            detail = {"sandbox": self.sbx.id, "worker": self.idx, "checked": box.id,
                      "where": where, "op": op, "checkpoint": cp, "what": "session",
                      "expected": exp, "got": got,
                      "fields": ["S0", "S1", "S2", "soakfn", "cwd"],
                      "history": list(self.history)}
        self.rec.verified("session", ok, detail)
        if not ok and box is self.sbx:
            # One fault, counted once: the sandbox's session goes on from what it holds
            # (the model from the checkpoint would fail every later check of it).
            for m in (model, self.cur):
                _take_view(m, got)
        if model.kv is not None:
            return self.check_kv(box, model.kv, op, cp, where, model.kv_pid)
        return None

    def read_kv(self, box: Any) -> Kv | None:
        """The server's dict, ballast CRC, pid and what it saw of the pinger; None if
        nothing listens."""
        r = self.timed("verify_kv", box.session("main").run, kv_request("dump"), timeout=120)
        if r.exit_code != 0 or not r.stdout.strip():
            return None
        try:
            d, crc, pid, talk = json.loads(r.stdout)
        except ValueError as e:   # what the server, its sockets and the last restore were
            raise RuntimeError(f"the kv server's answer to dump is not its JSON ({e}): "
                               f"{r.stdout[:300]!r}; {self.seen(box)}; last restore's note: "
                               f"{self.restore_note!r}") from e
        return Kv(d, crc, pid, talk)

    def seen(self, box: Any) -> str:
        """The kv log's end, the sandbox's TCP sockets and processes (for an error)."""
        return f"{KV_LOG}, sockets, processes: " + box.exec(
            ["sh", "-c", f"tail -c 300 {KV_LOG}; ss -tanp; ps -eo pid,pgid,sid,stat,comm"]
        ).stdout

    def read_talking(self, box: Any, patience_s: float = 3.0) -> Kv | None:
        """read_kv once the pinger was heard on every channel within PING_S * 8 (restored
        processes may take a moment to run again), or the last reading after patience_s."""
        deadline = time.monotonic() + patience_s
        while True:
            got = self.read_kv(box)
            if got is None or got.talking() or time.monotonic() > deadline:
                return got
            time.sleep(PING_S * 2)

    def check_kv(self, box: Any, want: dict[str, str], op: str, cp: str, where: str,
                 model_pid: int | None = None) -> int | None:
        """Check the server's dict and pinger; returns its pid (None if nothing answers).
        A pid other than the checkpoint's is an anomaly: kv_pid_changed where the
        restore's note says a pid changed, kv_pid_changed_unnamed where it does not."""
        got = self.read_talking(box)
        ok = got is not None and got.kv == want and got.crc == kv_crc(want)
        detail = None
        if not ok:
            detail = {"sandbox": self.sbx.id, "worker": self.idx, "checked": box.id,
                      "where": where, "op": op, "checkpoint": cp, "what": "kv server",
                      "expected": want, "got": None if got is None else got.kv,
                      "crc_ok": None if got is None else got.crc == kv_crc(want)}
        self.rec.verified("kv_server", ok, detail)
        if got is not None:
            ok = got.talking() and got.clean()
            detail = None
            if not ok:
                detail = {"sandbox": self.sbx.id, "worker": self.idx, "checked": box.id,
                          "where": where, "op": op, "checkpoint": cp, "what": "pinger",
                          "talk": got.talk, "note": self.restore_note}
            self.rec.verified("pinger", ok, detail)
        if got is not None and model_pid is not None:   # pids kept where the kernel allows:
            kept = got.pid == model_pid                  # counted, not failed (README)
            if kept:
                self.rec.count("kv_pid_kept")
            else:   # counted by its kind (Recorder.anomaly)
                named = "new pid" in self.restore_note
                kind = "kv_pid_changed" if named else "kv_pid_changed_unnamed"
                self.rec.anomaly(kind, {"sandbox": self.sbx.id, "checked": box.id,
                                        "where": where, "checkpoint": cp,
                                        "expected": model_pid, "got": got.pid,
                                        "note": self.restore_note})
        return None if got is None else got.pid

    def start_kv(self, state: State) -> None:
        """(Re)start the server after a restart of the session's processes, or adopt the
        one running (a restart that kept it: its state is then the model's)."""
        got = self.read_kv(self.sbx)
        if got is None:
            r = self.timed("kv_start", self.sbx.session("main").run, KV_START, timeout=120)
            if r.exit_code != 0:
                raise RuntimeError(f"kv server start exited {r.exit_code}: {r.stderr[-300:]}")
            got = self.read_talking(self.sbx, patience_s=10)
            if got is None or not got.talking():
                what = ("the kv server started does not answer" if got is None else
                        f"the pinger started is not heard: {got.talk}")
                raise RuntimeError(f"{what}; {self.seen(self.sbx)}")
            self.rec.count("kv_server_started")
        else:
            self.rec.count("kv_server_adopted")
        state.kv, state.kv_pid = got.kv, got.pid

    def adopt_session(self, box: Any, state: State) -> None:
        """After a restart: take the session's actual state as the model."""
        got = self.read_session(box)
        if len(got) != 5:
            raise RuntimeError(f"session probe printed {got!r}")
        _take_view(state, got)
        if self.processes:
            self.start_kv(state)

    def resync(self, op: str) -> None:
        """After an error in a state-changing op: adopt the sandbox's actual state."""
        try:
            files = self.read_files(self.sbx)
            # contents are unknown from hashes alone: read them back
            self.cur.files = {p: self.sbx.files.read_text(f"{WORK}/{p}") for p in files}
            self.adopt_session(self.sbx, self.cur)
            self.rec.count("resyncs")
        except Exception as e:  # noqa: BLE001 - recorded; the worker goes on
            self.rec.error(self.sbx.id, f"resync_after_{op}", e)

    # -- ops --
    def op_exec_write(self) -> None:
        path = f"{self.rng.choice(SUBDIRS)}f{self.rng.randrange(N_FILES)}.txt"
        content = "\n".join(self.token(16) for _ in range(self.rng.randint(1, 8))) + "\n"
        r = self.timed("exec", self.sbx.exec,
                       ["sh", "-c", 'mkdir -p "$(dirname "$2")" && printf %s "$1" > "$2"',
                        "sh", content, f"{WORK}/{path}"], timeout=120)
        if r.exit_code != 0:
            raise RuntimeError(f"exec_write exited {r.exit_code}: {r.stderr[-300:]}")
        self.cur.files[path] = content

    def op_exec_append(self) -> None:
        line = f"{self.seq} {self.token(12)}"
        r = self.timed("exec", self.sbx.exec,
                       ["sh", "-c", f'printf "%s\\n" "$1" >> {WORK}/log.txt', "sh", line],
                       timeout=120)
        if r.exit_code != 0:
            raise RuntimeError(f"exec_append exited {r.exit_code}: {r.stderr[-300:]}")
        self.cur.files["log.txt"] = self.cur.files.get("log.txt", "") + line + "\n"

    def op_exec_python(self) -> None:
        path = f"py{self.rng.randrange(8)}.out"
        seed, reps = self.token(10), self.rng.randint(1, 50)
        r = self.timed("exec_python", self.sbx.exec,
                       ["python3", "-c", PY_WRITE, path, seed, str(reps)], timeout=120)
        if r.exit_code != 0:
            raise RuntimeError(f"exec_python exited {r.exit_code}: {r.stderr[-300:]}")
        self.cur.files[path] = hashlib.sha256(seed.encode()).hexdigest() * reps

    def op_exec_rm(self) -> None:
        if not self.cur.files:
            return self.op_exec_write()
        path = self.rng.choice(sorted(self.cur.files))
        r = self.timed("exec", self.sbx.exec, ["rm", "-f", f"{WORK}/{path}"], timeout=120)
        if r.exit_code != 0:
            raise RuntimeError(f"exec_rm exited {r.exit_code}: {r.stderr[-300:]}")
        del self.cur.files[path]

    def op_kv_set(self) -> None:
        if self.cur.kv is None:
            return self.op_session()
        k, v = f"k{self.rng.randrange(N_KEYS)}", self.token(8)
        r = self.session_run("kv_set", kv_request(f"set {k} {v}"))
        if r.exit_code != 0 or r.stdout.strip() != "ok":
            raise RuntimeError(f"kv set exited {r.exit_code}, printed {r.stdout[-100:]!r}: "
                               f"{r.stderr[-300:]}")
        self.cur.kv[k] = v

    def op_session_job(self) -> None:
        """A background job of the session that ends by itself a few ms later (its end,
        and its zombie until the shell reaps it, may fall in a checkpoint)."""
        ms = self.rng.randrange(1, 30)
        code = self.rng.choice((0, 3))
        r = self.session_run("session", f"(sleep 0.{ms:03d}; exit {code}) &")
        if r.exit_code != 0:
            raise RuntimeError(f"session_job exited {r.exit_code}: {r.stderr[-300:]}")
        self.rec.count("session_jobs")

    def op_exec_timeout(self) -> None:
        """A command (with a child) killed at its timeout: nothing of the model changes."""
        try:
            self.timed("exec_timeout", self.sbx.exec, ["sh", "-c", "sleep 5 & sleep 5"],
                       timeout=0.1)
        except DeadlineExceeded:
            self.rec.count("exec_timeouts")
            return
        raise RuntimeError("exec of sleep 5 with a 0.1 s timeout did not time out")

    def op_session_timeout(self) -> None:
        """A session command past its timeout: the daemon restarts the session (its
        variables, function, cwd and jobs, the server among them, are gone)."""
        try:
            self.timed("session_timeout", self.sbx.session("main").run, "sleep 5",
                       timeout=0.1)
        except DeadlineExceeded:
            self.rec.count("session_timeouts")
            self.adopt_session(self.sbx, self.cur)
            return
        raise RuntimeError("session sleep 5 with a 0.1 s timeout did not time out")

    def op_session(self) -> None:
        parts = []
        new = self.cur.copy()
        for _ in range(self.rng.randint(1, 3)):
            kind = self.rng.randrange(5)
            if kind == 0:
                v = self.token(6)
                parts.append(f"S0={v}")
                new.vars["S0"] = v
            elif kind == 1:
                k = self.rng.randint(1, 99)
                parts.append(f"S1=$(( ${{S1:-0}} + {k} ))")
                base = new.vars.get("S1", "0")
                new.vars["S1"] = str(int(base if base.lstrip("-").isdigit() else 0) + k)
            elif kind == 2:
                v = self.token(6)
                parts.append(f"export S2={v}")
                new.vars["S2"] = v
            elif kind == 3:
                v = self.token(6)
                parts.append(f"soakfn() {{ echo {v}; }}")
                new.fn = v
            else:
                d = self.rng.choice(CWDS)
                parts.append(f"cd {d}")
                new.cwd = d
        self.said = " " + "; ".join(parts)
        r = self.session_run("session", "\n".join(parts))
        if r.exit_code != 0:
            raise RuntimeError(f"session exited {r.exit_code}: {r.stderr[-300:]}")
        self.cur = new

    def op_checkpoint(self) -> None:
        x = self.rng.random()
        mode = "auto" if x < 0.8 else "full" if x < 0.9 else "fs"
        cp = self.timed(f"checkpoint_{mode}", self.sbx.checkpoint, mode=mode)
        self.said = f" {mode}: {cp.id} {cp.kind}"
        self.rec.count(f"checkpoint_{mode}_kind_{cp.kind}")
        self.cps[cp.id] = self.cur.copy()
        self.cp_order.append(cp.id)

    def op_rollback(self) -> None:
        cp = self.rng.choice(self.cp_order)
        r = self.timed("rollback", self.sbx.rollback, cp)
        self.said = (f" {cp}: {r.process_state} restarted={list(r.sessions_restarted)} "
                     f"note={r.note[:120]!r}")
        self.restore_note = r.note
        model = self.cps[cp]
        restored = r.process_state == "restored" and "main" not in r.sessions_restarted
        self.rec.count(f"rollback_process_state_{r.process_state or 'none'}")
        if r.process_state == "restored" and "main" in r.sessions_restarted:
            self.rec.count("rollback_restored_but_session_restarted")
        self.cur = model.copy()
        pid = self.check(self.sbx, model, "rollback", cp, restored, "after rollback")
        if restored and pid is not None:
            # The server runs on as `pid` now (a change is named in the note): the next
            # checkpoint's model must expect that one, not the pid it had before.
            self.cur.kv_pid = pid
        if r.process_state != "restored":
            self.rec.restarted("rollback", r.note)
        if not restored:
            self.rec.count("session_restarted")
            self.adopt_session(self.sbx, self.cur)

    def op_fork(self) -> None:
        cp = self.rng.choice(self.cp_order)
        n = self.rng.randint(1, 2)
        self.said = f" {cp} x{n}"
        kids = self.timed("fork", self.sbx.fork, cp, count=n)
        self.rec.count("fork_children", len(kids))
        model = self.cps[cp]
        try:
            for k in kids:
                restored = k.process_state == "restored"
                self.restore_note = k.fork_note
                self.rec.count(f"fork_process_state_{k.process_state or 'none'}")
                if not restored:
                    self.rec.count("session_restarted_in_fork")
                    self.rec.restarted("fork", k.fork_note)
                self.check(k, model, "fork", cp, restored, f"in fork child {k.id}")
        finally:
            for k in kids:
                try:
                    self.timed("remove_child", k.kill)
                except Exception as e:  # noqa: BLE001
                    self.rec.error(self.sbx.id, "remove_child", e)

    def op_delete(self) -> None:
        if len(self.cp_order) <= 3:
            return self.op_checkpoint()
        old = self.cp_order[: len(self.cp_order) // 2]
        cp = self.rng.choice(old[: max(1, len(self.cp_order) - 2)])
        self.timed("delete_checkpoint", self.sbx.delete_checkpoint, cp)
        self.cp_order.remove(cp)
        del self.cps[cp]

    # -- main loop --
    def run(self) -> None:
        from deltabox import Sandbox

        try:
            self.sbx = self.timed("create", Sandbox.create, socket=self.socket)
            self.name = self.sbx.id
            self.timed("exec", self.sbx.exec, ["mkdir", "-p", WORK], timeout=120)
            self.timed("session", self.sbx.session("main").run, "cd /workspace", timeout=120)
            if self.processes:
                self.sbx.files.write("/workspace/kv.py", KV_SERVER)
                self.sbx.files.write("/workspace/pinger.py", PINGER)
                self.start_kv(self.cur)
            self.op_checkpoint()
        except Exception as e:  # noqa: BLE001
            self.rec.error(self.name, "setup", e)
            if self.sbx is not None:
                self.sbx.kill()
            return
        ops, weights = list(OPS), list(OPS.values())
        if self.processes:
            ops += list(PROCESS_OPS)
            weights += list(PROCESS_OPS.values())
        try:
            for i in range(self.cycles):
                if self.stop_event.is_set() or (self.stop_at and time.monotonic() > self.stop_at):
                    self.rec.count("workers_stopped_early")
                    break
                self.seq = i
                op = self.rng.choices(ops, weights)[0]
                self.last_op = op
                self.said = ""
                t = time.monotonic() - self.rec.t0
                try:
                    getattr(self, f"op_{op}")()
                except Exception as e:  # noqa: BLE001
                    self.said += f" ERROR {type(e).__name__}"
                    self.rec.error(self.sbx.id, op, e)
                    if op not in ("checkpoint", "delete"):
                        self.resync(op)
                finally:
                    self.history.append(f"{t:.2f} {op}{self.said}"[:300])
                self.done += 1
                self.rec.cycle_done()
        finally:
            try:
                self.timed("remove", self.sbx.kill)
            except Exception as e:  # noqa: BLE001
                self.rec.error(self.sbx.id, "remove", e)


# ---- the run ---------------------------------------------------------------------------------

def summarize(rec: Recorder, rss: list[dict[str, float]], wall_s: float) -> dict[str, Any]:
    lat = {op: {k: v for k, v in stats(vals).items() if k in ("n", "p50", "p99", "max", "mean")}
           for op, vals in sorted(rec.lat.items())}
    out: dict[str, Any] = {
        "cycles_completed": rec.cycles,
        "cycles_per_s": rec.cycles / wall_s if wall_s else None,
        "verifications": dict(sorted(rec.verify.items())),
        "verifications_passed": sum(v for k, v in rec.verify.items() if k.endswith("_passed")),
        "verifications_failed": sum(v for k, v in rec.verify.items() if k.endswith("_failed")),
        "errors_by_status": dict(Counter(k.split(":", 1)[1] for k in rec.errors.elements())),
        "anomalies": len(rec.anomalies),
        "errors_by_op_and_status": dict(sorted(rec.errors.items())),
        "counts": dict(sorted(rec.counts.items())),
        "restart_reasons": dict(rec.restart_reasons.most_common()),
        "latency_ms": lat,
    }
    if rss:
        ts = [s["t"] for s in rss]
        half = ts[0] + (ts[-1] - ts[0]) / 2
        second = [(s["t"], s["rss_mb"]) for s in rss if s["t"] >= half]
        out["daemon_rss_mb"] = {
            "start": rss[0]["rss_mb"], "max": max(s["rss_mb"] for s in rss),
            "end": rss[-1]["rss_mb"], "samples": len(rss),
            "slope_second_half_mb_per_min": slope_per_min(second),
        }
        out["daemon_fds"] = {"start": rss[0]["fds"], "max": max(s["fds"] for s in rss),
                             "end": rss[-1]["fds"],
                             "slope_second_half_per_min": slope_per_min(
                                 [(s["t"], s["fds"]) for s in rss if s["t"] >= half])}
        out["daemon_threads"] = {"start": rss[0]["threads"],
                                 "max": max(s["threads"] for s in rss),
                                 "end": rss[-1]["threads"]}
    return out


def daemon_log(daemon: PrivateDaemon) -> str:
    """The daemon's log, or "" if there is none."""
    try:
        return daemon.log_path.read_text(errors="replace")
    except (OSError, AssertionError):
        return ""


def daemon_log_problems(text: str, limit: int = 300) -> list[str]:
    """The daemon log's ERROR / CRITICAL / Traceback lines, then its WARNING lines (the
    first `limit` in all: warnings can be many, dumps whose templates were released first
    mostly)."""
    lines = text.splitlines()
    worst = [ln for ln in lines if any(k in ln for k in (" ERROR ", " CRITICAL ", "Traceback",
                                                         "Error:"))]
    warned = [ln for ln in lines if " WARNING " in ln]
    return [ln[:1000] for ln in worst + warned][:limit]


# Daemon log lines counted for the report: how often a restore had to wait for a process
# dump (its templates evicted from a dump backlog) or took its templates back from one
# instead, how the dumps ended, how many restores
# from a dump failed (a complete dump must restore), and every ERROR line.
LOG_EVENTS = {
    "rollback_waits_for_dump": re.compile(r"waits for the process dump of"),
    "templates_taken_back": re.compile(r"taken back before their dump ended"),
    "dumps_complete": re.compile(r"process dump of \S+: \d+ processes"),
    "dumps_failed": re.compile(r"process dump of \S+ failed"),
    "dumps_failed_templates_released": re.compile(r"process dump of \S+ failed: .*released"),
    "dumps_not_needed": re.compile(r"process dump of \S+ not written: its checkpoint was "
                                   r"deleted"),
    "restores_from_dump_failed": re.compile(r"restoring from the dump of \S+ failed"),
    "errors": re.compile(r" ERROR "),
}


MEMORY_REPORT_EVERY_S = 120


def ask_memory_report(daemon: PrivateDaemon) -> None:
    """deltaboxd logs what its memory is made of on SIGUSR1 (daemon/memreport.py)."""
    try:
        os.kill(daemon.proc.pid, signal.SIGUSR1)
    except (OSError, AttributeError):
        pass


def memory_reports(text: str) -> list[dict[str, Any]]:
    """The daemon log's memory reports, in order, each with its log time."""
    out = []
    for m in re.finditer(r"^(\S+ \S+) deltaboxd INFO memory: (\{.*\})$", text, re.M):
        try:
            out.append({"at": m.group(1), **json.loads(m.group(2))})
        except ValueError:
            pass
    return out


def daemon_log_counts(text: str) -> dict[str, int]:
    """How many daemon log lines match each of LOG_EVENTS."""
    return {k: len(rx.findall(text)) for k, rx in LOG_EVENTS.items()}


def plot(result: dict[str, Any], machine: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(12, 9))
    rss = result["raw"]["rss"]
    if rss:
        ax1.plot([s["t"] for s in rss], [s["rss_mb"] for s in rss], color="#1f77b4",
                 label="deltaboxd RSS (MB)")
        ax1.set_ylabel("daemon RSS (MB)")
        ax1.set_xlabel("time since daemon start (s)")
        ax1.set_ylim(bottom=0)
        ax1.grid(alpha=0.25)
        axc = ax1.twinx()
        ct = result["raw"]["cycle_times"]
        axc.plot(ct, range(1, len(ct) + 1), color="#2ca02c", alpha=0.6,
                 label="cycles completed")
        axc.set_ylabel("cycles completed")
        axc.set_ylim(bottom=0)
        h1, l1 = ax1.get_legend_handles_labels()
        h2, l2 = axc.get_legend_handles_labels()
        ax1.legend(h1 + h2, l1 + l2, loc="lower right", fontsize=8)
    s = result["summary"]
    p = result["plan"]
    ax1.set_title(f"{p['sandboxes']} sandboxes x {p['cycles']} cycles: "
                  f"{s['cycles_completed']} cycles, verifications "
                  f"{s['verifications_passed']} passed / {s['verifications_failed']} failed",
                  fontsize=10, loc="left")
    order = [op for op in ("exec", "exec_python", "session", "checkpoint_auto",
                           "checkpoint_full", "checkpoint_fs", "rollback", "fork",
                           "remove_child", "delete_checkpoint", "verify_files",
                           "verify_session", "create", "remove")
             if result["raw"]["latency_ms"].get(op)]
    groups = {op: {"client-side latency": result["raw"]["latency_ms"][op]} for op in order}
    latency_boxplot(ax2, groups, title="latency per operation (p50 written above each box)")
    for lab in ax2.get_xticklabels():
        lab.set_rotation(25)
        lab.set_fontsize(8)
    finish_figure(fig, path, "DeltaBox soak", machine)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="8 sandboxes x 30 cycles (unless given), a few minutes")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"default {DEFAULT_OUT}")
    p.add_argument("--sandboxes", type=int, help="concurrent sandboxes (default 32, quick 8)")
    p.add_argument("--cycles", type=int, help="operations per sandbox (default 200, quick 30)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--time-limit", type=float, metavar="S",
                   help="stop starting new cycles after S seconds (the run is then reported "
                   "as stopped early)")
    p.add_argument("--processes", action="store_true",
                   help="also run a key-value server (python3, %d MB of memory) in each "
                   "sandbox's session and verify its in-memory dict after every rollback "
                   "and in every fork child; with ops that set its keys, start short "
                   "background jobs in the session, and time out an exec and a session "
                   "command" % BALLAST_MB)
    p.add_argument("--tmp-parent", type=Path, default=Path("/var/tmp"))
    p.add_argument("--keep-state", action="store_true")
    p.add_argument("--daemon-arg", action="append", default=[], metavar="ARG",
                   help="extra deltaboxd argument (repeatable), e.g. --daemon-arg=--templates=8")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        print("benchmarks.soak: run as root (it starts a private deltaboxd)", file=sys.stderr)
        return 1
    n_sbx = args.sandboxes or (8 if args.quick else 32)
    cycles = args.cycles or (30 if args.quick else 200)
    if n_sbx < 1 or cycles < 1:
        print("benchmarks.soak: --sandboxes and --cycles must be at least 1", file=sys.stderr)
        return 2
    others = other_daemons()
    if others:
        log(f"warning: {len(others)} other deltaboxd process(es) running")
    load_start = os.getloadavg()
    daemon = PrivateDaemon(parent=args.tmp_parent, keep=args.keep_state,
                           extra_args=args.daemon_arg)
    result: dict[str, Any] = {}
    machine: dict[str, Any] = {}
    stop_event = threading.Event()
    with terminate_as_exception():
        try:
            t0 = time.monotonic()
            daemon.start()
            assert daemon.proc is not None
            sampler = RssSampler(daemon.proc.pid, t0)
            sampler.start()
            machine = machine_info(daemon.socket)
            log(f"daemon up (pid {daemon.proc.pid}, store "
                f"{machine['deltabox'].get('store_backend')}); {n_sbx} sandboxes x {cycles} "
                f"cycles, seed {args.seed}")
            time.sleep(2)
            fds_before = sampler.fd_kinds()
            rec = Recorder(t0)
            stop_at = time.monotonic() + args.time_limit if args.time_limit else None
            workers = [Worker(i, daemon.socket, cycles, args.seed, rec, stop_at, stop_event,
                              args.processes)
                       for i in range(n_sbx)]
            threads = [threading.Thread(target=w.run, name=f"soak-{i}", daemon=True)
                       for i, w in enumerate(workers)]
            t_run = time.monotonic()
            for t in threads:
                t.start()
            try:
                last = 0.0
                last_report = time.monotonic()
                while any(t.is_alive() for t in threads):
                    time.sleep(1)
                    if time.monotonic() - last_report >= MEMORY_REPORT_EVERY_S:
                        last_report = time.monotonic()
                        ask_memory_report(daemon)
                    if time.monotonic() - last >= 30:
                        last = time.monotonic()
                        r = sampler.samples[-1] if sampler.samples else {}
                        log(f"{rec.cycles} cycles, verifications "
                            f"{sum(v for k, v in rec.verify.items() if k.endswith('passed'))} "
                            f"passed / {len(rec.failures)} failed, errors "
                            f"{sum(rec.errors.values())}, daemon RSS "
                            f"{r.get('rss_mb', 0):.0f} MB, fds {r.get('fds', 0)}")
            finally:
                stop_event.set()
                for t in threads:
                    t.join(120)
            wall = time.monotonic() - t_run
            fds_at_end_of_run = sampler.fd_kinds()
            time.sleep(10)   # samples after the last sandbox is gone (background work ends)
            ask_memory_report(daemon)   # what is left once every sandbox is gone
            time.sleep(1)
            sampler.stop()
            fds_after = sampler.fd_kinds()
            left = [s.id for s in __import__("deltabox").Sandbox.list(socket=daemon.socket)]
            machine["loadavg_start"] = load_start
            machine["loadavg_end"] = os.getloadavg()
            machine["other_deltaboxd_at_start"] = others
            summary = summarize(rec, sampler.samples, wall)
            summary["sandboxes_left_after_run"] = left
            summary["wall_s"] = wall
            summary["daemon_fd_kinds"] = {"before_sandboxes": fds_before,
                                          "end_of_run": fds_at_end_of_run,
                                          "10s_after_run": fds_after}
            result = {
                "benchmark": "soak",
                "mode": "quick" if args.quick else "full",
                "plan": {"sandboxes": n_sbx, "cycles": cycles, "seed": args.seed,
                         "processes": args.processes,
                         "process_op_weights": PROCESS_OPS if args.processes else {},
                         "time_limit_s": args.time_limit, "op_weights": OPS,
                         "daemon_args": args.daemon_arg},
                "method": {
                    "driver": "one thread per sandbox, SDK over the private daemon's unix "
                    "socket; each cycle is one random op (weights in plan.op_weights)",
                    "model": "per sandbox: contents of every file under /workspace/w and the "
                    "session 'main''s S0/S1/S2, function soakfn and cwd, now and at each "
                    "checkpoint; with --processes also the dict of a key-value server "
                    "(python3, a background job of the session, listening on loopback) and "
                    "its ballast's CRC-32, a function of the dict; its pid compared with the "
                    "checkpoint's (counted, not failed: kv_pid_kept, kv_pid_changed where the "
                    "restore's note says a pid changed, kv_pid_changed_unnamed where not)",
                    "verification": "after every rollback and in every fork child: sha256 "
                    "of each file under /workspace/w (python3 in the sandbox) == model; the "
                    "session's variables/function/cwd == model unless process_state is not "
                    "'restored' (then files only, counted as session_restarted, and the "
                    "session's actual state becomes the model)",
                    "latency": "client-side wall time around one SDK call",
                    "rss": "VmRSS of the deltaboxd process every second (plus open fds, "
                    "threads); slope by least squares over the second half of the run",
                    "leaks": "after SIGTERM of the daemon: mounts, loop devices, processes "
                    "naming its temp dir, its cgroup parent, dbx- helpers naming it "
                    "(benchmarks.common.own_leaks); leakcheck over the whole machine too",
                },
                "summary": summary,
                "failures": rec.failures,
                "anomalies": rec.anomalies,
                "error_samples": rec.error_samples,
                "raw": {"rss": sampler.samples, "cycle_times": rec.cycle_times,
                        "latency_ms": rec.lat,
                        "timeline": rec.timeline},
                "duration_s": time.monotonic() - t0,
            }
        finally:
            stop_event.set()
            if result:   # the daemon's warnings and errors, for the report
                text = daemon_log(daemon)
                result["daemon_log_problems"] = daemon_log_problems(text)
                result["summary"]["daemon_log_counts"] = daemon_log_counts(text)
                reports = memory_reports(text)
                result["raw"]["memory"] = reports
                if reports:
                    result["summary"]["daemon_memory"] = {
                        "reports": len(reports), "first": reports[0],
                        "last_during_run": reports[-2] if len(reports) > 1 else None,
                        "after_run": reports[-1]}
            daemon.stop()
    if not result:
        return 1
    record_cleanup(result, daemon)
    result["summary"]["leaks"] = daemon.leaks
    result["summary"]["cleanup_problems"] = daemon.cleanup_problems
    out = args.out
    json_path = write_json(out / "soak.json", result, machine)
    png_path = out / "soak.png"
    plot(result, machine, png_path)
    s = result["summary"]
    print(json.dumps({k: s[k] for k in ("cycles_completed", "verifications",
                                        "verifications_failed", "errors_by_status",
                                        "daemon_rss_mb", "daemon_fds", "daemon_fd_kinds", "leaks",
                                        "sandboxes_left_after_run", "wall_s") if k in s},
                     indent=1))
    print(f"wrote {json_path} and {png_path}")
    bad = s["verifications_failed"] or daemon.leaks or s.get("sandboxes_left_after_run")
    return 1 if bad else 0


if __name__ == "__main__":
    run_main(main)
