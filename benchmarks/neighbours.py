"""Neighbours on one daemon: how much one sandbox's operations slow another sandbox's calls.

An RL or tree-search worker drives many sandboxes through one deltaboxd. This measures what
sandbox A's checkpoints, rollbacks, forks and commands cost sandbox B, which only makes a
trivial call (`Sandbox.info()`) every few milliseconds from a separate client process (so
that the two clients do not share a GIL). The baseline is the same probe while A is idle,
measured in the same run; every phase runs once per round, rounds alternate the order.

A holds a bash session, a python process with 50 MB of memory (running: it polls every
50 ms) and a 10,000-file tree; B is an empty sandbox. Phases, each `--seconds` long, A
repeating its operation with a 30 ms pause between two:

- idle:            nothing (the baseline);
- exec:            `exec(["true"])`;
- fs_checkpoint:   one file written, then `checkpoint(mode="fs")` (processes running: the
                   cgroup is frozen for the file snapshot);
- full_checkpoint: one file written, then `checkpoint(mode="full")`;
- rollback:        `rollback(base)` (files and both processes);
- fork4:           `fork(base, count=4)`, then the four children removed.

Between two phases the probe pauses and the run waits (untimed) until the machine is quiet
(under 10 % of its CPUs busy for 0.5 s, at most 60 s): a full checkpoint leaves a background
process dump behind, a fork its children's teardown, and no phase must pay for another's.
(Not until btrfs has dropped the deleted layers, as other benchmarks wait: after 100
rollbacks its cleaner takes minutes, with the CPUs idle.) Reported per phase: B's call
latency p50 / p90 / p99 / max and each over the idle phase's (the ratio), and A's operation
p50. JSON and a PNG (B's latency CDF per phase) to --out.

    .venv/bin/python -m benchmarks.neighbours [--quick] [--seconds 8] [--rounds 2] [--out DIR]
"""

from __future__ import annotations

import argparse
import multiprocessing
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Callable

from benchmarks.common import (DEFAULT_OUT, PrivateDaemon, finish_figure, kill_and_wait, log,
                               machine_info, pyplot, record_cleanup, run_main, stats,
                               terminate_as_exception, wait_for_file, write_json)
from benchmarks.process_cr import TREE, make_tree
from deltabox import Sandbox

PHASES = ("idle", "exec", "fs_checkpoint", "full_checkpoint", "rollback", "fork4")
PAUSE_S = 0.03
PROBE_INTERVAL_S = 0.004
WORKLOAD = """\
import os, time
b = bytearray(50 * 1024 * 1024)
for i in range(0, len(b), 4096):
    b[i] = 1
open("/workspace/ready", "w").write(str(os.getpid()))
while True:
    time.sleep(0.05)
"""


def probe(socket: str, sandbox_id: str, conn: Connection) -> None:
    """The neighbour (a process of its own): time `info()` on B while told to ("run" /
    "pause"); on "stop", send back every (monotonic time, ms) sample."""
    b = Sandbox.connect(sandbox_id, socket=socket)
    samples: list[tuple[float, float]] = []
    conn.send("ready")
    running = False
    while True:
        if conn.poll(0 if running else None):
            msg = conn.recv()
            if msg == "stop":
                break
            running = msg == "run"
            continue
        t0 = time.perf_counter()
        b.info()
        samples.append((time.monotonic(), (time.perf_counter() - t0) * 1000))
        time.sleep(PROBE_INTERVAL_S)
    conn.send(samples)


def setup_a(a: Sandbox) -> Any:
    """Session, the running python, the tree; returns the base checkpoint (full)."""
    a.files.write("/workspace/w.py", WORKLOAD)
    make_tree(a)
    sh = a.session("main")
    sh.run("cd /workspace && export KEPT=1")
    sh.run("nohup python3 /workspace/w.py >/dev/null 2>&1 &")
    wait_for_file(a, "/workspace/ready", 60, "the workload")
    return a.checkpoint(mode="full", label="base")


