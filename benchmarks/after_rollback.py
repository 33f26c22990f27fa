"""The first command after a rollback: how much slower than the same command without one,
on two private daemons in the same run that differ in one setting (`--ab`):

- `read_ahead` (default): with the warm pool's read-ahead (fs/prewarm.py) and without it
  (`--prewarm-mb 0`);
- `quiet_wait`: the work a rollback leaves (the next rollback's preparation, the killed
  processes' teardown, the old mount) waiting for the command after it (daemon/foreground.py)
  and starting at once (`--quiet-wait-ms 0`).

A rollback gives the sandbox a new generation: a fresh overlay mount (no dentries yet) over
a btrfs clone of the checkpoint (new inodes: the page cache of every file the sandbox wrote
is gone). Each daemon holds one sandbox set up by the kind's files, checkpointed; each rep,
in each daemon (the daemons' order alternating), times the kind's command right after a
rollback to that checkpoint (`after_rollback`), and without one (`no_rollback`), each after
a pause (`--think`: the warm pool prepares the next rollback meanwhile). Kinds:

- `written`: Python imports ~600 module files copied into the sandbox's own layer, then
  cats them all (what an agent's repository and its `__pycache__` are);
- `packages`: Python imports grpc, protobuf and pydantic unpacked into the sandbox's own
  layer (what a `pip install` in the sandbox makes; grpc's library alone is 17 MB);
- `image`: Python imports a dozen standard-library modules of the image (its page cache
  survives; its overlay dentries do not);
- `startups`: what an agent's step mostly is: a few programs started (`true`, `python3 -c
  pass` twice, then the `image` kind's imports), in a bash session the checkpoint holds
  (the rollback brings the shell back; the others run through `exec`).

Reported per kind and arm: p50s and the after-rollback excess (p50 difference) with the
read-ahead against without it. JSON (and a PNG) to --out (default benchmarks/out).

    .venv/bin/python -m benchmarks.after_rollback [--kinds written,packages,image] [--reps 16]
    .venv/bin/python -m benchmarks.after_rollback --ab quiet_wait --kinds startups,image
"""

from __future__ import annotations

import argparse
import io
import site
import tarfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (DEFAULT_OUT, PrivateDaemon, finish_figure, latency_boxplot, log,
                               machine_info, pyplot, record_cleanup, run_main, stats,
                               terminate_as_exception, write_json)
from deltabox import Sandbox

LIB = "/root/lib"
PKGS = "/root/pkgs"
PACKAGES = ("grpc", "google", "pydantic", "pydantic_core", "typing_extensions.py",
            "annotated_types", "typing_inspection")
STDLIB = ("json", "email", "http", "xml")
SETUP = {
    "written": (f"mkdir -p {LIB} && " + " && ".join(
        f"cp -r $(python3 -c 'import {m}, os; print(os.path.dirname({m}.__file__))') {LIB}/"
        for m in STDLIB) + f" && python3 -m compileall -q {LIB} > /dev/null"),
    "packages": f"mkdir -p {PKGS}",
    "image": "true",
    "startups": "true",
}
COMMAND = {
    "written": (f"python3 -c 'import sys; sys.path.insert(0, \"{LIB}\"); import json, "
                f"email.mime.text, http.client, xml.dom.minidom' && "
                f"find {LIB} -type f -exec cat {{}} + > /dev/null"),
    "packages": (f"python3 -c 'import sys; sys.path.insert(0, \"{PKGS}\"); import grpc, "
                 "google.protobuf.descriptor_pool, pydantic, pydantic_core'"),
    "image": ("python3 -c 'import json, decimal, email.mime.text, http.client, "
              "xml.dom.minidom, asyncio, unittest, argparse, logging, sqlite3, csv, tarfile'"),
}
COMMAND["startups"] = "true && python3 -c pass && python3 -c pass && " + COMMAND["image"]
SESSION_KINDS = ("startups",)
# --ab: two arms, each a daemon's extra arguments; the first is the default setting
AB = {"read_ahead": {"read_ahead": [], "none": ["--prewarm-mb", "0"]},
      "quiet_wait": {"waits": [], "at_once": ["--quiet-wait-ms", "0"]}}


def packages_tar() -> bytes:
    """This interpreter's own grpc, protobuf and pydantic (the sandbox runs the image's
    python3: the same minor version as the venv's on these machines)."""
    sp = Path(site.getsitepackages()[0])
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name in PACKAGES:
            tf.add(sp / name, arcname=name)
    return buf.getvalue()


def prepare(sbx: Sandbox, kind: str) -> Any:
    """The kind's files in the sandbox's own layer, the command run once, a checkpoint."""
    r = sbx.exec(["bash", "-c", SETUP[kind]])
    if r.exit_code != 0:
        raise RuntimeError(f"{kind} setup failed: {r.stderr[-500:]}")
    if kind == "packages":
        sbx.files.upload_tar(PKGS, packages_tar())
    if kind in SESSION_KINDS:
        sbx.session("main").run("cd /root && export STEP=1")
    run(sbx, kind)
    return sbx.checkpoint(label=kind)


