"""Checkpoints late in a long session against early ones, and against btrfs alone doing the
file-state part of the same cycles, measured in the same run.

    .venv/bin/python -m benchmarks.long_session [--cycles 60] [--loop-io direct] [--out DIR]

DeltaBox: one sandbox with the process_cr "full" scenario (a bash session, a python3 process
holding 200 MB, a 10,000-file tree), then CYCLES times: the process dirties some memory and
its command files change, `checkpoint()` (timed client-side; the daemon's own time from the
response), it dirties more, `rollback()` to that checkpoint. Every checkpoint is kept, as a
tree search keeps its nodes. WARMUP cycles run first, uncounted, in both.

Floor: on a scratch loop store made like the daemon's (deltabox.fs.store.open_store, same
mount options), the same 10,000-file tree in a layer, then CYCLES times: two files written,
a read-only snapshot of the live layer (the checkpoint), a writable snapshot of it (the
rollback's new live layer), the old live layer deleted. Timed: the read-only snapshot.

Then (--old-rollbacks N) N rollbacks to random checkpoints older than the daemon keeps
process templates for (restored from their process dumps), each followed by a checkpoint
there (as a tree search expands the node it went back to) and by a rollback to the newest
checkpoint of the cycles, the baseline of the same run.

Both: bytes the store's loop device wrote per cycle (/sys/block/loopN/stat). Per decile of
cycles: p50s, and the ratio of the last decile to the first. Late checkpoints slow down as
a session holds more checkpoints because every snapshot adds back-references to the extent
tree that later commits rewrite (deltabox/daemon/warm.py, MAX_SPARES); the floor shows how
much of that is btrfs's own. Writes <out>/long_session.json and .png.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (DEFAULT_OUT, PrivateDaemon, finish_figure, log, machine_info,
                               pyplot, record_cleanup, run_main, terminate_as_exception,
                               write_json)
from benchmarks.process_cr import CTL, TREE, TREE_FILES, Workload, make_tree
from deltabox import Sandbox
from deltabox.fs.store import loop_device_of, close_store, open_store

SIZE_MB = 200
SETTLE_S = 0.05
# Cycles run first and not counted: the first checkpoint after the tree was made records 10k
# changed files, and the first few pay for cold caches.
WARMUP = 5
# The daemon keeps the process templates of this many checkpoints per sandbox (deltaboxd
# --templates, default 32); older ones are restored from their process dumps. Margin: 8.
TEMPLATE_WINDOW = 40
DUMPS_SETTLE_S = 3.0


def sectors_written(img: Path) -> int:
    """512-byte sectors the loop device backed by `img` has written since attached."""
    dev = loop_device_of(img)
    if dev is None:
        raise RuntimeError(f"no loop device for {img}: is the store a loop image?")
    return int(Path(f"/sys/block/{os.path.basename(dev)}/stat").read_text().split()[6])


def deltabox_cycles(d: PrivateDaemon, cycles: int, old_rollbacks: int
                    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The cycles; then rollbacks alternating between a random checkpoint older than the
    daemon keeps templates for (restored from its process dump) and the newest one."""
    img = d.state_dir / "store.img"
    sbx = Sandbox.create(socket=d.socket)
    try:
        wl = Workload(sbx, SIZE_MB, 1, SETTLE_S)
        wl.install()
        make_tree(sbx)
        wl.start()
        wl.settle()
        rows, cps = [], []
        for i in range(-WARMUP, cycles):
            w0 = sectors_written(img)
            wl.dirty(1, i % SIZE_MB, 1 + i % 90)
            wl.settle()
            t0 = time.perf_counter()
            cp = sbx.checkpoint()
            client = (time.perf_counter() - t0) * 1000
            wl.dirty(1, (i + 7) % SIZE_MB, 101 + i % 90)
            wl.settle()
            res = sbx.rollback(cp)
            if res.process_state != "restored":
                raise RuntimeError(f"cycle {i}: processes not restored: {res.note}")
            if i < 0:
                continue
            cps.append(cp)
            rows.append({"cycle": i, "checkpoint_client_ms": client,
                         "checkpoint_daemon_ms": cp.duration_ms, "kind": cp.kind,
                         "store_mb_written": (sectors_written(img) - w0) * 512 / 1e6})
            if i % 10 == 9:
                log(f"deltabox: cycle {i + 1}: checkpoint {client:.1f} ms client, "
                    f"{cp.duration_ms:.1f} daemon; {rows[-1]['store_mb_written']:.1f} MB written")
        return rows, old_node_rollbacks(sbx, wl, cps, old_rollbacks)
    finally:
        sbx.kill()


