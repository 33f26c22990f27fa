"""Replay real coding-agent trajectories with tree-search expansion on DeltaBox and on the
baselines (copytree + replay, docker-commit-style layer copies, restart-and-replay) and the
no-C/R floor, in the same run. See benchmarks/swebench/README.md.

    .venv/bin/python -m benchmarks.swebench.run --quick --out DIR
    .venv/bin/python -m benchmarks.swebench.run --all --out DIR
    .venv/bin/python -m benchmarks.swebench.run --trajectory FILE --mode mcts --out DIR

Writes DIR/results.json (every operation's latency, end-to-end times, DeltaBox's
overhead_pct against the floor, ratios, exit-code and state agreement) and DIR/*.png;
`python -m benchmarks.swebench.report --in DIR` then writes RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import DEFAULT_OUT as COMMON_OUT
from benchmarks.common import (PrivateDaemon, default_cache_dir, log, machine_info, other_daemons,
                               record_cleanup, run_main, terminate_as_exception, write_json)

from . import core, env, report
from .trajectory import TRAJECTORY_DIR, Trajectory, all_files, load

# The quick run: the shortest shell trajectory (18 commands), the shortest marshmallow one
# (74 commands, with pip installs and pytest runs) and the only one made of edits (3).
QUICK = ("mini-swe-agent-gpt-5-mini__psf__requests-5414.json",
         "mini-swe-agent-deepseek-chat-dev__marshmallow-code__marshmallow-1359.json",
         "moatless__psf__requests-1724.json")
DEFAULT_OUT = COMMON_OUT / "swebench"          # benchmarks/out/ is not committed


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.swebench.run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trajectory", action="append", type=Path, default=[], metavar="FILE",
                   help="a trajectory JSON (repeatable); default with --quick: "
                   + ", ".join(QUICK))
    p.add_argument("--all", action="store_true",
                   help=f"every *.json in {TRAJECTORY_DIR}")
    p.add_argument("--mode", action="append", choices=core.MODES, default=[],
                   help="linear | mcts | fanout (repeatable; default all three)")
    p.add_argument("--quick", action="store_true",
                   help="short trajectories, mcts 30 expansions / 14 rollbacks, linear on the "
                   "first 30 actions, fan-out N <= 8, deltabox_turn in mcts only, floor and "
                   "deltabox replayed twice in mcts only")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"default {DEFAULT_OUT}")
    p.add_argument("--systems", default=",".join(core.ORDER),
                   help="comma-separated subset of " + ", ".join(core.ORDER))
    p.add_argument("--expansions", type=int, help="mcts expansions (default 100, --quick 30)")
    p.add_argument("--rollbacks", type=int, help="mcts rollbacks (default 49, --quick 14)")
    p.add_argument("--linear-actions", type=int,
                   help="linear replays the first N actions (default all, --quick 30)")
    p.add_argument("--repeat-modes",
                   help="modes where floor, deltabox and docker_commit run twice (nested "
                   "ABBA), e.g. linear,mcts (default every mode, --quick mcts)")
    p.add_argument("--seed", type=int, default=1, help="mcts selection seed (default 1)")
    p.add_argument("--fanout", help="fan-out counts, e.g. 1,2,4 (default 1,2,4,8,16,32; "
                   "--quick 1,2,4,8)")
    p.add_argument("--replay-fanout-max", type=int,
                   help="largest N restart_replay fans out to (each child replays half the "
                   "trajectory; default 8, --quick 4)")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="per-action timeout in seconds, every system (default 120)")
    p.add_argument("--think", type=float, default=core.Plan.think,
                   help="untimed pause before each decision, every system (the model's "
                   f"thinking; default {core.Plan.think:g} s)")
    p.add_argument("--warmup", type=int, default=core.Plan.warmup_actions,
                   help="actions run untimed once per trajectory before measuring")
    p.add_argument("--sequential", action="store_true",
                   help="run the systems one after another (in linear and mcts too; "
                   "default: there, all of them in lockstep, step by step)")
    p.add_argument("--no-repeat", action="store_true",
                   help="run every system once (default: floor, deltabox, docker_commit, "
                   "docker_commit, deltabox, floor, then the other baselines; the figures "
                   "use the means)")
    p.add_argument("--cache-dir", type=Path, default=default_cache_dir(),
                   help="downloads (sdists, wheelhouses); default %(default)s")
    p.add_argument("--tmp-parent", type=Path, default=Path("/var/tmp"),
                   help="where the private daemon's state dir goes")
    p.add_argument("--keep-state", action="store_true", help="keep the daemon's temp dir")
    p.add_argument("--daemon-arg", action="append", default=[], metavar="ARG",
                   help="extra deltaboxd argument (repeatable), for an A/B of a daemon "
                   "setting, e.g. --daemon-arg=--prewarm-mb=0 (results.json's command line "
                   "records it)")
    return p.parse_args(argv)


def make_plan(args: argparse.Namespace) -> core.Plan:
    systems = tuple(s.strip() for s in args.systems.split(",") if s.strip())
    unknown = set(systems) - set(core.ORDER)
    if unknown:
        raise SystemExit(f"unknown system(s): {sorted(unknown)}")
    if "floor" not in systems or "deltabox" not in systems:
        raise SystemExit("the floor and deltabox are always needed (the figures are ratios)")
    fan = args.fanout or ("1,2,4,8" if args.quick else "1,2,4,8,16,32")
    repeat_modes = {m.strip() for m in (args.repeat_modes or (
        "mcts" if args.quick else ",".join(core.MODES))).split(",") if m.strip()}
    if unknown_modes := repeat_modes - set(core.MODES):
        raise SystemExit(f"unknown mode(s) in --repeat-modes: {sorted(unknown_modes)} "
                         f"(modes: {', '.join(core.MODES)})")
    return core.Plan(
        modes=tuple(dict.fromkeys(args.mode)) or core.MODES,
        systems=tuple(s for s in core.ORDER if s in systems),
        expansions=args.expansions or (30 if args.quick else 100),
        rollbacks=args.rollbacks if args.rollbacks is not None else (14 if args.quick else 49),
        seed=args.seed, fanout_counts=tuple(int(x) for x in fan.split(",")),
        replay_fanout_max=args.replay_fanout_max or (4 if args.quick else 8),
        timeout=args.timeout, think=args.think,
        warmup_actions=args.warmup, repeat=not args.no_repeat, lockstep=not args.sequential,
        repeat_modes=tuple(m for m in core.MODES if m in repeat_modes),
        linear_actions=args.linear_actions or (30 if args.quick else 0),
        turn_modes=("mcts",) if args.quick else ("linear", "mcts"))


def pick_trajectories(args: argparse.Namespace) -> list[Trajectory]:
    files = list(args.trajectory)
    if args.all:
        files += all_files()
    if not files:
        if not args.quick:
            raise SystemExit("give --trajectory FILE, --all or --quick")
        files = [TRAJECTORY_DIR / q for q in QUICK]
    return [load(f) for f in dict.fromkeys(files)]


def run(args: argparse.Namespace) -> int:
    plan = make_plan(args)
    trajs = pick_trajectories(args)
    t_start = time.time()
    load_start = os.getloadavg()
    others = other_daemons()
    if others:
        log(f"warning: {len(others)} other deltaboxd process(es) running; timings may be noisy")
    # Downloads first (host side, network), so a failure there costs no daemon start.
    hosts = {t.path: env.prepare_host(t, args.cache_dir) for t in trajs}
    command = " ".join(["python -m benchmarks.swebench.run", *sys.argv[1:]])
    kind = "quick" if args.quick else "full"
    done: list[dict[str, Any]] = []
    errors: list[dict[str, Any]] = []
    doc = core.results_doc(done, plan, command, kind, errors)
    machine: dict[str, Any] = {}
    daemon = PrivateDaemon(parent=args.tmp_parent, keep=args.keep_state,
                           extra_args=args.daemon_arg)
    json_path = args.out / "results.json"
    with terminate_as_exception():
        try:
            daemon.start()
            machine = machine_info(daemon.socket)
            for t in trajs:
                log(f"trajectory {t.name}: {len(t.actions)} actions, {t.spec}")
                try:
                    done.append(core.replay_trajectory(
                        daemon.socket, daemon.state_dir, daemon.scratch, t, hosts[t.path], plan))
                except Exception as e:      # one broken task must not lose the others
                    log(f"trajectory {t.name} failed: {type(e).__name__}: {e}")
                    errors.append({"trajectory": t.name, "error": f"{type(e).__name__}: "
                                   f"{e}"[:3000]})
                doc = core.results_doc(done, plan, command, kind, errors)
                write_json(json_path, doc, machine)     # partial results survive a crash
        finally:
            daemon.stop()
    doc = core.results_doc(done, plan, command, kind, errors)
    doc["duration_s"] = time.time() - t_start
    machine.update(loadavg_start=load_start, loadavg_end=os.getloadavg(),
                   other_deltaboxd_at_start=others)
    record_cleanup(doc, daemon)
    write_json(json_path, doc, machine)
    pngs = report.plots(doc | {"machine": machine}, args.out)
    report.print_summary(doc)
    print(f"JSON: {json_path}")
    for p in pngs:
        print(f"PNG:  {p}")
    if doc["errors"]:
        return 1
    return 0 if not daemon.leaks else 3


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        print("benchmarks.swebench.run: run as root (it starts a private deltaboxd)",
              file=sys.stderr)
        return 1
    return run(args)


if __name__ == "__main__":
    run_main(main)
