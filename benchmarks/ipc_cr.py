"""What System V message queues and semaphore sets, and POSIX message queues, add to a
checkpoint and a rollback (since stop 70 the System V ones, since stop 71 the POSIX ones
are captured with their messages and values, and made again by every restore:
deltabox/cr/sysv_msg.py, sysv_sem.py, posix_mq.py), against the same sandbox without
them, in the same run on one private daemon.

Two sandboxes, each running one python process that holds 20 MB: in `ipc`, the process
also made --queues message queues holding --messages messages of 1 KiB each, --sets
semaphore sets of 16, and --posix POSIX message queues holding min(--messages, 10)
messages of 1 KiB each (10: the namespace's default mq_maxmsg limit), which it keeps open;
in `plain` it made none. Each rep, for both in turn (the order rotates): the process
changes its memory and (ipc) takes a message from each queue, sends one back and changes
a semaphore of each set, pause (--think), `checkpoint()` is timed; the same change again,
pause, `rollback()` is timed, then the namespace's queues and sets (ids, keys, names,
messages, values) are compared with those at the checkpoint (untimed).

    .venv/bin/python -m benchmarks.ipc_cr [--reps 20] [--queues 8] [--messages 16]
        [--sets 8] [--posix 8] [--think 0.2] [--out DIR]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (DEFAULT_OUT, PrivateDaemon, log, machine_info, record_cleanup,
                               run_main, stats, terminate_as_exception, wait_until,
                               write_json)
from deltabox import Sandbox

WAYS = ("ipc", "plain")
# The workload: `python3 ipc.py QUEUES MESSAGES SETS POSIX` makes the objects, holds 20 MB
# and, each time /workspace/go appears, changes them (and its memory), then removes it.
# `python3 ipc.py report POSIX` prints a hash of the namespace's queues and sets with their
# content (a POSIX queue's messages taken and sent back in order).
IPC_PY = r"""
import ctypes, hashlib, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
IPC_CREAT, IPC_NOWAIT, MSG_COPY, GETALL, SETVAL = 0o1000, 0o4000, 0o40000, 13, 16
def send(q, t, text):
    b = ctypes.create_string_buffer(t.to_bytes(8, 'little') + text, 8 + len(text))
    assert libc.msgsnd(q, b, len(text), IPC_NOWAIT) == 0, ctypes.get_errno()
def receive(q, i, flags):
    b = ctypes.create_string_buffer(8 + 4096)
    n = libc.msgrcv(q, b, 4096, ctypes.c_long(i), flags)
    return None if n < 0 else b.raw[:8 + n]
class Attr(ctypes.Structure):
    _fields_ = [('flags', ctypes.c_long), ('maxmsg', ctypes.c_long),
                ('msgsize', ctypes.c_long), ('curmsgs', ctypes.c_long),
                ('pad', ctypes.c_long * 4)]
def mq(i, create=False):
    a = ctypes.byref(Attr(0, 10, 1024, 0)) if create else None
    q = libc.mq_open(b'/p%d' % i, os.O_RDWR | os.O_NONBLOCK | (os.O_CREAT if create else 0),
                     0o600, a)
    assert q >= 0, ctypes.get_errno()
    return q
def take(q):
    b, prio = ctypes.create_string_buffer(1024), ctypes.c_uint()
    n = libc.mq_receive(q, b, 1024, ctypes.byref(prio))
    return None if n < 0 else (prio.value, b.raw[:n])
def put(q, prio, text):
    assert libc.mq_send(q, text, len(text), prio) == 0, ctypes.get_errno()
if sys.argv[1] == 'report':
    h = hashlib.sha256()
    for line in sorted(open('/proc/sysvipc/msg').read().splitlines()[1:]):
        q = int(line.split()[1])
        h.update(line.split()[0].encode() + b' ' + line.split()[1].encode())
        i = 0
        while (m := receive(q, i, IPC_NOWAIT | MSG_COPY)) is not None:
            h.update(m)
            i += 1
    for line in sorted(open('/proc/sysvipc/sem').read().splitlines()[1:]):
        s, n = int(line.split()[1]), int(line.split()[3])
        values = (ctypes.c_ushort * n)()
        assert libc.semctl(s, 0, GETALL, values) == 0
        h.update(line.split()[1].encode() + bytes(values))
    for i in range(int(sys.argv[2])):
        q, got = mq(i), []
        while (m := take(q)) is not None:
            got.append(m)
        for prio, text in got:
            put(q, prio, text)
            h.update(b'%d:%d:' % (i, prio) + text)
    print(h.hexdigest())
    sys.exit()
nq, nm, ns, npq = map(int, sys.argv[1:5])
posix = [mq(i, create=True) for i in range(npq)]
for q in posix:
    for m in range(min(nm, 10)):
        put(q, m % 3, os.urandom(1024))
