"""File-state checkpoint/rollback benchmark: DeltaBox vs copying the writable layer.

    .venv/bin/python -m benchmarks.fs_cr [--quick] [--out DIR]

A >= 10,000-file tree of real project sources (sdists from PyPI: Django, SymPy, Pygments) is
uploaded into a sandbox's /workspace/src and checkpointed once. Then, for k in 1, 10, 100:

- checkpoint: T turns; each changes k random files (one `exec`, untimed), then times
  `sbx.checkpoint(mode="fs")` client-side. Baseline on the same data (on a few of the
  turns, as it takes seconds): `shutil.copytree` of the sandbox's writable layer (its
  overlay upper dir on the host) right after the same change.
- rollback: T turns; each changes k random files (untimed), then times
  `sbx.rollback(cp)` to a random checkpoint of this k's series. Baseline: a host copy of the
  writable layer gets the same change, then `rmtree(work) + copytree(saved checkpoint copy ->
  work)`.

Plus `sbx.fork(cp, count=16)` (total time for 16 children), `Sandbox.create()`, and a real
test suite (attrs' own tests, offline, the venv's pytest) run inside a sandbox vs on the host.
Writes <out>/fs_cr.json (every latency, summaries, ratios, targets) and <out>/fs_cr.png.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sqlite3
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common import (DEFAULT_OUT, PrivateDaemon, Timer, count_files, default_cache_dir,
                               download_sdists, finish_figure, fs_type, latency_boxplot,
                               list_files, log, machine_info, other_daemons, percentile, pyplot,
                               ratio, record_cleanup, run_main, stats, tar_bytes,
                               terminate_as_exception, unpack_sdist, write_json)

# Real project sources: 6772 + 1883 + 2448 = 11,103 files.
SOURCE_SDISTS = ["django==5.0.6", "sympy==1.12", "pygments==2.17.2"]
MIN_FILES = 10_000
KS = (1, 10, 100)
SANDBOX_SRC = "/workspace/src"


@dataclass(frozen=True)
class Suite:
    """A real project's test suite that runs offline with the venv's python + pytest."""

    sdist: str
    env: dict[str, str]
    args: tuple[str, ...]


# attrs' suite (~1,300 tests, hypothesis with a fixed seed). test_unknown expects a warning
# that newer pytest versions swallow (it fails on the host too), so it is deselected.
SUITE = Suite(
    sdist="attrs==23.2.0",
    env={"PYTHONPATH": "src"},
    args=("-q", "-p", "no:cacheprovider", "--hypothesis-seed=0",
          "--deselect", "tests/test_funcs.py::TestAssoc::test_unknown"),
)

# The environment a sandboxed command gets (deltabox.daemon.service.BASE_ENV); the host run
# uses the same one so only the sandbox differs.
SANDBOX_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "LANG": "C.UTF-8",
    "USER": "root",
}

# Append one line to every file named on stdin (paths relative to the cwd).
APPEND_SH = 'while IFS= read -r f; do printf "%s\\n" "$1" >> "$f"; done'

TARGETS = {
    "checkpoint_p50_ms_k10": ("<=", 5.0),
    "rollback_p50_ms_k10": ("<=", 5.0),
    "checkpoint_speedup_vs_copytree_k10": (">=", 20.0),
    "rollback_speedup_vs_copytree_k10": (">=", 20.0),
    "fork16_total_p50_ms": ("<=", 150.0),
    "create_p50_ms": ("<=", 50.0),
    "suite_sandbox_over_host_median": ("<=", 1.05),
}


@dataclass
class Plan:
    turns: int
    fork_reps: int
    fork_count: int
    creates: int
    suite_reps: int
    suite_warmup: bool
    seed: int
    baseline_reps: int  # copytree baselines per k (each copies the whole layer: seconds)
    checkpoint_mode: str = "fs"
    ks: tuple[int, ...] = KS


@dataclass
class Series:
    """Raw measurements of one k."""

    k: int
    checkpoint_ms: list[float] = field(default_factory=list)
    checkpoint_server_ms: list[float] = field(default_factory=list)
    checkpoint_freeze_ms: list[float] = field(default_factory=list)
    checkpoint_files_changed: list[int] = field(default_factory=list)
    checkpoint_kind: list[str] = field(default_factory=list)
    copytree_ms: list[float] = field(default_factory=list)
    copytree_turns: list[int] = field(default_factory=list)
    rollback_ms: list[float] = field(default_factory=list)
    rollback_server_ms: list[float] = field(default_factory=list)
    rollback_target_age: list[int] = field(default_factory=list)  # 0 = the newest checkpoint
    rollback_process_state: list[str] = field(default_factory=list)
    rmtree_copytree_ms: list[float] = field(default_factory=list)
    rmtree_copytree_turns: list[int] = field(default_factory=list)
    rollback_verified: int = 0


# ---- preparing the data (cached) -------------------------------------------------------------

def prepare_sources(cache: Path) -> list[Path]:
    archives = download_sdists(SOURCE_SDISTS, cache / "sdists")
    trees = [unpack_sdist(a, cache / "trees") for a in archives.values()]
    n = sum(count_files(t) for t in trees)
    if n < MIN_FILES:
        raise SystemExit(f"source tree has only {n} files (< {MIN_FILES}); add an sdist to "
                         "SOURCE_SDISTS")
    return trees


def prepare_suite(cache: Path) -> Path:
    archives = download_sdists([SUITE.sdist], cache / "sdists")
    return unpack_sdist(archives[SUITE.sdist], cache / "suites")


# ---- the daemon's view of a sandbox ----------------------------------------------------------

def writable_upper(d: PrivateDaemon, sandbox_id: str) -> Path:
    """The host path of a sandbox's current writable layer (overlay upper dir).

    The API does not expose it; the daemon's SQLite db has it (opened read-only)."""
    db = sqlite3.connect(f"file:{d.state_dir / 'deltabox.db'}?mode=ro", uri=True, timeout=10)
    try:
        row = db.execute("SELECT layer_id FROM sandboxes WHERE id = ?", (sandbox_id,)).fetchone()
    finally:
        db.close()
    if row is None:
        raise RuntimeError(f"sandbox {sandbox_id} not in the daemon's db")
    upper = d.state_dir / "store" / "layers" / row[0] / "upper"
    if not (upper / SANDBOX_SRC.lstrip("/")).is_dir():
        raise RuntimeError(f"{upper} does not hold {SANDBOX_SRC}")
    return upper