def old_node_rollbacks(sbx: Sandbox, wl: Workload, cps: list[Any], n: int
                          ) -> list[dict[str, Any]]:
    """n rollbacks to old checkpoints (beyond TEMPLATE_WINDOW from the newest), each followed
    by a checkpoint there (a tree search expands the node it went back to) and a rollback to
    the newest of the cycles, after a settle pause (the warm pool's time)."""
    old = cps[:max(0, len(cps) - TEMPLATE_WINDOW)]
    if not old or n <= 0:
        return []
    newest = cps[-1]
    time.sleep(DUMPS_SETTLE_S)  # the last checkpoints' process dumps complete
    rng = random.Random(1)
    out = []
    for j in range(n):
        for which, cp in (("old", rng.choice(old)), ("newest", newest)):
            wl.dirty(1, j, 3)
            wl.settle()
            time.sleep(0.3)
            t0 = time.perf_counter()
            res = sbx.rollback(cp)
            client = (time.perf_counter() - t0) * 1000
            if res.process_state != "restored":
                raise RuntimeError(f"rollback to {which} {cp.id}: not restored: {res.note}")
            out.append({"to": which, "client_ms": client, "daemon_ms": res.duration_ms,
                        "note": res.note})
            if which == "old":  # a tree search expands the node it went back to
                wl.dirty(1, j + 1, 5)
                wl.settle()
                cps.append(sbx.checkpoint())
    return out


def floor_cycles(parent: Path, cycles: int) -> list[dict[str, float]]:
    with tempfile.TemporaryDirectory(prefix="dbx-floor-", dir=parent) as tmp:
        store = open_store(Path(tmp), 16)
        if store.backend != "btrfs-loop":
            close_store(store)
            raise RuntimeError(f"the floor needs a loop btrfs store, got {store.backend}")
        img = Path(tmp) / "store.img"
        made: list[str] = []
        try:
            live = "L0"
            store.new_layer(live)
            made.append(live)
            upper = store.layer_path(live) / "upper"
            per_dir = TREE_FILES // 100
            for n in range(100):
                dd = upper / TREE.lstrip("/") / f"d{n:02d}"
                dd.mkdir(parents=True)
                for f in range(per_dir):
                    (dd / f"f{f:02d}.txt").write_text(f"file {n:02d}/{f:02d}\n")
            (upper / CTL.lstrip("/")).mkdir(parents=True)
            os.sync()
            rows = []
            for i in range(-WARMUP, cycles):
                w0 = sectors_written(img)
                for name in ("cmd-0", "res-0"):
                    (store.layer_path(live) / "upper" / CTL.lstrip("/") / name).write_text(
                        f"{i}\n")
                cp, nxt = f"C{i}", f"L{i}-next"
                t0 = time.perf_counter()
                store.freeze(live, cp)
                snap = (time.perf_counter() - t0) * 1000
                made.append(cp)
                store.clone(cp, nxt)
                made.append(nxt)
                store.delete(live)
                made.remove(live)
                live = nxt
                if i >= 0:
                    rows.append({"cycle": i, "snapshot_ms": snap,
                                 "store_mb_written": (sectors_written(img) - w0) * 512 / 1e6})
            return rows
        finally:
            for layer in reversed(made):
                store.delete(layer)
            close_store(store)


