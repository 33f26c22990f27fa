"""Overhead of the turn inspector on a workload like an agent's commands.

The same workload (git status, ls, cat, grep, find, python imports, a python script writing 50
files, sed -i, a compile of a small C file when gcc is there) runs in a cgroup-v2 cgroup, in
alternating modes, in this process's trio loop as the daemon would run it. The program is
compiled once; the modes switch by detaching / attaching its probes, so runs can alternate
quickly (machines shared with other jobs are noisy: many short alternating runs, compared
pairwise, beat a few long ones):

- off:        no probe attached (nothing of the inspector runs in the kernel);
- on:         the inspector loaded, the cgroup watched, events drained by `Inspector.run()`
              and a turn cut every 100 ms (`turn()`), as the daemon does;
- unwatched:  loaded, but the workload's cgroup is not watched (the cost every other
              process on the host pays while the inspector is loaded).

Reported: wall time and CPU time (user + sys of the workload's processes) per run, the
overhead of each mode against `off` as the ratio of medians and as the median of per-pair
ratios (runs are interleaved off, on, unwatched, off, ...), and the consumer's own CPU time
(this process, draining events). The order of the modes rotates from rep to rep. JSON to
benchmarks/out/inspector_overhead.json.

    .venv/bin/python -m benchmarks.inspector_overhead [--reps 30] [--iterations 5]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trio

from benchmarks.common import DEFAULT_OUT, log, machine_info, write_json
from deltabox.inspector import Inspector, InspectorUnavailable, cgroup_id, unified_cgroup_mount

WORKLOAD = r"""
set -e
cd "$1"
n="$2"
for i in $(seq "$n"); do
  git status --porcelain >/dev/null
  git log --oneline -5 >/dev/null
  ls -la src >/dev/null
  cat src/*.py >/dev/null
  grep -rn "def " src >/dev/null || true
  find . -name '*.py' -newer README >/dev/null
  /usr/bin/python3 -c 'import json, email.parser, http.client, argparse, subprocess, decimal'
  /usr/bin/python3 - <<'EOF'
import os
os.makedirs("out", exist_ok=True)
for j in range(50):
    with open(f"out/f{j}.txt", "w") as f:
        f.write("x" * 4096)
EOF
  sed -i "s/value = .*/value = $i/" src/m0.py
  if command -v gcc >/dev/null; then gcc -O0 -o out/hello src/hello.c; out/hello >/dev/null; fi
  rm -rf out
