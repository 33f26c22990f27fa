"""A PostgreSQL server in a sandbox: what its checkpoint, rollback and fork cost with its
processes (DeltaCR: its System V segment, its 148 MiB of shared buffers copied by written
page, its backends' fork of the postmaster), against the restart an agent sandbox without
process checkpoints falls back to: a file-only checkpoint, whose rollback or fork kills the
server and starts it again on the checkpoint's files (crash recovery: WAL replayed), in
the same run on one private daemon, each in a sandbox of its own. `--server mariadb`: the
same with a MariaDB server (InnoDB: its threads, its buffer pool in private memory, its
redo log replayed by a restart).

Each rep, for both ways in turn (the order rotates): a transaction inserts --rows rows,
pause (--think), `checkpoint()` is timed (full, or mode="fs"); once its background process
dump is written (untimed), more rows go in, pause, then timed: `rollback()` and the first
query answered after it ("back in service": for the restart, the rollback, `pg_ctl start`
and the query), which must count the rows of the checkpoint; then `fork()` of the same
checkpoint and the first query in the child. A query alone is timed too (the floor). Then a
fan-out: `fork(count=N)` of the last checkpoint for each N of --fanout, until every child
answers a query (for the restart, `pg_ctl start` in each child in turn). Also measured
once: the bytes the daemon holds for the server's shared memory at a checkpoint (its
copies' allocated blocks), against the mappings' size.

    .venv/bin/python -m benchmarks.postgres_cr [--server postgres|mariadb] [--reps 10]
        [--rows 1000] [--fanout 1,4,8] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (DEFAULT_OUT, PrivateDaemon, finish_figure, latency_boxplot, log,
                               machine_info, pyplot, record_cleanup, run_main, stats,
                               terminate_as_exception, wait_until, write_json)
from deltabox import Sandbox

WAYS = ("deltabox", "restart")
# The server as its own user, its socket in /workspace/pg, no TCP port. `pg.sh start`
# (initdb the first time), `pg.sh sql "QUERY"` prints the rows, `pg.sh stop`.
PG_SH = """
set -e
bin=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)
as_pg() { setpriv --reuid postgres --regid postgres --clear-groups env HOME=/workspace/pg "$@"; }
case "$1" in
start)
  mkdir -p /workspace/pg && chown postgres: /workspace/pg
  [ -d /workspace/pg/data ] || as_pg "$bin/initdb" -D /workspace/pg/data -A trust -N >/dev/null
  as_pg "$bin/pg_ctl" -D /workspace/pg/data -w -l /workspace/pg/log \\
    -o "-k /workspace/pg -c listen_addresses=''" start >/dev/null ;;
sql) as_pg psql -h /workspace/pg -d postgres -tAc "$2" ;;
stop) as_pg "$bin/pg_ctl" -D /workspace/pg/data -w -m fast stop >/dev/null ;;
esac
"""
# The same for a MariaDB server: its data directory, socket and log in /workspace/my, a
# loopback port, queries in database d (made at the first start).
MARIADB_SH = """
set -e
my=/workspace/my
case "$1" in
start)
  mkdir -p $my
  [ -d $my/data ] || mariadb-install-db --datadir=$my/data --user=root \\
    --auth-root-authentication-method=normal >$my/install.log 2>&1
  (cd /workspace; nohup mariadbd --datadir=$my/data --user=root --socket=$my/sock \\
    --port=3307 --bind-address=127.0.0.1 --pid-file=$my/pid --log-error=$my/err.log \\
    >/dev/null 2>&1 &)
  for i in $(seq 300); do
    mariadb -S $my/sock -uroot -e 'create database if not exists d' >/dev/null 2>&1 && exit 0
    sleep 0.1
  done
  exit 1 ;;
sql) mariadb -S $my/sock -uroot -D d -N -B -e "$2" ;;
stop) mariadb-admin -S $my/sock -uroot shutdown ;;
esac
"""
SCRIPTS = {"postgres": PG_SH, "mariadb": MARIADB_SH}
# A transaction of `rows` rows
FILL = {"postgres": "insert into t select g from generate_series(1, {rows}) g",
        "mariadb": "insert into t select seq from seq_1_to_{rows}"}
TITLE = {"postgres": "PostgreSQL", "mariadb": "MariaDB"}


def pg(box: Sandbox, *args: str) -> str:
    """The sandbox's server script (db.sh: start, sql QUERY, stop)."""
    r = box.exec(["bash", "/workspace/db.sh", *args], timeout=120)
    if r.exit_code != 0:
        log_tail = box.exec("tail -20 /workspace/my/err.log /workspace/pg/log 2>/dev/null; "
                            "ps -eo pid,stat,args").stdout
        raise RuntimeError(f"{box.id}: db.sh {' '.join(args)} exited {r.exit_code}: "
                           f"{r.stderr[-400:]}\n{log_tail}")
    return r.stdout