def deciles(rows: list[dict[str, Any]], key: str) -> list[float]:
    n = max(1, len(rows) // 10)
    return [statistics.median(r[key] for r in rows[i:i + n]) for i in range(0, len(rows), n)]


def summarize(dbx: list[dict[str, Any]], floor: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, rows, keys in (("deltabox", dbx, ("checkpoint_client_ms", "checkpoint_daemon_ms",
                                                "store_mb_written")),
                             ("floor", floor, ("snapshot_ms", "store_mb_written"))):
        out[name] = {}
        for k in keys:
            dec = deciles(rows, k)
            out[name][k] = {"p50_per_decile": dec, "last_over_first": dec[-1] / dec[0]}
    return out


def summarize_rollbacks(rbs: list[dict[str, Any]]) -> dict[str, Any]:
    """p50 of rollbacks to old checkpoints and to the newest, and their ratio."""
    out: dict[str, Any] = {}
    for to in ("old", "newest"):
        mine = [r for r in rbs if r["to"] == to]
        if mine:
            out[to] = {"n": len(mine), **{k: statistics.median(r[k] for r in mine)
                                          for k in ("client_ms", "daemon_ms")}}
    if len(out) == 2:
        out["old_over_newest_client"] = out["old"]["client_ms"] / out["newest"]["client_ms"]
    return out


def plot(dbx: list[dict[str, Any]], floor: list[dict[str, Any]], path: Path,
         machine: dict[str, Any]) -> Path | None:
    try:
        plt = pyplot()
    except ImportError:
        return None
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    a.plot([r["cycle"] for r in dbx], [r["checkpoint_daemon_ms"] for r in dbx], ".-",
           label="DeltaBox checkpoint (daemon)")
    a.plot([r["cycle"] for r in dbx], [r["checkpoint_client_ms"] for r in dbx], ".-",
           alpha=0.5, label="DeltaBox checkpoint (client)")
    a.plot([r["cycle"] for r in floor], [r["snapshot_ms"] for r in floor], ".-",
           label="btrfs alone: read-only snapshot")
    a.set_xlabel("cycle (checkpoints held)")
    a.set_ylabel("ms")
    a.legend(fontsize=7)
    b.plot([r["cycle"] for r in dbx], [r["store_mb_written"] for r in dbx], ".-",
           label="DeltaBox")
    b.plot([r["cycle"] for r in floor], [r["store_mb_written"] for r in floor], ".-",
           label="btrfs alone")
    b.set_xlabel("cycle")
    b.set_ylabel("MB written to the store per cycle")
    b.legend(fontsize=7)
    finish_figure(fig, path, "a long session: checkpoint + rollback cycles, every checkpoint "
                  "kept", machine)
    return path


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.long_session", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cycles", type=int, default=60)
    p.add_argument("--old-rollbacks", type=int, default=8, metavar="N",
                   help="afterwards, N rollbacks to random checkpoints older than the "
                   f"newest {TEMPLATE_WINDOW} (restored from process dumps), each followed by "
                   "one to the newest (0: none)")
    p.add_argument("--loop-io", choices=("buffered", "direct"), default="buffered",
                   help="the daemon's embedded store I/O mode (deltaboxd --loop-io); the "
                   "floor's store stays buffered")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args()
    if args.cycles < 10:
        p.error("--cycles must be at least 10 (figures are per decile)")
    with terminate_as_exception(), \
            PrivateDaemon(extra_args=["--loop-io", args.loop_io]) as d:
        log(f"DeltaBox: {args.cycles} checkpoint + rollback cycles")
        dbx, rbs = deltabox_cycles(d, args.cycles, args.old_rollbacks)
        log(f"floor: {args.cycles} cycles of btrfs alone")
        floor = floor_cycles(d.state_dir.parent, args.cycles)
        info = machine_info(d.socket)
    result: dict[str, Any] = {"benchmark": "long_session", "cycles": args.cycles,
                              "loop_io": args.loop_io,
                              "deltabox": dbx, "floor": floor, "rollbacks": rbs,
                              "summary": summarize(dbx, floor),
                              "rollbacks_summary": summarize_rollbacks(rbs)}
    record_cleanup(result, d)
    path = write_json(args.out / "long_session.json", result, info)
    png = plot(dbx, floor, args.out / "long_session.png", info)
    for name, keys in result["summary"].items():
        for k, s in keys.items():
            print(f"{name:8s} {k:22s} p50 per decile: " +
                  " ".join(f"{v:6.1f}" for v in s["p50_per_decile"]) +
                  f"   last/first {s['last_over_first']:.2f}x")
    rs = result["rollbacks_summary"]
    if "old_over_newest_client" in rs:
        print(f"rollback to an old checkpoint (from its dump) p50 {rs['old']['client_ms']:.1f} ms "
              f"client, {rs['old']['daemon_ms']:.1f} daemon; to the newest "
              f"{rs['newest']['client_ms']:.1f} / {rs['newest']['daemon_ms']:.1f}; "
              f"{rs['old_over_newest_client']:.1f}x")
    print(f"wrote {path}" + (f" and {png}" if png else ""))
    return 0


if __name__ == "__main__":
    run_main(main)