def operation(a: Sandbox, phase: str, base: Any) -> Callable[[int], None]:
    """A's operation in `phase` (its argument: the repetition, for unique file names)."""
    def write_then(mode: str) -> Callable[[int], None]:
        def op(i: int) -> None:
            a.files.write(f"{TREE}/d00/{phase}-{i}", "y")
            a.checkpoint(mode=mode)
        return op

    def rollback(_: int) -> None:
        rb = a.rollback(base)
        if rb.process_state != "restored":
            raise RuntimeError(f"rollback did not restore the processes: {rb}")

    def fork4(_: int) -> None:
        kill_and_wait(a.fork(base, count=4))

    return {"idle": lambda _: None, "exec": lambda _: a.exec(["true"]),
            "fs_checkpoint": write_then("fs"), "full_checkpoint": write_then("full"),
            "rollback": rollback, "fork4": fork4}[phase]


def cpu_busy() -> tuple[int, int]:
    """(busy, total) jiffies of this machine's CPUs, from /proc/stat: time the hypervisor
    gave to others (steal) and guests' time (already in user) are left out."""
    with open("/proc/stat") as f:
        user, nice, system, idle, iowait, irq, softirq = (
            int(v) for v in f.readline().split()[1:8])
    busy = user + nice + system + irq + softirq
    return busy, busy + idle + iowait


def wait_quiet(limit: float = 0.10, timeout: float = 60) -> float:
    """Until the machine's CPUs are under `limit` busy for 0.5 s; returns the seconds
    waited (logs how busy they stayed when it gives up)."""
    t0 = time.monotonic()
    frac = 1.0
    while time.monotonic() - t0 < timeout:
        b0, t_0 = cpu_busy()
        time.sleep(0.5)
        b1, t_1 = cpu_busy()
        frac = (b1 - b0) / (t_1 - t_0) if t_1 > t_0 else 1.0
        if frac < limit:
            return time.monotonic() - t0
    log(f"the machine stayed over {limit:.0%} busy for {timeout:g} s (last 0.5 s: {frac:.0%})")
    return time.monotonic() - t0


def run_phase(a: Sandbox, phase: str, base: Any, seconds: float) -> dict[str, Any]:
    op = operation(a, phase, base)
    ms: list[float] = []
    t_start = time.monotonic()
    i = 0
    while time.monotonic() - t_start < seconds:
        t0 = time.perf_counter()
        op(i)
        ms.append((time.perf_counter() - t0) * 1000)
        i += 1
        time.sleep(PAUSE_S)
    return {"phase": phase, "start": t_start, "end": time.monotonic(),
            "op_ms": ms if phase != "idle" else []}


def summarize(windows: list[dict[str, Any]], samples: list[tuple[float, float]],
              phases: list[str]) -> dict[str, Any]:
    by: dict[str, list[float]] = {p: [] for p in phases}
    ops: dict[str, list[float]] = {p: [] for p in phases}
    for w in windows:
        by[w["phase"]] += [ms for t, ms in samples if w["start"] <= t <= w["end"]]
        ops[w["phase"]] += w["op_ms"]
    out: dict[str, Any] = {p: {"neighbour": stats(by[p]), "operation": stats(ops[p])}
                           for p in phases}
    idle = out["idle"]["neighbour"]
    for p in phases:
        nb = out[p]["neighbour"]
        out[p]["over_idle"] = {q: nb[q] / idle[q] for q in ("p50", "p90", "p99", "max")}
    return out


