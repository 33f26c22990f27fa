"""A tree search's step: roll back to a node, then run a command there. Two calls
(`rollback(cp)`, then `exec(cmd)`) against one (`exec(cmd, rollback_to=cp)`), and the same
command without any rollback as the floor, measured in the same run on one private daemon.

The sandbox holds 200 small files and a few checkpoints (the nodes); each rep picks the next
node, pauses (`--think`, the model's turn: the daemon's warm pool prepares meanwhile, and
the CPU goes idle as it does between an agent's calls), then times, client-side:

- two_calls:  `sbx.rollback(node)` + `sbx.exec(cmd)`;
- one_call:   `sbx.exec(cmd, rollback_to=node)`;
- no_rollback: `sbx.exec(cmd)` (the floor: what the step costs without going back).

Each is followed by a checkpoint (untimed), as a search step would take. The order of the
three rotates every rep (these machines are noisy). Reported: p50/p90 of each, the step's
C/R cost over the floor (p50 difference) for both ways, and the rollback's own daemon time.
JSON and a PNG to --out (default benchmarks/out).

    .venv/bin/python -m benchmarks.search_step [--reps 40] [--cmd true] [--out DIR]
"""

from __future__ import annotations

import argparse
import shlex
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (DEFAULT_OUT, PrivateDaemon, finish_figure, latency_boxplot, log,
                               machine_info, pyplot, record_cleanup, run_main, stats,
                               terminate_as_exception, write_json)
from deltabox import Sandbox

WAYS = ("two_calls", "one_call", "no_rollback")
NODES = 4


def make_nodes(sbx: Sandbox) -> list[Any]:
    """200 files, then NODES checkpoints that differ by one appended line."""
    for i in range(200):
        sbx.files.write(f"/workspace/r/m{i}.py", "x = 1\n" * 50)
    nodes = []
    for i in range(NODES):
        sbx.exec(["bash", "-c", f"echo {i} >> /workspace/r/log"])
        nodes.append(sbx.checkpoint(label=f"node {i}"))
    return nodes


def one_way(sbx: Sandbox, way: str, node: Any, cmd: list[str]) -> tuple[float, float]:
    """(client ms of the step, the rollback's daemon ms or 0)."""
    t0 = time.perf_counter()
    if way == "two_calls":
        rb = sbx.rollback(node)
        r = sbx.exec(cmd)
        server = rb.duration_ms
    elif way == "one_call":
        r = sbx.exec(cmd, rollback_to=node)
        if r.rollback is None:
            raise RuntimeError("exec(rollback_to=) answered without its rollback")
        server = r.rollback.duration_ms
    else:
        r = sbx.exec(cmd)
        server = 0.0
    ms = (time.perf_counter() - t0) * 1000
    if r.exit_code != 0:
        raise RuntimeError(f"{cmd} exited {r.exit_code}: {r.stderr[-300:]}")
    return ms, server


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    by = {w: [r["ms"] for r in runs if r["way"] == w] for w in WAYS}
    s = {w: stats(v) for w, v in by.items()}
    floor = s["no_rollback"]["p50"]
    return {**s,
            "rollback_daemon_ms": {w: stats([r["rollback_ms"] for r in runs if r["way"] == w])
                                   for w in ("two_calls", "one_call")},
            "step_cr_ms_p50": {w: s[w]["p50"] - floor for w in ("two_calls", "one_call")},
            "one_over_two_calls_p50": s["one_call"]["p50"] / s["two_calls"]["p50"]}


def plot(runs: list[dict[str, Any]], path: Path, machine: dict[str, Any]) -> Path | None:
    try:
        plt = pyplot()
    except ImportError:
        return None
    groups = {"step": {w: [r["ms"] for r in runs if r["way"] == w] for w in WAYS}}
    fig, ax = plt.subplots(figsize=(10, 4.5))
    latency_boxplot(ax, groups, log_scale=False)
    finish_figure(fig, path, "search step (rollback + command)", machine)
    return path


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.search_step", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=40)
    p.add_argument("--cmd", default="true", help="the step's command (default: true)")
    p.add_argument("--think", type=float, default=0.2, help="pause before each step (s)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args()
    cmd = shlex.split(args.cmd)
    runs: list[dict[str, Any]] = []
    with terminate_as_exception(), PrivateDaemon() as d:
        sbx = Sandbox.create(socket=d.socket)
        try:
            nodes = make_nodes(sbx)
            for way in WAYS:  # warm-up: the first generation, the first spawn
                one_way(sbx, way, nodes[0], cmd)
                sbx.checkpoint()
            for rep in range(args.reps):
                k = rep % len(WAYS)
                for way in WAYS[k:] + WAYS[:k]:
                    node = nodes[rep % len(nodes)]
                    time.sleep(args.think)
                    ms, server = one_way(sbx, way, node, cmd)
                    sbx.checkpoint()  # untimed: the step's own checkpoint
                    runs.append({"way": way, "rep": rep, "node": node.id, "ms": ms,
                                 "rollback_ms": server})
                if rep % 10 == 9:
                    log(f"rep {rep + 1}/{args.reps}")
        finally:
            sbx.kill()
        result: dict[str, Any] = {"benchmark": "search_step", "reps": args.reps, "cmd": cmd,
                                  "think_s": args.think, "runs": runs,
                                  "summary": summarize(runs)}
        info = machine_info(d.socket)
    record_cleanup(result, d)
    path = write_json(args.out / "search_step.json", result, info)
    png = plot(runs, args.out / "search_step.png", info)
    s = result["summary"]
    for w in WAYS:
        print(f"{w:12s} p50 {s[w]['p50']:6.2f} ms  p90 {s[w]['p90']:6.2f} ms")
    print(f"a step's C/R over the floor (p50): two calls {s['step_cr_ms_p50']['two_calls']:.2f}"
          f" ms, one call {s['step_cr_ms_p50']['one_call']:.2f} ms; one/two calls "
          f"{s['one_over_two_calls_p50']:.3f}; the rollback's daemon time p50 "
          f"{s['rollback_daemon_ms']['one_call']['p50']:.2f} ms")
    print(f"wrote {path}" + (f" and {png}" if png else ""))
    return 0


if __name__ == "__main__":
    run_main(main)
