"""A notebook kernel, the way a code-interpreter agent runs Python: a Jupyter kernel
(ipykernel: nine threads, ZeroMQ over loopback TCP) started in the sandbox and driven by a
client (jupyter_client's BlockingKernelClient) in it. Checkpoint and rollback latency against
restart-and-replay (a new client and kernel, every cell run again: what a sandbox without
process state does to get back to a node), measured in the same run; and the state the
rollback brings back, checked.

Setup (untimed, cached on the host): `pip download` of ipykernel and jupyter_client with
the sandbox's interpreter (`/usr/bin/python3`), uploaded as a wheelhouse and installed
into a venv inside the sandbox (sandboxes have no network). The client starts the kernel
and runs --cells cells, the agent's session so far (together they hold about --mb MiB:
a list of floats, a dict, functions, a counter).

Each rep: a cell bumps the counter, `checkpoint()` (timed); a cell changes the state;
`rollback()` (timed); a cell reads the state, which must be the checkpoint's; then the
baseline: the client and kernel are killed, started again and every cell is run again
(timed until the same state is back). Client-side latency through the SDK; the daemon's
own duration beside it. JSON and a PNG to --out (default benchmarks/out).

    .venv/bin/python -m benchmarks.notebook [--reps 10] [--cells 8] [--mb 50]
"""

from __future__ import annotations

import argparse
import hashlib
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (DEFAULT_OUT, PrivateDaemon, default_cache_dir, finish_figure,
                               latency_boxplot, log, machine_info, pyplot, record_cleanup,
                               run_main, stats, terminate_as_exception, wait_until,
                               write_json)
from benchmarks.swebench.env import SANDBOX_PYTHON, _pip, tar_of_contents
from deltabox import Sandbox

PACKAGES = ["ipykernel", "jupyter_client"]
VENV = "/opt/notebook-venv"
WHEELS = "/opt/notebook-wheels"

CLIENT = r"""
import os, sys, time
from jupyter_client import BlockingKernelClient, KernelManager
W = "/workspace/"
if sys.argv[1:] == ["manager"]:   # the kernel is our child, watching us (ParentPollerUnix)
    km = KernelManager(kernel_name="python3")
    km.start_kernel()
    kc = km.client()
else:   # the shell started the kernel
    while not os.path.exists(W + "kernel.json"):   # written by the kernel once it listens
        time.sleep(0.01)
    time.sleep(0.05)
    kc = BlockingKernelClient(connection_file=W + "kernel.json")
    kc.load_connection_file()
kc.start_channels()
kc.wait_for_ready(timeout=120)

def run(code):
    msg_id = kc.execute(code)
    out = []
    while True:
        m = kc.get_iopub_msg(timeout=120)
        if m["parent_header"].get("msg_id") != msg_id:
            continue
        if m["msg_type"] == "stream":
            out.append(m["content"]["text"])
        elif m["msg_type"] == "execute_result":
            out.append(m["content"]["data"]["text/plain"])
        elif m["msg_type"] == "error":
            out.append("error: " + m["content"]["ename"])
        elif m["msg_type"] == "status" and m["content"]["execution_state"] == "idle":
            return "".join(out).strip()

for cell in open(W + "cells.py").read().split("\n#%%\n"):
    run(cell)
open(W + "kernel-ready", "w").close()
while True:
    time.sleep(0.002)
    if os.path.exists(W + "ask"):
        code = open(W + "ask").read()
        os.remove(W + "ask")
        open(W + ".answer", "w").write(run(code))
        os.rename(W + ".answer", W + "answer")
"""

# The agent's session: each cell builds a little more state.
FIRST_CELLS = [
    "import math, random, zlib\nrandom.seed(7)\nx = 0",
    "data = [random.random() for _ in range({n})]",
    "table = {{i: str(i) * 3 for i in range(20000)}}",
    "def summary():\n    return f'x={{x}} n={{len(data)}} crc={{zlib.crc32(repr(data[:1000]).encode())}}"
    " t={{len(table)}}'",
]
STATE = "print(summary())"