def run(sbx: Sandbox, kind: str) -> float:
    t0 = time.perf_counter()
    if kind in SESSION_KINDS:
        r = sbx.session("main").run(COMMAND[kind])
    else:
        r = sbx.exec(["bash", "-c", COMMAND[kind]])
    ms = (time.perf_counter() - t0) * 1000
    if r.exit_code != 0:
        raise RuntimeError(f"{kind}: exit {r.exit_code}: {r.stderr[-500:]}")
    return ms


def measure(kind: str, daemons: dict[str, PrivateDaemon], reps: int, think: float
            ) -> list[dict[str, Any]]:
    sandboxes = {arm: Sandbox.create(socket=d.socket) for arm, d in daemons.items()}
    runs: list[dict[str, Any]] = []
    try:
        cps = {arm: prepare(sbx, kind) for arm, sbx in sandboxes.items()}
        arms = list(daemons)
        for rep in range(reps):
            order = arms if rep % 2 == 0 else arms[::-1]
            for way in (("after_rollback", "no_rollback") if rep % 2 == 0
                        else ("no_rollback", "after_rollback")):
                for arm in order:
                    sbx = sandboxes[arm]
                    time.sleep(think)
                    rb_ms = 0.0
                    if way == "after_rollback":
                        t0 = time.perf_counter()
                        sbx.rollback(cps[arm])
                        rb_ms = (time.perf_counter() - t0) * 1000
                    runs.append({"kind": kind, "arm": arm, "way": way, "rep": rep,
                                 "ms": run(sbx, kind), "rollback_ms": rb_ms})
    finally:
        for sbx in sandboxes.values():
            sbx.kill()
    return runs


WAYS = ("after_rollback", "no_rollback")


def times(runs: list[dict[str, Any]], kind: str, arm: str, way: str) -> list[float]:
    return [r["ms"] for r in runs if (r["kind"], r["arm"], r["way"]) == (kind, arm, way)]


def summarize(runs: list[dict[str, Any]], arms: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in dict.fromkeys(r["kind"] for r in runs):
        per: dict[str, Any] = {}
        for arm in arms:
            by = {w: stats(times(runs, kind, arm, w)) for w in WAYS}
            per[arm] = {**by, "excess_ms_p50": by["after_rollback"]["p50"] -
                        by["no_rollback"]["p50"]}
        out[kind] = per
    return out


def plot(runs: list[dict[str, Any]], arms: list[str], path: Path, machine: dict[str, Any]
         ) -> Path | None:
    try:
        plt = pyplot()
    except ImportError:
        return None
    groups = {f"{kind}, {arm}": {w: times(runs, kind, arm, w) for w in WAYS}
              for kind in dict.fromkeys(r["kind"] for r in runs) for arm in arms}
    fig, ax = plt.subplots(figsize=(11, 4.5))
    latency_boxplot(ax, groups, log_scale=False)
    finish_figure(fig, path, f"a command right after a rollback and without one: "
                  f"{' / '.join(arms)}", machine)
    return path


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.after_rollback", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kinds", default="written,packages,image",
                   help="comma-separated, of: " + ", ".join(COMMAND))
    p.add_argument("--reps", type=int, default=16)
    p.add_argument("--think", type=float, default=0.3, help="pause before each command (s)")
    p.add_argument("--ab", choices=list(AB), default="read_ahead",
                   help="the daemon setting the two arms differ in (default read_ahead)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args()
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = [k for k in kinds if k not in COMMAND]
    if unknown:
        p.error(f"unknown kind(s) {', '.join(unknown)}: choose from {', '.join(COMMAND)}")
    runs: list[dict[str, Any]] = []
    arms = AB[args.ab]
    (name_a, args_a), (name_b, args_b) = arms.items()
    with terminate_as_exception(), PrivateDaemon(extra_args=args_a) as a, \
            PrivateDaemon(extra_args=args_b) as b:
        daemons = {name_a: a, name_b: b}
        for kind in kinds:
            log(f"{kind}: {args.reps} reps")
            runs += measure(kind, daemons, args.reps, args.think)
        info = machine_info(a.socket)
    result: dict[str, Any] = {"benchmark": "after_rollback", "reps": args.reps,
                              "think_s": args.think, "ab": args.ab, "arms": arms,
                              "commands": {k: COMMAND[k] for k in kinds}, "runs": runs,
                              "summary": summarize(runs, list(arms))}
    record_cleanup(result, a, b)
    path = write_json(args.out / "after_rollback.json", result, info)
    png = plot(runs, list(arms), args.out / "after_rollback.png", info)
    for kind, per in result["summary"].items():
        line = "; ".join(f"{arm}: {per[arm]['after_rollback']['p50']:.1f} after a rollback, "
                         f"{per[arm]['no_rollback']['p50']:.1f} without "
                         f"({per[arm]['excess_ms_p50']:+.1f})" for arm in arms)
        print(f"{kind:9s} p50 ms  {line}")
    print(f"wrote {path}" + (f" and {png}" if png else ""))
    return 0


if __name__ == "__main__":
    run_main(main)