queues = [libc.msgget(0x1000 + i, IPC_CREAT | 0o600) for i in range(nq)]
sets = [libc.semget(0x2000 + i, 16, IPC_CREAT | 0o600) for i in range(ns)]
for q in queues:
    for m in range(nm):
        send(q, 1 + m % 3, os.urandom(1024))
memory = bytearray(os.urandom(20 << 20))
open('/workspace/ready', 'w').close()
n = 0
while True:
    if os.path.exists('/workspace/go'):
        n += 1
        memory[n * 4096 % len(memory)] = n % 256
        for q in queues:
            receive(q, 0, IPC_NOWAIT)
            send(q, 1 + n % 3, os.urandom(1024))
        for i, s in enumerate(sets):
            assert libc.semctl(s, n % 16, SETVAL, ctypes.c_int(n % 1000)) == 0
        for q in posix:
            take(q)
            put(q, n % 3, os.urandom(1024))
        os.unlink('/workspace/go')
    time.sleep(0.01)
"""


def change(box: Sandbox) -> None:
    """Ask the workload for a change and wait until it is made."""
    box.files.write("go", "")
    wait_until(lambda: not box.files.exists("go"), "the workload's change")


def report(box: Sandbox, posix: int) -> str:
    return box.exec(f"python3 /workspace/ipc.py report {posix}").stdout


def one_rep(box: Sandbox, way: str, think: float, posix: int) -> dict[str, Any]:
    change(box)
    time.sleep(think)
    t0 = time.perf_counter()
    cp = box.checkpoint()
    checkpoint_ms = (time.perf_counter() - t0) * 1000
    if cp.kind != "full":
        raise RuntimeError(f"{way}: a {cp.kind} checkpoint: {cp.reasons}")
    want = report(box, posix)
    change(box)
    time.sleep(think)
    t0 = time.perf_counter()
    rb = box.rollback(cp)
    rollback_ms = (time.perf_counter() - t0) * 1000
    if rb.process_state != "restored" or report(box, posix) != want:
        raise RuntimeError(f"{way}: the rollback did not bring the checkpoint back "
                           f"({rb.process_state}: {rb.note})")
    return {"way": way, "checkpoint_ms": checkpoint_ms, "checkpoint_daemon_ms": cp.duration_ms,
            "rollback_ms": rollback_ms, "rollback_daemon_ms": rb.duration_ms}


METRICS = ("checkpoint_ms", "checkpoint_daemon_ms", "rollback_ms", "rollback_daemon_ms")


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    s = {w: {m: stats([r[m] for r in runs if r["way"] == w]) for m in METRICS} for w in WAYS}
    return {**s, "ipc_over_plain_p50": {m: s["ipc"][m]["p50"] / s["plain"][m]["p50"]
                                        for m in METRICS}}


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ipc_cr", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--queues", type=int, default=8)
    p.add_argument("--messages", type=int, default=16, help="of 1 KiB, per queue")
    p.add_argument("--sets", type=int, default=8, help="semaphore sets of 16")
    p.add_argument("--posix", type=int, default=8, help="POSIX message queues, held open")
    p.add_argument("--think", type=float, default=0.2, help="pause before each call (s)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args()
    runs: list[dict[str, Any]] = []
    with terminate_as_exception(), PrivateDaemon() as d:
        boxes = {w: Sandbox.create(socket=d.socket) for w in WAYS}
        try:
            for way, box in boxes.items():
                box.files.write("ipc.py", IPC_PY)
                sizes = ((args.queues, args.messages, args.sets, args.posix) if way == "ipc"
                         else (0, 0, 0, 0))
                box.exec("nohup python3 /workspace/ipc.py %d %d %d %d >/dev/null 2>&1 &"
                         % sizes)
                wait_until(lambda: box.files.exists("ready"), "the workload")
            for rep in range(args.reps):
                k = rep % len(WAYS)
                for way in WAYS[k:] + WAYS[:k]:
                    runs.append({"rep": rep, **one_rep(boxes[way], way, args.think,
                                                       args.posix if way == "ipc" else 0)})
                log(f"rep {rep + 1}/{args.reps}")
        finally:
            for box in boxes.values():
                box.kill()
        result: dict[str, Any] = {
            "benchmark": "ipc_cr", "reps": args.reps, "queues": args.queues,
            "messages": args.messages, "message_bytes": 1024, "sets": args.sets,
            "semaphores_per_set": 16, "posix_queues": args.posix,
            "posix_messages": min(args.messages, 10), "think_s": args.think, "runs": runs,
            "summary": summarize(runs)}
        info = machine_info(d.socket)
    record_cleanup(result, d)
    path = write_json(args.out / "ipc_cr.json", result, info)
    s = result["summary"]
    for w in WAYS:
        print(f"{w:6s} " + "  ".join(f"{m.removesuffix('_ms')} {s[w][m]['p50']:6.2f}"
                                      for m in METRICS) + "  (ms, p50)")
    print("ipc / plain: " + ", ".join(f"{m.removesuffix('_ms')} {v:.2f}x"
                                      for m, v in s["ipc_over_plain_p50"].items()))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    run_main(main)