def change_in_sandbox(sbx: Any, paths: list[str], tag: str) -> None:
    r = sbx.exec(["bash", "-c", APPEND_SH, "bash", tag], cwd=SANDBOX_SRC,
                 stdin="\n".join(paths) + "\n", timeout=120)
    if r.exit_code != 0:
        raise RuntimeError(f"changing files in the sandbox failed: {r.stderr[-2000:]}")


def change_on_host(root: Path, paths: list[str], tag: str) -> None:
    for p in paths:
        with open(root / p, "a") as f:
            f.write(tag + "\n")


def last_line(data: bytes) -> str:
    lines = data.rstrip(b"\n").rsplit(b"\n", 1)
    return lines[-1].decode(errors="replace")


# ---- the measurements ------------------------------------------------------------------------

def baseline_turns(turns: int, reps: int) -> set[int]:
    """Which turns also run the (slow) copytree baseline: the last two (their copies feed
    the rollback baseline) plus reps - 2 spread evenly over the earlier turns."""
    picked = {turns - 1, turns - 2}
    extra = min(max(0, reps - 2), turns - 2)
    picked |= {int((i + 0.5) * (turns - 2) / extra) for i in range(extra)}
    return picked


def run_series(d: PrivateDaemon, sbx: Any, k: int, files: list[str], plan: Plan,
               rng: random.Random) -> Series:
    s = Series(k)
    scratch = d.scratch
    upper = writable_upper(d, sbx.id)   # a checkpoint keeps the sandbox's writable layer
    cps: list[tuple[Any, str, str]] = []  # (checkpoint, a path changed in its turn, its tag)
    copies: list[Path] = []               # the newest two baseline copies are kept
    with_baseline = baseline_turns(plan.turns, plan.baseline_reps)
    log(f"k={k}: {plan.turns} checkpoint turns ({len(with_baseline)} with a copytree baseline)")
    for t in range(plan.turns):
        paths = rng.sample(files, k)
        tag = f"# deltabox-bench k={k} checkpoint turn {t}"
        change_in_sandbox(sbx, paths, tag)
        with Timer() as tm:
            cp = sbx.checkpoint(mode=plan.checkpoint_mode)
        s.checkpoint_ms.append(tm.ms)
        s.checkpoint_server_ms.append(cp.duration_ms)
        s.checkpoint_freeze_ms.append(cp.freeze_ms)
        s.checkpoint_files_changed.append(cp.files_changed)
        s.checkpoint_kind.append(cp.kind)
        cps.append((cp, paths[0], tag))
        if t in with_baseline:
            # Baseline: copy the same writable layer, in the same state.
            dst = scratch / f"cp-k{k}-{t}"
            with Timer() as tb:
                shutil.copytree(upper, dst, symlinks=True)
            s.copytree_ms.append(tb.ms)
            s.copytree_turns.append(t)
            copies.append(dst)
            while len(copies) > 2:
                shutil.rmtree(copies.pop(0))
            os.sync()  # untimed: the copy's writeback must not land in the next turn's timing
    # The rollback baseline restores `saved` (a checkpoint copy) over `work` (the live
    # layer's copy, which gets the same k changes as the sandbox before each restore).
    work, saved = copies

    log(f"k={k}: {plan.turns} rollback turns ({len(with_baseline)} with an rmtree+copytree "
        "baseline)")
    rel_src = Path(SANDBOX_SRC.lstrip("/"))
    for t in range(plan.turns):
        paths = rng.sample(files, k)
        tag = f"# deltabox-bench k={k} rollback turn {t}"
        change_in_sandbox(sbx, paths, tag)
        idx = rng.randrange(len(cps))
        cp, probe, probe_tag = cps[idx]
        with Timer() as tm:
            rb = sbx.rollback(cp)
        s.rollback_ms.append(tm.ms)
        s.rollback_server_ms.append(rb.duration_ms)
        s.rollback_target_age.append(len(cps) - 1 - idx)
        s.rollback_process_state.append(rb.process_state)
        if t in with_baseline:
            change_on_host(work / rel_src, paths, tag)
            with Timer() as tb:
                shutil.rmtree(work)
                shutil.copytree(saved, work, symlinks=True)
            s.rmtree_copytree_ms.append(tb.ms)
            s.rmtree_copytree_turns.append(t)
            os.sync()  # as above
        # Untimed check that the rollback really restored the checkpoint's files.
        got = last_line(sbx.files.read(f"{SANDBOX_SRC}/{probe}"))
        if not got.endswith(probe_tag):  # endswith: a file may lack a final newline
            raise RuntimeError(f"after rollback to {cp.id}, {probe} ends with {got!r}, "
                               f"expected {probe_tag!r}")
        s.rollback_verified += 1
    shutil.rmtree(work)
    shutil.rmtree(saved)
    os.sync()
    return s


