"""Headless Chromium, the way a browsing agent or a Playwright test drives it: a browser
(a dozen processes: zygotes, GPU, network and storage services, renderers) started in the
sandbox with its DevTools endpoint, a page open whose JavaScript state the agent built.
Checkpoint, rollback and fork latency against restart-and-replay (the browser killed,
started again and the page opened and its state built again: what a sandbox without
process state does to get back to a node), measured in the same run; and the state each
restore brings back, checked (tests/cdp_client.py evaluates JavaScript in the page).

Each rep: the page's counter is bumped, `checkpoint()` (timed); the page changes;
`rollback()` (timed) and the page must show the checkpoint's counter; `fork()` of one child
(timed) whose page must show it too, the child killed; then the baseline: every Chromium
process killed, the browser started again, the page opened and its counter set (timed
until the page answers with it). Client-side latency through the SDK; the daemon's own
duration beside it. JSON to --out (default benchmarks/out).

    .venv/bin/python -m benchmarks.chromium_cr [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (DEFAULT_OUT, PrivateDaemon, log, machine_info, record_cleanup,
                               run_main, stats, terminate_as_exception, wait_until,
                               write_json)
from deltabox import Sandbox

PORT = 9230
CHROMIUM = (f"nohup chromium --headless=new --no-sandbox --disable-gpu "
            f"--remote-debugging-port={PORT} about:blank >/tmp/chromium.log 2>&1 &")
PAGE = "data:text/html,<title>marker</title>"
ITS = "'^/usr/lib/chromium/'"    # its processes' command lines (not the shell's running pkill)
CLIENT = Path(__file__).resolve().parent.parent / "tests" / "cdp_client.py"
OPS = ("checkpoint", "checkpoint_server", "rollback", "rollback_server", "fork",
       "restart_replay")


def _page(box: Sandbox, expr: str) -> Any:
    r = box.exec(["python3", "/workspace/cdp_client.py", str(PORT), "marker", expr],
                 timeout=60)
    if r.exit_code != 0:
        raise RuntimeError(f"the page did not answer: {r.stderr[-500:]}")
    return json.loads(r.stdout)


def start(box: Sandbox, n: int) -> None:
    """The browser started, the page open, its counter set to n."""
    box.exec(CHROMIUM)
    wait_until(lambda: box.exec(f"curl -sf 127.0.0.1:{PORT}/json/version").exit_code == 0,
               "chromium's DevTools endpoint", timeout=60)
    box.exec(f"curl -sf -X PUT '127.0.0.1:{PORT}/json/new?{PAGE}'")
    wait_until(lambda: "marker" in box.exec(f"curl -sf 127.0.0.1:{PORT}/json/list").stdout,
               "the page", timeout=30)
    if _page(box, f"window.n = {n}") != n:
        raise RuntimeError("the page's counter was not set")


def one_rep(sbx: Sandbox, think: float) -> dict[str, float]:
    n = _page(sbx, "window.n += 1")
    time.sleep(think)
    t = time.perf_counter()
    cp = sbx.checkpoint(mode="full")
    out = {"checkpoint": (time.perf_counter() - t) * 1000, "checkpoint_server": cp.duration_ms}
    _page(sbx, "window.n += 100")
    time.sleep(think)
    t = time.perf_counter()
    r = sbx.rollback(cp)
    out["rollback"] = (time.perf_counter() - t) * 1000
    out["rollback_server"] = r.duration_ms
    if r.process_state != "restored" or _page(sbx, "window.n") != n:
        raise RuntimeError(f"the rollback did not bring the page back: {r.note}")
    time.sleep(think)
    t = time.perf_counter()
    kid = sbx.fork(cp)[0]
    out["fork"] = (time.perf_counter() - t) * 1000
    try:
        if kid.process_state != "restored" or _page(kid, "window.n") != n:
            raise RuntimeError(f"the fork did not bring the page back: {kid.fork_note}")
    finally:
        kid.kill()
    t = time.perf_counter()
    sbx.exec(f"pkill -9 -f {ITS}; while pgrep -f {ITS} >/dev/null; do sleep 0.01; done")
    start(sbx, n)
    out["restart_replay"] = (time.perf_counter() - t) * 1000
    return out


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.chromium_cr", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--think", type=float, default=2.0,
                   help="pause before each op (s): the warm pool prepares meanwhile")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args()
    runs: list[dict[str, Any]] = []
    with terminate_as_exception(), PrivateDaemon() as d:
        sbx = Sandbox.create(socket=d.socket)
        try:
            sbx.files.write("cdp_client.py", CLIENT.read_text())
            t = time.perf_counter()
            start(sbx, 0)
            first_start = (time.perf_counter() - t) * 1000
            procs = int(sbx.exec(f"pgrep -c -f {ITS}").stdout or 0)
            for rep in range(args.reps):
                runs.append({"rep": rep, **one_rep(sbx, args.think)})
                log(f"rep {rep + 1}/{args.reps}: checkpoint {runs[-1]['checkpoint']:.0f} ms, "
                    f"rollback {runs[-1]['rollback']:.0f} ms, fork {runs[-1]['fork']:.0f} ms, "
                    f"restart and replay {runs[-1]['restart_replay']:.0f} ms")
        finally:
            sbx.kill()
        summary: dict[str, Any] = {op: stats([r[op] for r in runs]) for op in OPS}
        summary["replay_over_rollback_p50"] = (summary["restart_replay"]["p50"] /
                                               summary["rollback"]["p50"])
        result: dict[str, Any] = {"benchmark": "chromium_cr", "reps": args.reps,
                                  "think_s": args.think, "processes": procs,
                                  "first_start_ms": first_start, "runs": runs,
                                  "summary": summary}
        info = machine_info(d.socket)
    record_cleanup(result, d)
    path = write_json(args.out / "chromium_cr.json", result, info)
    s = result["summary"]
    print(f"{procs} processes | checkpoint p50 {s['checkpoint']['p50']:.0f} ms (daemon "
          f"{s['checkpoint_server']['p50']:.0f}) | rollback p50 {s['rollback']['p50']:.0f} ms "
          f"(daemon {s['rollback_server']['p50']:.0f}) | fork p50 {s['fork']['p50']:.0f} ms | "
          f"restart and replay p50 {s['restart_replay']['p50']:.0f} ms = "
          f"{s['replay_over_rollback_p50']:.2f}x the rollback")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    run_main(main)