def cells(count: int, mb: int) -> str:
    """The session's cells: FIRST_CELLS, then small steps up to `count`."""
    n = mb * (1 << 20) // 32           # a float in a list: ~32 bytes
    out = [c.format(n=n) for c in FIRST_CELLS]
    out += [f"step_{i} = sum(data[:{1000 * (i + 1)}])" for i in range(max(0, count - len(out)))]
    return "\n#%%\n".join(out)


def wheelhouse(cache: Path) -> Path:
    """The packages' wheels with their dependencies, for the sandbox's interpreter (cached)."""
    dest = cache / "notebook" / "wheelhouse"
    marker = dest / f".complete-{hashlib.sha256(' '.join(PACKAGES).encode()).hexdigest()[:12]}"
    if not marker.exists():
        dest.mkdir(parents=True, exist_ok=True)
        log(f"downloading {', '.join(PACKAGES)} and their dependencies ...")
        r = _pip(["download", "-q", "--only-binary", ":all:", "--dest", str(dest), *PACKAGES])
        if r.returncode != 0:
            raise RuntimeError(f"pip download failed:\n{r.stderr[-2000:]}")
        marker.touch()
    return dest


def setup(d: PrivateDaemon, cache: Path, n_cells: int, mb: int) -> Sandbox:
    """A sandbox with the venv installed (untimed)."""
    sbx = Sandbox.create(socket=d.socket)
    sbx.files.upload_tar(WHEELS, tar_of_contents(wheelhouse(cache)))
    r = sbx.exec(f"{SANDBOX_PYTHON} -m venv {VENV} && {VENV}/bin/pip install -q --no-index "
                 f"--find-links {WHEELS} {' '.join(PACKAGES)}", timeout=600)
    if r.exit_code != 0:
        raise RuntimeError(f"installing {PACKAGES} in the sandbox failed: {r.stderr[-2000:]}")
    sbx.files.write("client.py", CLIENT)
    sbx.files.write("cells.py", cells(n_cells, mb))
    return sbx


def start(sbx: Sandbox, launch: str = "manager") -> float:
    """Start the kernel and its client and run every cell: ms until they are done.
    `manager`: the client starts the kernel (jupyter_client's KernelManager, as a Jupyter
    server does): the kernel is its child and exits once its parent is gone (ipykernel's
    ParentPollerUnix: getppid() == 1), so it needs its parent back at every restore
    (adopted since stop 53: its memory copied); `shell`: the shell starts both, the
    kernel a child of init (before stop 53 the only way a rollback kept it)."""
    for name in ("kernel-ready", "kernel.json"):
        if sbx.files.exists(name):
            sbx.files.remove(name)
    t0 = time.perf_counter()
    if launch == "manager":
        sbx.exec(f"cd /workspace && (nohup {VENV}/bin/python client.py manager "
                 ">client.log 2>&1 &)")
    else:
        sbx.exec(f"cd /workspace && (nohup {VENV}/bin/python -m ipykernel_launcher "
                 "-f /workspace/kernel.json >kernel.log 2>&1 &) && "
                 f"(nohup {VENV}/bin/python client.py >client.log 2>&1 &)")
    wait_until(lambda: sbx.files.exists("kernel-ready"), "the kernel and its cells", 120)
    return (time.perf_counter() - t0) * 1000


def ask(sbx: Sandbox, code: str) -> str:
    """Run a cell through the client; its output."""
    if sbx.files.exists("answer"):
        sbx.files.remove("answer")
    sbx.files.write("ask", code)
    wait_until(lambda: sbx.files.exists("answer"), f"the cell {code!r}", 120)
    return sbx.files.read("answer").decode()


def restart_and_replay(sbx: Sandbox, step: str, want: str, launch: str) -> float:
    """Kill the client and kernel, start them again, run every cell and the step to the
    checkpoint's state again: ms until the state is back."""
    sbx.exec(f"pkill -9 -f '{VENV}/bin/python' || true")
    t0 = time.perf_counter()
    start(sbx, launch)
    got = ask(sbx, step + STATE)
    ms = (time.perf_counter() - t0) * 1000
    if got != want:
        raise RuntimeError(f"the replay reached {got!r}, not {want!r}")
    return ms