def run_fork(d: PrivateDaemon, sbx: Any, cp: Any, plan: Plan) -> dict[str, Any]:
    log(f"fork({plan.fork_count}) x {plan.fork_reps}")
    total: list[float] = []
    kill_ms: list[float] = []
    for rep in range(plan.fork_reps):
        with Timer() as tm:
            children = sbx.fork(cp, count=plan.fork_count)
        total.append(tm.ms)
        try:
            if rep == 0:  # untimed: the children really have the tree
                r = children[-1].exec(["bash", "-c", f"ls {SANDBOX_SRC} | wc -l"])
                if r.exit_code != 0 or int(r.stdout.strip() or 0) < 1:
                    raise RuntimeError(f"forked child lacks {SANDBOX_SRC}: {r}")
        finally:
            with Timer() as tk:
                for c in children:
                    c.kill()
            kill_ms.append(tk.ms)
    return {"count": plan.fork_count, "total_ms": total,
            "per_child_ms": [t / plan.fork_count for t in total], "kill_all_ms": kill_ms}


def run_create(d: PrivateDaemon, plan: Plan) -> dict[str, Any]:
    from deltabox import Sandbox

    log(f"create x {plan.creates}")
    create_ms: list[float] = []
    kill_ms: list[float] = []
    for _ in range(plan.creates):
        with Timer() as tm:
            box = Sandbox.create(socket=d.socket)
        create_ms.append(tm.ms)
        with Timer() as tk:
            box.kill()
        kill_ms.append(tk.ms)
    return {"create_ms": create_ms, "kill_ms": kill_ms}