done
"""


def make_repo(root: Path) -> None:
    src = root / "src"
    src.mkdir(parents=True)
    for i in range(40):
        (src / f"m{i}.py").write_text(
            "".join(f"def f{j}(x):\n    return x * {j}\n\n" for j in range(30)) +
            "value = 0\n")
    (src / "hello.c").write_text('#include <stdio.h>\nint main(void){puts("hi");return 0;}\n')
    (root / "README").write_text("bench\n")
    env = dict(os.environ, GIT_AUTHOR_NAME="b", GIT_AUTHOR_EMAIL="b@x", GIT_COMMITTER_NAME="b",
               GIT_COMMITTER_EMAIL="b@x")
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-qm", "init"]):
        subprocess.run(cmd, cwd=root, check=True, env=env)


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


async def run_workload(cg: Path, script: Path, work: Path, iterations: int,
                       insp: Inspector | None, key: str | None) -> dict:
    cmd = ["sh", "-c", f'echo $$ > {cg}/cgroup.procs; exec bash "$@"', "sh", str(script),
           str(work), str(iterations)]
    turns = 0
    turn_ms: list[float] = []
    cpu0, self0 = children_cpu(), time.process_time()
    t0 = time.perf_counter()
    async with trio.open_nursery() as nursery:
        if insp is not None:
            nursery.start_soon(insp.run)
        proc = await trio.lowlevel.open_process(cmd, stdout=subprocess.DEVNULL)
        if insp is not None and key is not None:
            insp.expect_entry(key, proc.pid)
        while proc.returncode is None:
            with trio.move_on_after(0.1):
                await proc.wait()
            if insp is not None and key is not None:
                t = time.perf_counter()
                insp.turn(key)
                turn_ms.append((time.perf_counter() - t) * 1000)
                turns += 1
        wall = time.perf_counter() - t0
        nursery.cancel_scope.cancel()
    if proc.returncode != 0:
        raise RuntimeError(f"workload failed with {proc.returncode}")
    return {"wall_s": wall, "cpu_s": children_cpu() - cpu0,
            "consumer_cpu_s": time.process_time() - self0, "turns": turns,
            "turn_ms_median": statistics.median(turn_ms) if turn_ms else None,
            "turn_ms_max": max(turn_ms) if turn_ms else None}


def summarize(runs: list[dict]) -> dict:
    by: dict[str, list[dict]] = {}
    for r in runs:
        by.setdefault(r["mode"], []).append(r)
    out: dict = {}
    base = by.get("off", [])
    for mode, rs in by.items():
        walls = [r["wall_s"] for r in rs]
        cpus = [r["cpu_s"] for r in rs]
        out[mode] = {"runs": len(rs), "wall_s_median": statistics.median(walls),
                     "cpu_s_median": statistics.median(cpus),
                     "consumer_cpu_s_median": statistics.median(r["consumer_cpu_s"] for r in rs)}
        if mode != "off" and base:
            base_by_rep = {b["rep"]: b for b in base}
            pairs = [(r, base_by_rep[r["rep"]]) for r in rs if r["rep"] in base_by_rep]
            out[mode]["wall_overhead_pct_of_medians"] = 100 * (
                statistics.median(walls) / statistics.median(b["wall_s"] for b in base) - 1)
            out[mode]["cpu_overhead_pct_of_medians"] = 100 * (
                statistics.median(cpus) / statistics.median(b["cpu_s"] for b in base) - 1)
            out[mode]["wall_overhead_pct_paired_median"] = 100 * (statistics.median(
                r["wall_s"] / b["wall_s"] for r, b in pairs) - 1)
            out[mode]["cpu_overhead_pct_paired_median"] = 100 * (statistics.median(
                r["cpu_s"] / b["cpu_s"] for r, b in pairs) - 1)
    return out


async def main_async(args: argparse.Namespace) -> dict:
    unified = unified_cgroup_mount()
    if unified is None:
        raise SystemExit("no cgroup2 hierarchy mounted")
    tmp = Path(tempfile.mkdtemp(prefix="dbx-insp-bench-", dir="/var/tmp"))
    cg = unified / f"dbx-insp-bench-{os.getpid()}"
    cg.mkdir()
    runs: list[dict] = []
    try:
        work = tmp / "repo"
        make_repo(work)
        script = tmp / "workload.sh"
        script.write_text(WORKLOAD)
        cid = cgroup_id(cg)
        log("warm-up run")
        await run_workload(cg, script, work, 2, None, None)
        modes = ["off", "on", "unwatched"]
        insp = Inspector.load(ringbuf_pages=args.ringbuf_pages)
        attached = True
        try:
            for rep in range(args.reps):
                # Rotate the order each rep, so no mode always follows another.
                for mode in modes[rep % 3:] + modes[:rep % 3]:
                    want = mode != "off"
                    if want != attached:
                        insp._set_attached(want)
                        attached = want
                    key = None
                    if mode == "on":
                        key = "bench"
                        insp.watch(key, cid)
                    try:
                        r = await run_workload(cg, script, work, args.iterations,
                                               insp if mode == "on" else None, key)
                    finally:
                        if key is not None:
                            insp.unwatch(key)
                    r.update(mode=mode, rep=rep)
                    runs.append(r)
                    log(f"rep {rep} {mode:9s} wall {r['wall_s']:.3f}s cpu {r['cpu_s']:.3f}s "
                        f"consumer {r['consumer_cpu_s']:.3f}s turns {r['turns']}")
        finally:
            insp.close()
    finally:
        for _ in range(50):
            try:
                cg.rmdir()
                break
            except OSError:
                time.sleep(0.1)
        shutil.rmtree(tmp, ignore_errors=True)
    return {"benchmark": "inspector_overhead", "reps": args.reps,
            "iterations": args.iterations, "ringbuf_pages": args.ringbuf_pages,
            "runs": runs, "summary": summarize(runs)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.inspector_overhead",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--iterations", type=int, default=5, help="workload loop iterations")
    p.add_argument("--ringbuf-pages", type=int, default=2048)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        print("needs root", file=sys.stderr)
        return 1
    try:
        Inspector.load().close()
    except InspectorUnavailable as e:
        print(f"inspector unavailable: {e}", file=sys.stderr)
        return 1
    doc = trio.run(main_async, args)
    path = write_json(args.out / "inspector_overhead.json", doc, machine_info())
    for mode, s in doc["summary"].items():
        extra = ""
        if "wall_overhead_pct_of_medians" in s:
            extra = (f" overhead wall {s['wall_overhead_pct_of_medians']:+.2f}% "
                     f"(paired {s['wall_overhead_pct_paired_median']:+.2f}%), cpu "
                     f"{s['cpu_overhead_pct_of_medians']:+.2f}% "
                     f"(paired {s['cpu_overhead_pct_paired_median']:+.2f}%)")
        print(f"{mode:9s} wall {s['wall_s_median']:.3f}s cpu {s['cpu_s_median']:.3f}s{extra}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
