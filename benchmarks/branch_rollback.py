"""RL branching: fork children from a checkpoint, let each explore, roll each back to the
fork point, read the tree again. A child forked with `shared_layer=True` against one forked
by default (a clone of the checkpoint's layer each), in the same run on one private daemon.

The source sandbox holds --files files of 8 KiB (a repository the agent reads); it is
checkpointed (`fs`) and forked twice, once each way. Each rep, for both children in turn
(the order alternates): the child changes one file (its exploration), pauses (--think: the
warm pool prepares meanwhile, as it would while the model thinks), then is timed,
client-side:

- rollback: `child.rollback(fork_point)`;
- read: `cat` of every file right after it (one exec): what a rollback leaves warm or cold.

A shared-layer child goes back onto a new empty layer over the checkpoint's, so its reads
hit the page cache the source and its siblings share; a default child goes back onto a new
clone, whose files are new inodes, read from the store again. Reported: p50/p90 of both,
per way, and their ratios. JSON and a PNG to --out (default benchmarks/out).

    .venv/bin/python -m benchmarks.branch_rollback [--reps 12] [--files 3000] [--out DIR]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (DEFAULT_OUT, PrivateDaemon, finish_figure, latency_boxplot, log,
                               machine_info, pyplot, record_cleanup, run_main, stats,
                               terminate_as_exception, write_json)
from deltabox import Sandbox

WAYS = ("shared_layer", "clone")
TREE = "/workspace/t"
MAKE_TREE = """
import os, sys
n = int(sys.argv[1])
for i in range(n):
    d = f"{sys.argv[2]}/{i % 30}"
    os.makedirs(d, exist_ok=True)
    with open(f"{d}/f{i}", "wb") as f:
        f.write(os.urandom(8192))
"""


def one_rep(kid: Sandbox, cp: Any, files: int, think: float) -> tuple[float, float]:
    """(rollback ms, read-after ms) for one exploration and return of `kid`."""
    kid.exec(["bash", "-c", f"echo explored >> {TREE}/0/f0"])
    time.sleep(think)
    t0 = time.perf_counter()
    kid.rollback(cp)
    rb = (time.perf_counter() - t0) * 1000
    time.sleep(0.05)
    t0 = time.perf_counter()
    r = kid.exec(["bash", "-c", f"cat {TREE}/*/* | wc -c"], timeout=120)
    rd = (time.perf_counter() - t0) * 1000
    if r.exit_code != 0 or r.stdout.strip() != str(files * 8192):
        raise RuntimeError(f"reading the tree after the rollback: {r.stdout!r} {r.stderr!r}")
    return rb, rd


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    s = {w: {op: stats([r[op] for r in runs if r["way"] == w]) for op in ("rollback", "read")}
         for w in WAYS}
    return {**s, "shared_over_clone_p50": {
        op: s["shared_layer"][op]["p50"] / s["clone"][op]["p50"] for op in ("rollback", "read")}}


def plot(runs: list[dict[str, Any]], path: Path, machine: dict[str, Any]) -> Path | None:
    try:
        plt = pyplot()
    except ImportError:
        return None
    groups = {op: {w: [r[op] for r in runs if r["way"] == w] for w in WAYS}
              for op in ("rollback", "read")}
    fig, ax = plt.subplots(figsize=(10, 4.5))
    latency_boxplot(ax, groups, log_scale=True)
    finish_figure(fig, path, "a forked child rolled back to the fork point, then reading "
                  "the tree", machine)
    return path


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.branch_rollback", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=12)
    p.add_argument("--files", type=int, default=3000, help="files of 8 KiB in the tree")
    p.add_argument("--think", type=float, default=0.3, help="pause before each rollback (s)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--daemon-arg", action="append", default=[], metavar="ARG",
                   help="extra deltaboxd argument (repeatable), for an A/B of a daemon "
                   "setting, e.g. --daemon-arg=--prewarm-mb=0")
    args = p.parse_args()
    runs: list[dict[str, Any]] = []
    with terminate_as_exception(), PrivateDaemon(extra_args=args.daemon_arg) as d:
        src = Sandbox.create(socket=d.socket)
        kids: dict[str, Sandbox] = {}
        try:
            r = src.exec(["python3", "-c", MAKE_TREE, str(args.files), TREE], timeout=300)
            if r.exit_code != 0:
                raise RuntimeError(f"making the tree: {r.stderr[-300:]}")
            cp = src.checkpoint(mode="fs", label="fork point")
            kids["shared_layer"] = src.fork(cp, shared_layer=True)[0]
            kids["clone"] = src.fork(cp)[0]
            for way in WAYS:  # warm-up: the first generation of each child
                one_rep(kids[way], cp, args.files, args.think)
            for rep in range(args.reps):
                for way in (WAYS if rep % 2 == 0 else WAYS[::-1]):
                    rb, rd = one_rep(kids[way], cp, args.files, args.think)
                    runs.append({"way": way, "rep": rep, "rollback": rb, "read": rd})
                if rep % 4 == 3:
                    log(f"rep {rep + 1}/{args.reps}")
        finally:
            for k in kids.values():
                k.kill()
            src.kill()
        result: dict[str, Any] = {"benchmark": "branch_rollback", "reps": args.reps,
                                  "files": args.files, "think_s": args.think,
                                  "daemon_args": args.daemon_arg, "runs": runs,
                                  "summary": summarize(runs)}
        info = machine_info(d.socket)
    record_cleanup(result, d)
    path = write_json(args.out / "branch_rollback.json", result, info)
    png = plot(runs, args.out / "branch_rollback.png", info)
    s = result["summary"]
    for w in WAYS:
        print(f"{w:13s} rollback p50 {s[w]['rollback']['p50']:6.2f} ms  p90 "
              f"{s[w]['rollback']['p90']:6.2f} | read {args.files} files after it p50 "
              f"{s[w]['read']['p50']:7.1f} ms  p90 {s[w]['read']['p90']:7.1f}")
    r = s["shared_over_clone_p50"]
    print(f"shared_layer / clone (p50): rollback {r['rollback']:.2f}x, read {r['read']:.2f}x")
    print(f"wrote {path}" + (f" and {png}" if png else ""))
    return 0


if __name__ == "__main__":
    run_main(main)