def suite_interpreter() -> tuple[str, dict[str, str]]:
    """An interpreter both the host and a sandbox can run, and the env that gives it the
    venv's pytest + hypothesis.

    A sandbox on the host root sees /work/main/.venv, but the venv's python is a symlink into
    /root/.pyenv, and the sandbox masks /root (host secrets). So: the system python of the
    same minor version, with the venv's site-packages on PYTHONPATH (pytest and hypothesis
    are pure Python)."""
    import sysconfig

    venv_sp = sysconfig.get_paths()["purelib"]
    want = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for cand in (f"/usr/bin/{want}", f"/usr/local/bin/{want}"):
        if os.access(cand, os.X_OK) and not os.path.realpath(cand).startswith(
                ("/root/", "/home/", "/tmp/", "/var/tmp/")):
            return cand, {"PYTHONPATH": venv_sp, "PYTHONNOUSERSITE": "1"}
    raise RuntimeError(f"no {want} outside /root and /home for the test-suite comparison; "
                       "use --no-suite")


def run_suite(d: PrivateDaemon, suite_tree: Path, plan: Plan) -> dict[str, Any]:
    """The same test suite, same interpreter and env, on the host and in a sandbox."""
    from deltabox import Sandbox

    name = suite_tree.name
    python, py_env = suite_interpreter()
    argv = [python, "-m", "pytest", *SUITE.args]
    env = dict(SUITE.env)
    env["PYTHONPATH"] = ":".join(x for x in (env.get("PYTHONPATH"), py_env["PYTHONPATH"]) if x)
    env.update({k: v for k, v in py_env.items() if k != "PYTHONPATH"})
    host_tree = d.scratch / "suite-host" / name
    shutil.copytree(suite_tree, host_tree, symlinks=True)
    host_env = dict(SANDBOX_ENV, **env)
    host_ms: list[float] = []
    sbx_ms: list[float] = []
    sbx_server_ms: list[float] = []
    exits: dict[str, list[int]] = {"host": [], "sandbox": []}
    tails: dict[str, str] = {}
    cwd = f"/workspace/{name}"
    box = Sandbox.create(socket=d.socket)
    try:
        box.files.upload_tar("/workspace", tar_bytes(suite_tree))

        def on_host(record: bool) -> None:
            with Timer() as tm:
                r = subprocess.run(argv, cwd=host_tree, env=host_env, capture_output=True,
                                   text=True, timeout=1800)
            tails["host"] = (r.stdout + r.stderr)[-400:]
            if r.returncode != 0:
                raise RuntimeError(f"test suite failed on the host ({r.returncode}):\n"
                                   f"{tails['host']}")
            if record:
                host_ms.append(tm.ms)
                exits["host"].append(r.returncode)

        def in_sandbox(record: bool) -> None:
            with Timer() as tm:
                r = box.exec(argv, cwd=cwd, env=env, timeout=1800)
            tails["sandbox"] = (r.stdout + r.stderr)[-400:]
            if r.exit_code != 0:
                raise RuntimeError(f"test suite failed in the sandbox ({r.exit_code}):\n"
                                   f"{tails['sandbox']}")
            if record:
                sbx_ms.append(tm.ms)
                sbx_server_ms.append(r.duration_ms)
                exits["sandbox"].append(r.exit_code)

        if plan.suite_warmup:  # bytecode caches, page cache: untimed, once each
            log(f"test suite {name}: warm-up on host and in sandbox")
            on_host(False)
            in_sandbox(False)
        for rep in range(plan.suite_reps):
            log(f"test suite {name}: rep {rep + 1}/{plan.suite_reps}")
            order = (on_host, in_sandbox) if rep % 2 == 0 else (in_sandbox, on_host)
            for run in order:
                run(True)
    finally:
        box.kill()
        shutil.rmtree(d.scratch / "suite-host", ignore_errors=True)
    pair_ratios = [s / h for s, h in zip(sbx_ms, host_ms)]
    return {
        "suite": SUITE.sdist, "argv": argv, "env": env, "reps": plan.suite_reps,
        "host_env": host_env, "sandbox_cwd": cwd,
        "host_ms": host_ms, "sandbox_ms": sbx_ms, "sandbox_server_ms": sbx_server_ms,
        "exit_codes": exits, "output_tail": tails,
        "median_ratio": ratio(percentile(sbx_ms, 50), percentile(host_ms, 50)),
        "median_of_pair_ratios": percentile(pair_ratios, 50),
        "pair_ratios": pair_ratios,
    }


