"""What a user namespace costs a sandbox (`create --userns`), against the default (sandbox
root = host uid 0), measured in the same run on one private daemon.

Two sandboxes, one per mode, each with a bash session holding state and a background
process (so checkpoints are full: files and processes). Operations alternate between the
modes, rep by rep (the order flips every rep: these machines are noisy):

- create:      CreateSandbox + `true` (init, the idmapped overlay, the first exec);
- exec:        `true` through dbx-enter;
- files:       a 4 KiB write through the files API (as the sandbox's root with --userns);
- checkpoint:  mode="full" (process templates + the layer snapshot);
- rollback:    to that checkpoint (processes restored from templates);
- fork:        one child from that checkpoint (its init joins the family's user namespace).

Reported per operation: p50/p90 per mode and the ratio userns/default of the p50s, plus
the median of per-rep ratios. JSON (and a PNG) to --out (default benchmarks/out).

    .venv/bin/python -m benchmarks.userns [--reps 30] [--out DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import (DEFAULT_OUT, PrivateDaemon, latency_boxplot, log, machine_info,
                               record_cleanup, run_main, stats, terminate_as_exception,
                               write_json)
from deltabox import Sandbox

MODES = ("default", "userns")
OPS = ("create", "exec", "files", "checkpoint", "rollback", "fork")


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return (time.perf_counter() - t0) * 1000.0, out


def prepare(sbx: Sandbox) -> None:
    sbx.session("main").run("X=1; cd /tmp")
    sbx.exec("sleep 100000 >/dev/null 2>&1 &")


def one_rep(socket: str, boxes: dict[str, Sandbox], mode: str) -> dict[str, float]:
    """Every operation once in `mode`; milliseconds by operation (client-side wall)."""
    sbx, got = boxes[mode], {}
    got["create"], fresh = timed(lambda: Sandbox.create(socket=socket,
                                                        user_namespace=mode == "userns"))
    try:
        t, _ = timed(lambda: fresh.exec("true"))
        got["create"] += t
    finally:
        fresh.kill()
    got["exec"], _ = timed(lambda: sbx.exec("true"))
    got["files"], _ = timed(lambda: sbx.files.write("/workspace/f", b"x" * 4096))
    got["checkpoint"], cp = timed(lambda: sbx.checkpoint(mode="full"))
    got["rollback"], res = timed(lambda: sbx.rollback(cp))
    if res.process_state != "restored":
        raise RuntimeError(f"{mode}: rollback did not restore processes: {res.note}")
    got["fork"], kids = timed(lambda: sbx.fork(cp))
    try:
        if kids[0].process_state != "restored":
            raise RuntimeError(f"{mode}: fork did not restore processes: {kids[0].fork_note}")
    finally:
        for k in kids:
            k.kill()
    sbx.delete_checkpoint(cp.id)
    return got


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for op in OPS:
        by = {m: [r[op] for r in runs if r["mode"] == m] for m in MODES}
        paired = [u[op] / d[op] for d, u in zip(
            [r for r in runs if r["mode"] == "default"],
            [r for r in runs if r["mode"] == "userns"])]
        s = {m: stats(v) for m, v in by.items()}
        out[op] = {"default": s["default"], "userns": s["userns"],
                   "ratio_of_p50": s["userns"]["p50"] / s["default"]["p50"],
                   "ratio_paired_median": statistics.median(paired)}
    return out


def plot(runs: list[dict[str, Any]], path: Path) -> Path | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    groups = {op: {m: [r[op] for r in runs if r["mode"] == m] for m in MODES} for op in OPS}
    fig, ax = plt.subplots(figsize=(9, 4.5))
    latency_boxplot(ax, groups, title="sandbox root in a user namespace vs host uid 0")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.userns", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args()
    runs: list[dict[str, Any]] = []
    with terminate_as_exception(), PrivateDaemon(extra_args=["--no-inspector"]) as d:
        boxes = {m: Sandbox.create(socket=d.socket, user_namespace=m == "userns")
                 for m in MODES}
        for b in boxes.values():
            prepare(b)
        for m in MODES:  # warm-up: first mounts, first template, page cache
            one_rep(d.socket, boxes, m)
        for rep in range(args.reps):
            for mode in (MODES if rep % 2 == 0 else MODES[::-1]):
                r = one_rep(d.socket, boxes, mode)
                runs.append({"mode": mode, "rep": rep, **r})
            log(f"rep {rep}: " + ", ".join(
                f"{op} {runs[-2][op]:.1f}/{runs[-1][op]:.1f}" for op in OPS))
        result: dict[str, Any] = {"benchmark": "userns", "reps": args.reps,
                                  "inspector": "off (--no-inspector: same for both modes)",
                                  "runs": runs, "summary": summarize(runs)}
        info = machine_info(d.socket)
    record_cleanup(result, d)
    path = write_json(args.out / "userns.json", result, info)
    png = plot(runs, args.out / "userns.png")
    for op, s in result["summary"].items():
        print(f"{op:10s} default p50 {s['default']['p50']:7.2f} ms  userns p50 "
              f"{s['userns']['p50']:7.2f} ms  ratio {s['ratio_of_p50']:.3f} "
              f"(paired median {s['ratio_paired_median']:.3f})")
    print(f"wrote {path}" + (f" and {png}" if png else ""))
    return 0


if __name__ == "__main__":
    run_main(main)