def plot(windows: list[dict[str, Any]], samples: list[tuple[float, float]], path: Path,
         machine: dict[str, Any]) -> Path | None:
    try:
        plt = pyplot()
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(9, 5))
    for phase in PHASES:
        xs = sorted(ms for w in windows if w["phase"] == phase
                    for t, ms in samples if w["start"] <= t <= w["end"])
        if xs:
            ax.plot(xs, [(k + 1) / len(xs) for k in range(len(xs))], label=phase)
    ax.set_xscale("log")
    ax.set_xlabel("sandbox B's info() call, ms (log)")
    ax.set_ylabel("fraction of calls")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(title="what sandbox A does")
    finish_figure(fig, path, "a neighbour's call latency while another sandbox works", machine)
    return path


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.neighbours", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="4 s per phase, 2 rounds")
    p.add_argument("--seconds", type=float, default=8.0, help="length of each phase")
    p.add_argument("--rounds", type=int, default=2, help="times each phase runs")
    p.add_argument("--phases", default=",".join(PHASES),
                   help=f"comma-separated subset of {', '.join(PHASES)} (idle is always run)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args()
    phases = ["idle"] + [ph for ph in args.phases.split(",") if ph and ph != "idle"]
    if unknown := [ph for ph in phases if ph not in PHASES]:
        p.error(f"unknown phase(s) {', '.join(unknown)}: choose from {', '.join(PHASES)}")
    seconds = 4.0 if args.quick else args.seconds
    windows: list[dict[str, Any]] = []
    samples: list[tuple[float, float]] = []
    with terminate_as_exception(), PrivateDaemon() as d:
        a = Sandbox.create(socket=d.socket)
        b = Sandbox.create(socket=d.socket)
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        neighbour = ctx.Process(target=probe, args=(d.socket, b.id, child), daemon=True)
        try:
            base = setup_a(a)
            neighbour.start()
            if not parent.poll(60) or parent.recv() != "ready":
                raise RuntimeError("the neighbour's probe did not start")
            for rnd in range(args.rounds):
                order = phases if rnd % 2 == 0 else phases[::-1]
                for phase in order:
                    waited = wait_quiet()
                    parent.send("run")
                    time.sleep(0.2)  # its first calls, a cold channel, stay out of the window
                    windows.append(run_phase(a, phase, base, seconds))
                    parent.send("pause")
                    log(f"round {rnd + 1}: {phase} done ({len(windows[-1]['op_ms'])} ops; "
                        f"{waited:.1f} s of settling before it)")
            parent.send("stop")
            if not parent.poll(30):
                raise RuntimeError("the neighbour's probe did not answer")
            samples = parent.recv()
        finally:
            if neighbour.is_alive():
                neighbour.kill()
            neighbour.join(10)
            for s in (a, b):
                s.kill()
        info = machine_info(d.socket)
    samples = [(round(t, 4), round(ms, 3)) for t, ms in samples
               if any(w["start"] <= t <= w["end"] for w in windows)]
    summary = summarize(windows, samples, phases)
    result: dict[str, Any] = {"benchmark": "neighbours", "phases": phases, "seconds": seconds,
                              "rounds": args.rounds, "pause_s": PAUSE_S,
                              "probe_interval_s": PROBE_INTERVAL_S, "windows": windows,
                              "samples": samples, "summary": summary}
    record_cleanup(result, d)
    path = write_json(args.out / "neighbours.json", result, info)
    png = plot(windows, samples, args.out / "neighbours.png", info)
    print("sandbox B's info() while sandbox A ... (ms; x = over the idle phase)")
    for ph in phases:
        nb, r, op = summary[ph]["neighbour"], summary[ph]["over_idle"], summary[ph]["operation"]
        opms = f"A's op p50 {op['p50']:6.1f} ms" if op["n"] else ""
        print(f"{ph:16s} n {nb['n']:5d}  p50 {nb['p50']:5.2f}  p90 {nb['p90']:6.2f} "
              f"({r['p90']:4.1f}x)  p99 {nb['p99']:6.2f} ({r['p99']:4.1f}x)  max "
              f"{nb['max']:6.1f}  {opms}")
    print(f"wrote {path}" + (f" and {png}" if png else ""))
    return 0


if __name__ == "__main__":
    run_main(main)