# ---- summary ---------------------------------------------------------------------------------

def summarize(series: list[Series], fork: dict, create: dict, suite: dict | None) -> dict:
    per_k: dict[str, Any] = {}
    for s in series:
        ck, cb = stats(s.checkpoint_ms), stats(s.copytree_ms)
        rb, rbb = stats(s.rollback_ms), stats(s.rmtree_copytree_ms)
        per_k[str(s.k)] = {
            "checkpoint_ms": ck, "checkpoint_server_ms": stats(s.checkpoint_server_ms),
            "checkpoint_freeze_ms": stats(s.checkpoint_freeze_ms),
            "copytree_ms": cb,
            "checkpoint_speedup_p50": ratio(cb["p50"], ck["p50"]),
            # conservative: the fastest baseline run against DeltaBox's median
            "checkpoint_speedup_min_baseline": ratio(cb["min"], ck["p50"]),
            "rollback_ms": rb, "rollback_server_ms": stats(s.rollback_server_ms),
            "rmtree_copytree_ms": rbb,
            "rollback_speedup_p50": ratio(rbb["p50"], rb["p50"]),
            "rollback_speedup_min_baseline": ratio(rbb["min"], rb["p50"]),
            "rollback_ms_by_target_age": _by_age(s),
        }
    out: dict[str, Any] = {
        "per_k": per_k,
        "fork": {"count": fork["count"], "total_ms": stats(fork["total_ms"]),
                 "per_child_ms": stats(fork["per_child_ms"])},
        "create_ms": stats(create["create_ms"]),
    }
    if suite is not None:
        out["suite"] = {"host_ms": stats(suite["host_ms"]),
                        "sandbox_ms": stats(suite["sandbox_ms"]),
                        "median_ratio": suite["median_ratio"],
                        "median_of_pair_ratios": suite["median_of_pair_ratios"]}
    return out


AGE_BUCKETS = ((0, 9), (10, 31), (32, 10**9))


def _by_age(s: Series) -> dict[str, Any]:
    """Rollback latency by how many checkpoints of the series are newer than the target."""
    out = {}
    for lo, hi in AGE_BUCKETS:
        vals = [ms for ms, age in zip(s.rollback_ms, s.rollback_target_age) if lo <= age <= hi]
        if vals:
            out[f"{lo}+" if hi >= 10**9 else f"{lo}-{hi}"] = stats(vals)
    return out


def evaluate_targets(summary: dict) -> dict[str, Any]:
    k10 = summary["per_k"].get("10")
    values: dict[str, float | None] = {
        "checkpoint_p50_ms_k10": k10["checkpoint_ms"]["p50"] if k10 else None,
        "rollback_p50_ms_k10": k10["rollback_ms"]["p50"] if k10 else None,
        "checkpoint_speedup_vs_copytree_k10": k10["checkpoint_speedup_p50"] if k10 else None,
        "rollback_speedup_vs_copytree_k10": k10["rollback_speedup_p50"] if k10 else None,
        "fork16_total_p50_ms": (summary["fork"]["total_ms"]["p50"]
                                if summary["fork"]["count"] == 16 else None),
        "create_p50_ms": summary["create_ms"]["p50"],
        "suite_sandbox_over_host_median": (summary["suite"]["median_ratio"]
                                           if "suite" in summary else None),
    }
    out = {}
    for name, (op, limit) in TARGETS.items():
        v = values[name]
        ok = None if v is None else (v <= limit if op == "<=" else v >= limit)
        out[name] = {"value": v, "target": f"{op} {limit:g}", "pass": ok}
    return out