def count(box: Sandbox) -> int:
    return int(pg(box, "sql", "select count(*) from t"))


def held_copies(daemon_pid: int) -> int:
    """Bytes allocated to the daemon's copies of shared memory (memfds dbx-unlinked,
    dbx-sysv, dbx-shm: sparse, so their blocks, not their sizes)."""
    total = 0
    for fd in os.listdir(f"/proc/{daemon_pid}/fd"):
        try:
            if os.readlink(f"/proc/{daemon_pid}/fd/{fd}").startswith(
                    ("/memfd:dbx-unlinked", "/memfd:dbx-sysv", "/memfd:dbx-shm")):
                total += os.stat(f"/proc/{daemon_pid}/fd/{fd}").st_blocks * 512
        except OSError:
            pass
    return total


def shared_mapped(box: Sandbox) -> int:
    """Bytes of shared memory the server maps (anonymous, System V, /dev/shm)."""
    out = box.exec("grep -E ' rw.s .*(/dev/zero|/SYSV|/dev/shm)' /proc/$(head -1 "
                   "/workspace/pg/data/postmaster.pid 2>/dev/null || cat /workspace/my/pid)"
                   "/maps").stdout
    return sum(int(e, 16) - int(s, 16) for s, e in
               (line.split()[0].split("-") for line in out.splitlines()))


def dump_done(box: Sandbox, cp_id: str) -> None:
    def done() -> bool:
        cp = next(c for c in box.checkpoints() if c.id == cp_id)
        return not any(r.startswith("process dump:") and "pending" in r for r in cp.reasons)
    wait_until(done, "the process dump")


def one_rep(box: Sandbox, way: str, insert: str, think: float) -> dict[str, Any]:
    pg(box, "sql", insert)
    time.sleep(think)
    t0 = time.perf_counter()
    cp = box.checkpoint(mode="full" if way == "deltabox" else "fs")
    checkpoint_ms = (time.perf_counter() - t0) * 1000
    dump_done(box, cp.id)
    want = count(box)
    pg(box, "sql", insert)
    time.sleep(think)
    t0 = time.perf_counter()
    rb = box.rollback(cp)
    rollback_ms = (time.perf_counter() - t0) * 1000
    if way == "restart":
        pg(box, "start")
    got = count(box)
    service_ms = (time.perf_counter() - t0) * 1000
    if got != want or (way == "deltabox") != (rb.process_state == "restored"):
        raise RuntimeError(f"{way}: {got} rows after the rollback, {want} at the checkpoint "
                           f"({rb.process_state}: {rb.note})")
    time.sleep(think)
    t0 = time.perf_counter()
    kid = box.fork(cp)[0]
    try:
        fork_ms = (time.perf_counter() - t0) * 1000
        if way == "restart":
            pg(kid, "start")
        if count(kid) != want:
            raise RuntimeError(f"{way}: the fork's rows differ from the checkpoint's")
        fork_service_ms = (time.perf_counter() - t0) * 1000
    finally:
        kid.kill()
    time.sleep(think)
    t0 = time.perf_counter()
    count(box)
    query_ms = (time.perf_counter() - t0) * 1000
    return {"way": way, "checkpoint_ms": checkpoint_ms, "checkpoint_daemon_ms": cp.duration_ms,
            "rollback_ms": rollback_ms, "rollback_daemon_ms": rb.duration_ms,
            "service_ms": service_ms, "fork_ms": fork_ms, "fork_service_ms": fork_service_ms,
            "query_ms": query_ms}


def fanout(box: Sandbox, way: str, n: int) -> dict[str, Any]:
    """fork(count=n) of box's newest checkpoint, until every child answers a query."""
    cp = box.checkpoints()[-1]
    t0 = time.perf_counter()
    kids = box.fork(cp, count=n)
    try:
        fork_ms = (time.perf_counter() - t0) * 1000
        for kid in kids:
            if way == "restart":
                pg(kid, "start")
            count(kid)
        return {"way": way, "n": n, "fork_ms": fork_ms,
                "serving_ms": (time.perf_counter() - t0) * 1000}
    finally:
        for kid in kids:
            kid.kill()