def one_rep(sbx: Sandbox, rep: int, think: float, launch: str) -> dict[str, Any]:
    """Step, checkpoint; change, roll back; check; then the baseline back to the same
    state (the session's cells and this rep's step)."""
    step = f"x = {rep + 1}\n"
    want = ask(sbx, step + STATE)
    time.sleep(think)
    t0 = time.perf_counter()
    cp = sbx.checkpoint()
    ck = (time.perf_counter() - t0) * 1000
    if cp.kind != "full":
        raise RuntimeError(f"checkpoint kind {cp.kind}: {cp.reasons}")
    ask(sbx, "x += 100\ndata.append(1.5)\ntable.clear()")
    time.sleep(think)
    t0 = time.perf_counter()
    rb = sbx.rollback(cp)
    rb_ms = (time.perf_counter() - t0) * 1000
    if rb.process_state != "restored":
        raise RuntimeError(f"rollback: {rb.process_state}: {rb.note}")
    got = ask(sbx, STATE)
    if got != want:
        raise RuntimeError(f"after the rollback the kernel reports {got!r}, not {want!r}")
    replay = restart_and_replay(sbx, step, want, launch)
    return {"checkpoint": ck, "checkpoint_server": cp.duration_ms, "rollback": rb_ms,
            "rollback_server": rb.duration_ms, "restart_replay": replay, "state": want}


OPS = ("checkpoint", "checkpoint_server", "rollback", "rollback_server", "restart_replay")


def plot(runs: list[dict[str, Any]], path: Path, machine: dict[str, Any]) -> Path | None:
    try:
        plt = pyplot()
    except ImportError:
        return None
    groups = {"notebook kernel": {op: [r[op] for r in runs] for op in OPS}}
    fig, ax = plt.subplots(figsize=(9, 4.5))
    latency_boxplot(ax, groups, log_scale=True)
    finish_figure(fig, path, "Jupyter kernel (client; _server: daemon)", machine)
    return path


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.notebook", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--cells", type=int, default=8, help="cells of the session (>= 4)")
    p.add_argument("--mb", type=int, default=50, help="memory the cells build (MiB)")
    p.add_argument("--think", type=float, default=0.3, help="pause before each op (s)")
    p.add_argument("--launch", choices=("manager", "shell"), default="manager",
                   help="who starts the kernel: the client (a KernelManager, the kernel "
                        "its child, as under a Jupyter server) or the shell")
    p.add_argument("--cache-dir", type=Path, default=default_cache_dir())
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args()
    runs: list[dict[str, Any]] = []
    with terminate_as_exception(), PrivateDaemon() as d:
        sbx = setup(d, args.cache_dir, args.cells, args.mb)
        try:
            first_start = start(sbx, args.launch)
            one_rep(sbx, -1, args.think, args.launch)  # warm-up
            for rep in range(args.reps):
                runs.append({"rep": rep, **one_rep(sbx, rep, args.think, args.launch)})
                log(f"rep {rep + 1}/{args.reps}: rollback {runs[-1]['rollback']:.1f} ms, "
                    f"restart and replay {runs[-1]['restart_replay']:.0f} ms")
        finally:
            sbx.kill()
        summary = {op: stats([r[op] for r in runs]) for op in OPS}
        summary["replay_over_rollback_p50"] = (summary["restart_replay"]["p50"] /
                                               summary["rollback"]["p50"])
        result: dict[str, Any] = {"benchmark": "notebook", "reps": args.reps,
                                  "cells": args.cells, "mb": args.mb, "think_s": args.think,
                                  "launch": args.launch,
                                  "packages": PACKAGES, "first_start_ms": first_start,
                                  "runs": runs, "summary": summary}
        info = machine_info(d.socket)
    record_cleanup(result, d)
    path = write_json(args.out / "notebook.json", result, info)
    png = plot(runs, args.out / "notebook.png", info)
    s = result["summary"]
    print(f"checkpoint p50 {s['checkpoint']['p50']:.2f} ms (daemon "
          f"{s['checkpoint_server']['p50']:.2f}) | rollback p50 {s['rollback']['p50']:.2f} ms "
          f"(daemon {s['rollback_server']['p50']:.2f}) | restart and replay p50 "
          f"{s['restart_replay']['p50']:.0f} ms = {s['replay_over_rollback_p50']:.0f}x the "
          "rollback")
    print(f"wrote {path}" + (f" and {png}" if png else ""))
    return 0


if __name__ == "__main__":
    run_main(main)