def print_summary(summary: dict, targets: dict, json_path: Path, png_path: Path) -> None:
    p = print
    p("")
    p("DeltaBox file-state checkpoint/rollback (client-side, ms)")
    p(f"{'k':>4} | {'checkpoint p50/p99':>19} {'copytree p50':>13} {'x':>6} {'xmin':>5} | "
      f"{'rollback p50/p99':>17} {'rm+copytree p50':>16} {'x':>6} {'xmin':>5}")
    for k, r in summary["per_k"].items():
        ck, cb, rb, rbb = (r["checkpoint_ms"], r["copytree_ms"], r["rollback_ms"],
                           r["rmtree_copytree_ms"])
        p(f"{k:>4} | {ck['p50']:>8.2f} /{ck['p99']:>8.2f} {cb['p50']:>13.1f} "
          f"{r['checkpoint_speedup_p50']:>5.0f}x {r['checkpoint_speedup_min_baseline']:>4.0f}x | "
          f"{rb['p50']:>7.2f} /{rb['p99']:>7.2f} {rbb['p50']:>16.1f} "
          f"{r['rollback_speedup_p50']:>5.0f}x {r['rollback_speedup_min_baseline']:>4.0f}x")
    p("x = baseline p50 / DeltaBox p50; xmin = fastest baseline run / DeltaBox p50")
    f = summary["fork"]
    p(f"fork({f['count']}) total: p50 {f['total_ms']['p50']:.1f}  p99 {f['total_ms']['p99']:.1f}"
      f"  (per child p50 {f['per_child_ms']['p50']:.1f})")
    c = summary["create_ms"]
    p(f"create: p50 {c['p50']:.1f}  p99 {c['p99']:.1f}")
    if "suite" in summary:
        su = summary["suite"]
        p(f"test suite: host median {su['host_ms']['p50'] / 1000:.2f} s, sandbox median "
          f"{su['sandbox_ms']['p50'] / 1000:.2f} s, ratio {su['median_ratio']:.3f} "
          f"(median of paired ratios {su['median_of_pair_ratios']:.3f})")
    p("")
    p("targets:")
    for name, t in targets.items():
        v = t["value"]
        verdict = "n/a" if t["pass"] is None else ("PASS" if t["pass"] else "FAIL")
        vs = "-" if v is None else f"{v:.3g}"
        p(f"  {verdict:4}  {name:36} {vs:>8}  (target {t['target']})")
    p("")
    p(f"JSON: {json_path}")
    p(f"PNG:  {png_path}")


def plot(series: list[Series], fork: dict, create: dict, suite: dict | None,
         machine: dict, path: Path, quick: bool, checkpoint_mode: str = "fs") -> None:
    plt = pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    colors = {"deltabox": "#1f77b4", "copytree": "#d62728", "rmtree+copytree": "#d62728",
              "host": "#7f7f7f", "sandbox": "#1f77b4"}
    latency_boxplot(
        axes[0][0], {f"k={s.k}": {"deltabox": s.checkpoint_ms, "copytree": s.copytree_ms}
                     for s in series},
        colors=colors, title="checkpoint after k files changed",
        hlines=[(5.0, "target 5 ms")])
    latency_boxplot(
        axes[0][1], {f"k={s.k}": {"deltabox": s.rollback_ms,
                                  "rmtree+copytree": s.rmtree_copytree_ms} for s in series},
        colors=colors, title="rollback, k files dirty",
        hlines=[(5.0, "target 5 ms")])
    latency_boxplot(
        axes[1][0], {f"fork({fork['count']}) total": {"deltabox": fork["total_ms"]},
                     "create": {"deltabox": create["create_ms"]}},
        colors=colors, log_scale=False, title="fork(16) total, and create",
        hlines=[(150.0, "fork target 150 ms"), (50.0, "create target 50 ms")])
    ax = axes[1][1]
    if suite is not None and suite["host_ms"]:
        hs = [x / 1000 for x in suite["host_ms"]]
        ss = [x / 1000 for x in suite["sandbox_ms"]]
        ax.bar([0, 1], [percentile(hs, 50), percentile(ss, 50)], color=["#7f7f7f", "#1f77b4"],
               alpha=0.75, width=0.5)
        ax.scatter([0] * len(hs), hs, color="black", s=10, zorder=3)
        ax.scatter([1] * len(ss), ss, color="black", s=10, zorder=3)
        ax.set_xticks([0, 1])
        ax.set_xticklabels(["host", "sandbox"])
        ax.set_ylabel("wall time (s)")
        ax.set_title(f"{suite['suite']} test suite: sandbox/host median = "
                     f"{suite['median_ratio']:.3f} (target <= 1.05)", fontsize=10)
        ax.grid(axis="y", alpha=0.25)
    else:
        ax.set_axis_off()
    finish_figure(fig, path,
                  f"DeltaBox checkpoint(mode={checkpoint_mode})/rollback"
                  f"{' (quick)' if quick else ''}: {machine['nfiles']} files, "
                  f"{len(series[0].checkpoint_ms) if series else 0} turns per k", machine)