METRICS = ("checkpoint_ms", "rollback_ms", "service_ms", "fork_service_ms", "query_ms")


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    s = {w: {m: stats([r[m] for r in runs if r["way"] == w])
             for m in (*METRICS, "checkpoint_daemon_ms", "rollback_daemon_ms", "fork_ms")}
         for w in WAYS}
    return {**s, "restart_over_deltabox_p50": {
        m: s["restart"][m]["p50"] / s["deltabox"][m]["p50"]
        for m in ("service_ms", "fork_service_ms")}}


def plot(runs: list[dict[str, Any]], path: Path, machine: dict[str, Any],
         title: str = "PostgreSQL") -> Path | None:
    try:
        plt = pyplot()
    except ImportError:
        return None
    groups = {m.removesuffix("_ms"): {w: [r[m] for r in runs if r["way"] == w] for w in WAYS}
              for m in METRICS}
    fig, ax = plt.subplots(figsize=(11, 4.5))
    latency_boxplot(ax, groups)
    finish_figure(fig, path, f"{title}: checkpoint, rollback, fork (DeltaCR vs restart)",
                  machine)
    return path


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.postgres_cr", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--server", choices=sorted(SCRIPTS), default="postgres")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--rows", type=int, default=1000, help="rows inserted per change")
    p.add_argument("--think", type=float, default=0.2, help="pause before each call (s)")
    p.add_argument("--fanout", default="1,4,8", help="children per fan-out fork")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args()
    runs: list[dict[str, Any]] = []
    with terminate_as_exception(), PrivateDaemon() as d:
        boxes = {w: Sandbox.create(socket=d.socket, memory_mb=2048) for w in WAYS}
        try:
            for box in boxes.values():
                box.files.write("db.sh", SCRIPTS[args.server])
                pg(box, "start")
                pg(box, "sql", "create table t (x int)")
            assert d.proc is not None
            before = held_copies(d.proc.pid)
            cp = boxes["deltabox"].checkpoint()
            copies = {"held_bytes": held_copies(d.proc.pid) - before,
                      "mapped_bytes": shared_mapped(boxes["deltabox"]), "checkpoint": cp.id}
            for rep in range(args.reps):
                k = rep % len(WAYS)
                for way in WAYS[k:] + WAYS[:k]:
                    runs.append({"rep": rep, **one_rep(
                        boxes[way], way, FILL[args.server].format(rows=args.rows),
                        args.think)})
                log(f"rep {rep + 1}/{args.reps}")
            fans = [fanout(boxes[w], w, int(n)) for n in args.fanout.split(",") if n
                    for w in WAYS]
        finally:
            for box in boxes.values():
                box.kill()
        result: dict[str, Any] = {"benchmark": "postgres_cr", "server": args.server,
                                  "reps": args.reps,
                                  "rows": args.rows, "think_s": args.think, "runs": runs,
                                  "shared_memory": copies, "fanout": fans,
                                  "summary": summarize(runs)}
        info = machine_info(d.socket)
    record_cleanup(result, d)
    name = "postgres_cr" if args.server == "postgres" else f"{args.server}_cr"
    path = write_json(args.out / f"{name}.json", result, info)
    png = plot(runs, args.out / f"{name}.png", info, TITLE[args.server])
    s = result["summary"]
    for w in WAYS:
        print(f"{w:9s} " + "  ".join(f"{m.removesuffix('_ms')} {s[w][m]['p50']:7.1f}"
                                      for m in METRICS) + "  (ms, p50)")
    r = s["restart_over_deltabox_p50"]
    print(f"back in service: restart / deltabox {r['service_ms']:.1f}x after a rollback, "
          f"{r['fork_service_ms']:.1f}x in a fork; shared memory held per checkpoint "
          f"{copies['held_bytes'] / 2**20:.1f} MiB of {copies['mapped_bytes'] / 2**20:.1f} "
          "MiB mapped")
    for f in fans:
        print(f"fan-out {f['n']:2d} {f['way']:9s} fork {f['fork_ms']:7.1f} ms, all serving "
              f"{f['serving_ms']:7.1f} ms")
    print(f"wrote {path}" + (f" and {png}" if png else ""))
    return 0


if __name__ == "__main__":
    run_main(main)
