"""A/B of one native step between builds: making or releasing a template of a process.

Builds libdbxcr.so from each git revision given (`git archive` of native/, the Makefile's
source list and flags) or takes the working tree's, loads them side by side in one process
(ctypes, RTLD_LOCAL: each keeps its own symbols) and times `dbxcr_make_template` (or, with
`--step release`, `dbxcr_release_template`) on one sleeping python, the builds taking turns
in rotating order. `--target child`: the python is the child of another sleeping python
(a live parent, which a release since stop 65 holds while the template ends; since stop
66 the template is made through an intermediate and is an orphan, native/orphan.c)
instead of ours. This process is a child subreaper, so orphaned templates come to it
(not to the machine's init) and are reaped after their release. Writes JSON (p50, mean
per build and each build's p50 over the first one's).

    .venv/bin/python -m benchmarks.template_ab --rev 12dfd2b --rev worktree --reps 600
    .venv/bin/python -m benchmarks.template_ab --rev f1ecfbf --rev worktree --step release \
        --target child --reps 300
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_PR_SET_CHILD_SUBREAPER = 36
_WALL = 0x40000000
CFLAGS = ["-O2", "-g", "-Wall", "-Wextra", "-Werror", "-std=gnu11", "-D_GNU_SOURCE",
          "-pthread", "-fPIC", "-shared"]


class _Err(ctypes.Structure):
    _fields_ = [("code", ctypes.c_int), ("msg", ctypes.c_char * 512)]


def build(rev: str, into: Path) -> Path:
    """libdbxcr.so of `rev` ("worktree": the checkout's native/ as it is)."""
    src = into / rev
    src.mkdir()
    if rev == "worktree":
        subprocess.run(["cp", "-r", str(ROOT / "native"), str(src)], check=True)
    else:
        tar = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "native", "Makefile"],
                             check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(src)], input=tar, check=True)
    makefile = src / "Makefile" if (src / "Makefile").exists() else ROOT / "Makefile"
    sources = subprocess.run(["make", "-s", "--no-print-directory", "-f", str(makefile),
                              "dbxcr-sources"], cwd=src, check=True, capture_output=True,
                             text=True).stdout.split()
    out = src / "libdbxcr.so"
    subprocess.run(["cc", *CFLAGS, "-o", str(out), *sources], cwd=src, check=True)
    return out


def load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path), use_errno=True)
    lib.dbxcr_make_template.argtypes = [ctypes.c_int, ctypes.POINTER(_Err)]
    lib.dbxcr_make_template.restype = ctypes.c_void_p
    lib.dbxcr_release_template.argtypes = [ctypes.c_void_p, ctypes.POINTER(_Err)]
    lib.dbxcr_release_template.restype = ctypes.c_int
    return lib


def measure(libs: dict[str, ctypes.CDLL], pid: int, reps: int,
            step: str = "make") -> dict[str, list[float]]:
    names = list(libs)
    out: dict[str, list[float]] = {n: [] for n in names}
    err = _Err()
    for i in range(reps):
        for name in names[i % len(names):] + names[:i % len(names)]:
            t0 = time.perf_counter()
            tpl = libs[name].dbxcr_make_template(pid, ctypes.byref(err))
            t1 = time.perf_counter()
            if not tpl:
                raise RuntimeError(f"{name}: make_template: {err.msg.decode()}")
            if libs[name].dbxcr_release_template(tpl, ctypes.byref(err)) != 0:
                raise RuntimeError(f"{name}: release: {err.msg.decode()}")
            t2 = time.perf_counter()
            _reap_orphans()
            out[name].append(((t1 - t0) if step == "make" else (t2 - t1)) * 1e6)
    return out


def _reap_orphans() -> None:
    """Released orphaned templates handed to us, their subreaper."""
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG | _WALL)[0] == 0:
                return
        except ChildProcessError:
            return


# A sleeping python; as `child`, the child of another that prints its pid.
LONE = "import time\nwhile True: time.sleep(1000)"
PARENT = ("import os, time\npid = os.fork()\nif pid == 0:\n    while True: time.sleep(1000)\n"
          "print(pid, flush=True)\nwhile True: time.sleep(1000)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rev", action="append", required=True,
                    help="a git revision, or `worktree`; the first is the baseline")
    ap.add_argument("--reps", type=int, default=600, help="templates per build (600)")
    ap.add_argument("--step", choices=("make", "release"), default="make",
                    help="what is timed (make)")
    ap.add_argument("--target", choices=("lone", "child"), default="lone",
                    help="a python whose parent is this process (lone) or another python")
    ap.add_argument("--out", default="benchmarks/out/template_ab.json")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("template_ab: needs root (ptrace of the target)", file=sys.stderr)
        return 1
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        print("template_ab: prctl(PR_SET_CHILD_SUBREAPER) failed", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix="dbx-template-ab-") as tmp:
        libs = {rev: load(build(rev, Path(tmp))) for rev in args.rev}
        target = subprocess.Popen([sys.executable, "-c",
                                   PARENT if args.target == "child" else LONE],
                                  stdout=subprocess.PIPE, text=True)
        child = int(target.stdout.readline()) if args.target == "child" else None
        try:
            time.sleep(0.3)
            raw = measure(libs, child or target.pid, args.reps, args.step)
        finally:
            if child:
                os.kill(child, 9)
            target.kill()
            target.wait()
    base = statistics.median(raw[args.rev[0]])
    res = {"command": " ".join(shlex.quote(a) for a in sys.argv),
           "step": args.step, "target": args.target,
           "builds": {n: dict(p50_us=round(statistics.median(v), 1),
                              mean_us=round(statistics.mean(v), 1), n=len(v),
                              p50_over_first=round(statistics.median(v) / base, 3))
                      for n, v in raw.items()}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(json.dumps(res["builds"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