# ---- main ------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.fs_cr", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="20 turns per k, 3 fork reps, 10 creates, 2 suite reps (a few minutes)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"default {DEFAULT_OUT}")
    p.add_argument("--cache-dir", type=Path, default=default_cache_dir(),
                   help="downloaded sdists and unpacked trees (default ~/.cache/deltabox-bench "
                   "or $DELTABOX_BENCH_CACHE)")
    p.add_argument("--tmp-parent", type=Path, default=Path("/var/tmp"),
                   help="where the private daemon's state dir and the baseline copies go")
    p.add_argument("--turns", type=int, help="turns per k (default 100, --quick 20)")
    p.add_argument("--baseline-reps", type=int,
                   help="copytree baselines per k and op (default 5, --quick 2); each copies "
                   "the whole layer, which takes seconds")
    p.add_argument("--checkpoint-mode", choices=("fs", "auto", "full"), default="fs",
                   help="sbx.checkpoint(mode=...): fs = file state only (default; what this "
                   "benchmark is about); auto/full also capture the sandbox's processes")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--no-suite", action="store_true", help="skip the test-suite comparison")
    p.add_argument("--keep-state", action="store_true",
                   help="keep the daemon's temp dir (for debugging)")
    p.add_argument("--replot", type=Path, metavar="JSON",
                   help="no measurements: recompute summary and targets from an earlier run's "
                   "raw data in JSON, rewrite it, and redraw the PNG next to it")
    return p.parse_args(argv)


def replot(json_path: Path) -> int:
    doc = json.loads(json_path.read_text())
    raw = doc["raw"]
    series = [Series(**s) for s in raw["series"]]
    doc["summary"] = summarize(series, raw["fork"], raw["create"], raw.get("suite"))
    doc["targets"] = evaluate_targets(doc["summary"])
    write_json(json_path, doc)
    png = json_path.with_suffix(".png")
    plot(series, raw["fork"], raw["create"], raw.get("suite"), doc["machine"], png,
         doc.get("mode") == "quick", doc.get("plan", {}).get("checkpoint_mode", "auto"))
    print_summary(doc["summary"], doc["targets"], json_path, png)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replot is not None:
        return replot(args.replot)
    if args.turns is not None and args.turns < 2:
        print("benchmarks.fs_cr: --turns must be at least 2", file=sys.stderr)
        return 2
    if os.geteuid() != 0:
        print("benchmarks.fs_cr: run as root (it starts a private deltaboxd)", file=sys.stderr)
        return 1
    if args.quick:
        plan = Plan(turns=args.turns or 20, fork_reps=3, fork_count=16, creates=10,
                    suite_reps=2, suite_warmup=True, seed=args.seed,
                    baseline_reps=args.baseline_reps or 2, checkpoint_mode=args.checkpoint_mode)
    else:
        plan = Plan(turns=args.turns or 100, fork_reps=10, fork_count=16, creates=30,
                    suite_reps=5, suite_warmup=True, seed=args.seed,
                    baseline_reps=args.baseline_reps or 5, checkpoint_mode=args.checkpoint_mode)
    rng = random.Random(args.seed)
    t_start = time.time()
    load_start = os.getloadavg()
    others = other_daemons()
    if others:
        log(f"warning: {len(others)} other deltaboxd process(es) running; timings may be "
            "noisy")

    trees = prepare_sources(args.cache_dir)
    suite_tree = None if args.no_suite else prepare_suite(args.cache_dir)
    rel_files: list[str] = []
    for t in trees:
        rel_files += [f"{t.name}/{p}" for p in list_files(t)]
    log(f"source tree: {len(rel_files)} files from {', '.join(t.name for t in trees)}")

    from deltabox import Sandbox

    series: list[Series] = []
    result: dict[str, Any] = {}
    daemon = PrivateDaemon(parent=args.tmp_parent, keep=args.keep_state)
    with terminate_as_exception():
        try:
            daemon.start()
            machine = machine_info(daemon.socket)
            machine["nfiles"] = len(rel_files)
            machine["baseline_dir_fs"] = fs_type(daemon.scratch)
            log(f"daemon up: store {machine['deltabox'].get('store_backend')}; "
                f"baseline copies on {machine['baseline_dir_fs']}")
            sbx = Sandbox.create(socket=daemon.socket)
            sbx.files.mkdir(SANDBOX_SRC)
            upload: dict[str, Any] = {"bytes": 0, "entries": 0, "ms": 0.0}
            for t in trees:
                data = tar_bytes(t)
                with Timer() as tm:
                    upload["entries"] += sbx.files.upload_tar(SANDBOX_SRC, data)
                upload["ms"] += tm.ms
                upload["bytes"] += len(data)
            log(f"uploaded {upload['entries']} entries ({upload['bytes'] >> 20} MiB) in "
                f"{upload['ms']:.0f} ms")
            os.sync()
            with Timer() as tm:
                cp0 = sbx.checkpoint(mode=plan.checkpoint_mode, label="tree uploaded")
            initial = {"checkpoint_ms": tm.ms, "checkpoint_server_ms": cp0.duration_ms,
                       "files_changed": cp0.files_changed, "upload": upload}
            log(f"first checkpoint (whole tree new): {tm.ms:.1f} ms")

            for k in plan.ks:
                series.append(run_series(daemon, sbx, k, rel_files, plan, rng))
                s = series[-1]
                log(f"k={k}: checkpoint p50 {percentile(s.checkpoint_ms, 50):.2f} ms vs "
                    f"copytree {percentile(s.copytree_ms, 50):.0f} ms; rollback p50 "
                    f"{percentile(s.rollback_ms, 50):.2f} ms vs "
                    f"{percentile(s.rmtree_copytree_ms, 50):.0f} ms")
            fork_cp = sbx.checkpoint(mode=plan.checkpoint_mode, label="fork source")
            fork = run_fork(daemon, sbx, fork_cp, plan)
            sbx.kill()
            create = run_create(daemon, plan)
            suite, suite_error = None, None
            if suite_tree is not None:
                try:
                    suite = run_suite(daemon, suite_tree, plan)
                except Exception as e:  # keep the file-state results
                    suite_error = f"{type(e).__name__}: {e}"
                    log(f"test-suite comparison failed: {suite_error}")

            summary = summarize(series, fork, create, suite)
            targets = evaluate_targets(summary)
            machine["loadavg_start"] = load_start
            machine["loadavg_end"] = os.getloadavg()
            machine["other_deltaboxd_at_start"] = others
            result = {
                "benchmark": "fs_cr",
                "mode": "quick" if args.quick else "full",
                "plan": plan.__dict__,
                "source": {"sdists": SOURCE_SDISTS, "files": len(rel_files),
                           "sandbox_path": SANDBOX_SRC},
                "method": {
                    "timing": "client-side wall time around one SDK call (time.perf_counter)",
                    "checkpoint": f"sbx.checkpoint(mode={plan.checkpoint_mode!r})",
                    "isolation": "os.sync() (untimed) after every baseline copy/delete, so "
                    "its writeback does not land in a DeltaBox timing; the baselines' own "
                    "timings do not include flushing what they wrote",
                    "change": "one untimed sbx.exec appends a line to k random files",
                    "checkpoint_baseline": "shutil.copytree(writable upper dir, new dir, "
                    "symlinks=True) right after the same change, on baseline_reps turns "
                    "per k spread over the series (copytree_turns)",
                    "rollback_baseline": "shutil.rmtree(work copy) + shutil.copytree(saved "
                    "checkpoint copy, work copy); the work copy got the same k changes; on "
                    "baseline_reps turns per k (rmtree_copytree_turns)",
                    "rollback_target": "a random checkpoint of the same k series; the "
                    "restored content is verified (untimed) after every rollback",
                },
                "initial": initial,
                "suite_error": suite_error,
                "summary": summary,
                "targets": targets,
                "raw": {
                    "series": [s.__dict__ for s in series],
                    "fork": fork, "create": create, "suite": suite,
                },
                "duration_s": time.time() - t_start,
            }
        finally:
            daemon.stop()
    if not result:
        return 1
    record_cleanup(result, daemon)
    out = args.out
    json_path = write_json(out / "fs_cr.json", result, machine)
    png_path = out / "fs_cr.png"
    plot(series, fork, create, suite, machine, png_path, args.quick, plan.checkpoint_mode)
    print_summary(result["summary"], result["targets"], json_path, png_path)
    return 0 if not daemon.leaks else 3


if __name__ == "__main__":
    run_main(main)
