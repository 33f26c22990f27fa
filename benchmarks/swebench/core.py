"""The runner's core: replay one trajectory in the chosen modes on every system, and
summarise (overhead against the floor, ratios against the baselines, agreement of exit codes
and of state hashes). No daemon management and no downloads here, so tests can drive it
with their own daemon and a tiny local package."""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import log, make_settle, stats

from . import env as envmod
from .modes import (Step, linear_schedule, mcts_schedule, run_fanout, run_tree,
                    run_trees_lockstep, schedule_summary, steps_json)
from .systems import BASELINES, CR_OPS, SYSTEMS, Ctx, run_action
from .trajectory import Trajectory

MODES = ("linear", "mcts", "fanout")
# Order of the systems within a mode: the floor and DeltaBox back to back (their ratio is
# the headline figure), DeltaBox with turn-boundary checkpoints, then the baselines.
ORDER = ("floor", "deltabox", "deltabox_turn", "copytree", "docker_commit", "restart_replay")
# The baseline run twice with floor and DeltaBox (run_order): the one DeltaBox's end-to-end
# time is closest to, so that "every baseline slower" compares two means, not one replay.
REPEATED_BASELINE = "docker_commit"
TURN = "deltabox_turn"    # DeltaBox driven one call per step (systems.DeltaBoxTurn)


@dataclass
class Plan:
    modes: tuple[str, ...] = MODES
    systems: tuple[str, ...] = ORDER
    expansions: int = 100
    rollbacks: int = 49
    seed: int = 1
    fanout_counts: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    replay_fanout_max: int = 8      # restart_replay fans out only up to this N (see README)
    timeout: float = 120.0          # per action, every system
    think: float = 0.2              # untimed pause before each decision (see README)
    warmup_actions: int = 20        # run untimed once per trajectory before measuring
    repeat: bool = True             # floor, deltabox, docker_commit twice, deltabox, floor
    repeat_modes: tuple[str, ...] = MODES   # the modes that repeat (when `repeat`)
    linear_actions: int = 0         # linear replays the first N actions (0: all)
    turn_modes: tuple[str, ...] = ("linear", "mcts")   # where deltabox_turn runs
    lockstep: bool = True           # linear and mcts: every system step by step (see run_mode)

    def json(self) -> dict[str, Any]:
        return asdict(self)


def fanout_mid(traj: Trajectory) -> int:
    """The mid-trajectory checkpoint: after half of the actions (at least one action left)."""
    return min(len(traj.actions) // 2, len(traj.actions) - 1)


def warm_up(ctx: Ctx, n: int) -> float:
    """Run the first n actions once in a throwaway sandbox, so that no system pays for cold
    caches (python imports, the loop device) that the next one gets for free."""
    t0 = time.perf_counter()
    sbx = ctx.fresh()
    try:
        for a in ctx.traj.actions[:n]:
            run_action(ctx, sbx, a)
    finally:
        sbx.kill()
    return (time.perf_counter() - t0) * 1000


def run_mode(ctx: Ctx, mode: str, plan: Plan) -> dict[str, Any]:
    """One trajectory in one mode on every system of the plan: in linear and mcts, all of
    them in lockstep (modes.run_trees_lockstep; the plan's `lockstep`), else one after
    another in run_order."""
    n = len(ctx.traj.actions)
    run: dict[str, Any] = {"trajectory": ctx.traj.name, "mode": mode, "systems": {}}
    steps: list[Step] = []
    if mode == "linear":
        steps = linear_schedule(min(n, plan.linear_actions or n))
        run["schedule"] = schedule_summary(steps, 0)
    elif mode == "mcts":
        steps = mcts_schedule(n, plan.expansions, plan.rollbacks, plan.seed)
        run["schedule"] = schedule_summary(steps, plan.rollbacks)
        run["steps"] = steps_json(steps)
    else:
        run["fanout"] = {"mid": fanout_mid(ctx.traj), "counts": list(plan.fanout_counts),
                         "action": ctx.traj.actions[fanout_mid(ctx.traj)].label(80)}
    run["not_run"] = {}

    def one(name: str) -> dict[str, Any]:
        system = SYSTEMS[name](ctx)
        log(f"{ctx.traj.name[:48]} {mode}: {name} ...")
        if mode == "fanout":
            counts = list(plan.fanout_counts)
            if name == "restart_replay":
                counts = [c for c in counts if c <= plan.replay_fanout_max]
            res = run_fanout(system, run["fanout"]["mid"], counts)
        else:
            res = run_tree(system, steps, linear=mode == "linear")
        log(f"{ctx.traj.name[:48]} {mode}: {name} e2e {res['e2e_ms'] / 1000:.2f} s "
            f"(C/R {res['cr_ms'] / 1000:.2f} s)")
        return res

    run["repeats"] = {}
    run["settle_ms"] = [ctx.settle()]
    keys = []
    for key in run_order(plan, mode):
        name = key.split("#")[0]
        if mode == "linear" and name == "restart_replay":
            run["not_run"][name] = "linear has no rollback: restart-and-replay is the floor"
        elif name == "deltabox_turn" and mode not in plan.turn_modes:
            run["not_run"][name] = ("fan-out takes one checkpoint: nothing to overlap"
                                    if mode == "fanout" else "not in this plan's turn_modes")
        else:
            keys.append(key)
    if plan.lockstep and mode != "fanout":
        run["lockstep"] = keys
        log(f"{ctx.traj.name[:48]} {mode}: {', '.join(keys)} in lockstep ...")
        results, rounds = run_trees_lockstep(
            {key: SYSTEMS[key.split("#")[0]](ctx) for key in keys}, steps,
            linear=mode == "linear", between=ctx.settle)
        run["settle_ms"] += rounds
        for key, res in results.items():
            log(f"{ctx.traj.name[:48]} {mode}: {key} e2e {res['e2e_ms'] / 1000:.2f} s "
                f"(C/R {res['cr_ms'] / 1000:.2f} s)")
            name = key.split("#")[0]
            (run["repeats"] if key.endswith("#2") else run["systems"])[name] = res
    else:
        for key in keys:
            name = key.split("#")[0]
            (run["repeats"] if key.endswith("#2") else run["systems"])[name] = one(name)
            run["settle_ms"].append(ctx.settle())
    run["summary"] = summarize_run(run, ctx.traj)
    return run


def run_order(plan: Plan, mode: str) -> list[str]:
    """floor, deltabox, deltabox_turn, docker_commit, docker_commit again, deltabox_turn
    again, deltabox again, floor again (nested ABBA: a drift of the machine over the run,
    e.g. btrfs cleaning up an earlier system's subvolumes, weighs the same on the floor
    and either form of DeltaBox, and on DeltaBox and REPEATED_BASELINE, the baseline whose
    time is closest to DeltaBox's), then the other baselines once. "#2" marks the repeats.
    Run one after another, this order is what cancels a drift; in lockstep (run_mode) it
    only names the replays. The turn form used to run once after the block: 7-11 % slower
    than the floor through drift (stop 58; in the block, stop 59, its replays came within
    0.5 % of DeltaBox's while the floor's two differed by 10.8 %)."""
    rest = [s for s in plan.systems if s not in ("floor", "deltabox")]
    if not (plan.repeat and mode in plan.repeat_modes):
        return ["floor", "deltabox", *rest]
    paired = [s for s in (TURN, REPEATED_BASELINE) if s in rest
              and (s != TURN or mode in plan.turn_modes)]
    rest = [s for s in rest if s not in paired]
    inner = [*paired, *(f"{s}#2" for s in reversed(paired))]
    return ["floor", "deltabox", *inner, "deltabox#2", "floor#2", *rest]


def replay_trajectory(socket: str, state_dir: Path, scratch: Path, traj: Trajectory,
                      host: envmod.HostEnv, plan: Plan) -> dict[str, Any]:
    """Build the base image for the trajectory and run every mode of the plan."""
    base = envmod.build_base(socket, traj, host)
    out: dict[str, Any] = {"trajectory": traj.describe(), "environment": base.info, "runs": []}
    try:
        ctx = Ctx(socket=socket, state_dir=state_dir, scratch=scratch, traj=traj, env=base,
                  timeout=plan.timeout, think=plan.think, settle=make_settle(socket))
        if plan.warmup_actions:
            out["warmup_ms"] = warm_up(ctx, plan.warmup_actions)
        for mode in plan.modes:
            out["runs"].append(run_mode(ctx, mode, plan))
    finally:
        base.setup_sandbox.kill()
    return out


# ---- summaries ---------------------------------------------------------------------------

def _pct(a: float, floor: float) -> float:
    return (a - floor) / floor * 100.0 if floor else math.nan


def _ratio(a: float, b: float) -> float:
    return a / b if b else math.nan


def op_stats(ops: list[dict[str, Any]]) -> dict[str, Any]:
    """Latency summary per operation kind."""
    kinds = sorted({o["op"] for o in ops})
    return {k: stats([o["ms"] for o in ops if o["op"] == k]) for k in kinds}


def _compare_codes(ref: dict[Any, Any], other: dict[Any, Any]) -> dict[str, Any]:
    keys = [k for k in ref if k in other]
    bad = [{"at": k, "deltabox": ref[k], "other": other[k]} for k in keys if ref[k] != other[k]]
    return {"compared": len(keys), "mismatches": bad, "agree": not bad and bool(keys)}


def _compare_hashes(ref: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    keys = [k for k in ref if k in other]
    bad = [{"at": k, "deltabox": ref[k], "other": other[k]} for k in keys if ref[k] != other[k]]
    return {"compared": len(keys), "mismatches": bad, "agree": not bad and bool(keys)}


def _runs_of(run: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Each system's replays: the first, plus the repeat (run_order) where there is one."""
    out = {name: [r] for name, r in run["systems"].items()}
    for name, r in run.get("repeats", {}).items():
        out.setdefault(name, []).append(r)
    return out


def _mean(rs: list[dict[str, Any]], key: str) -> float:
    return sum(r[key] for r in rs) / len(rs)


def _comparable(runs: dict[str, list[dict[str, Any]]], other: str,
                key: str) -> tuple[float, float]:
    """(other's, DeltaBox's) time over the same work: in fan-out only the N both ran
    (restart_replay stops at --replay-fanout-max), plus the prefix and the checkpoint."""
    a, d = runs[other], runs["deltabox"]
    if "per_n" not in a[0]:
        return _mean(a, key), _mean(d, key)
    common = {n for n in a[0]["per_n"] if n in d[0]["per_n"]}

    def total(r: dict[str, Any]) -> float:
        ops = [o for o in r["ops"] if o.get("phase") in ("prefix", "checkpoint")
               or str(o.get("n")) in common]
        return sum(o["ms"] for o in ops if key == "e2e_ms" or o["op"] in CR_OPS)

    return (sum(map(total, a)) / len(a), sum(map(total, d)) / len(d))


def summarize_run(run: dict[str, Any], traj: Trajectory) -> dict[str, Any]:
    """Floor, DeltaBox and REPEATED_BASELINE figures are the means of their two replays."""
    runs = _runs_of(run)
    out: dict[str, Any] = {"per_system": {}}
    for name, rs in runs.items():
        out["per_system"][name] = {
            "e2e_ms": _mean(rs, "e2e_ms"), "cr_ms": _mean(rs, "cr_ms"),
            "action_ms": _mean(rs, "action_ms"), "e2e_ms_runs": [r["e2e_ms"] for r in rs],
            "ops": op_stats([o for r in rs for o in r["ops"]])}
    floor = out["per_system"].get("floor", {}).get("e2e_ms")
    dbx = run["systems"].get("deltabox")
    if floor:
        for name, rs in runs.items():
            ps = out["per_system"][name]
            ps["over_floor"] = _ratio(ps["e2e_ms"], floor)
            ps["overhead_pct"] = _pct(ps["e2e_ms"], floor)
            for r in rs:
                r["overhead_pct"] = _pct(r["e2e_ms"], floor)    # also beside the raw ops
    for name in ("floor", "deltabox", TURN, REPEATED_BASELINE):
        if len(runs.get(name, [])) == 2:
            # The same replay twice: how far two replays differ on this machine now.
            a, b = runs[name]
            out[f"{name}_repeat_pct"] = _pct(b["e2e_ms"], a["e2e_ms"])
    if dbx is not None:
        dps = out["per_system"]["deltabox"]
        out["overhead_pct"] = dps.get("overhead_pct")
        out["cr_share_pct"] = _ratio(dps["cr_ms"], dps["action_ms"]) * 100.0
        ps = out["per_system"]
        out["comparable_e2e_ms"] = {b: _comparable(runs, b, "e2e_ms")
                                    for b in BASELINES if b in ps}     # (baseline, DeltaBox)
        out["ratio_vs_deltabox"] = {b: _ratio(*v) for b, v in out["comparable_e2e_ms"].items()}
        out["cr_ratio_vs_deltabox"] = {b: _ratio(*_comparable(runs, b, "cr_ms"))
                                       for b in BASELINES if b in ps}
        out["baselines_slower"] = all(v > 1.0 for v in out["ratio_vs_deltabox"].values())
        codes, hashes = {}, {}
        for name, rs in runs.items():
            if name == "floor" and run["mode"] == "fanout":
                continue    # the floor runs the fan-out's action N times in one sandbox
            for i, r in enumerate(rs):
                if r is dbx:
                    continue
                key = name if i == 0 else f"{name} (repeat)"
                codes[key] = _compare_codes(dbx["codes"], r["codes"])
                hashes[key] = _compare_hashes(dbx["hashes"], r["hashes"])
        out["codes_vs_deltabox"] = codes
        out["hashes_vs_deltabox"] = hashes
        out["codes_agree"] = all(c["agree"] for c in codes.values())
        out["hashes_agree"] = all(h["agree"] for h in hashes.values())
        out["vs_original"] = _vs_original(run, dbx, traj)
        if run["mode"] == "fanout":
            out["per_n"] = _fanout_summary(runs)
        kinds = [o.get("kind") for o in dbx["ops"] if o["op"] == "checkpoint"]
        out["deltabox_checkpoint_kinds"] = {k: kinds.count(k) for k in sorted(set(kinds))}
        states = [o.get("process_state") for o in dbx["ops"] if o["op"] == "rollback"]
        out["deltabox_rollback_process_state"] = {k: states.count(k) for k in sorted(set(states))}
    return out


def _vs_original(run: dict[str, Any], dbx: dict[str, Any], traj: Trajectory) -> dict[str, Any]:
    """DeltaBox's exit codes against what the agent's own run got (information: versions
    differ between the original image and this sandbox)."""
    idx_of: dict[str, int] = {}      # step (a str once read back from JSON) -> action
    if run["mode"] == "mcts":
        idx_of = {str(s["step"]): s["action"] for s in run["steps"]}
    elif run["mode"] == "linear":
        idx_of = {str(k): int(k) for k in dbx["codes"]}
    same = diff = 0
    differing: list[dict[str, Any]] = []
    for key, code in dbx["codes"].items():
        k = str(key)
        if k not in idx_of:
            continue
        orig = traj.actions[idx_of[k]].returncode
        if orig is None:
            continue
        if orig == code:
            same += 1
        else:
            diff += 1
            if all(d["action"] != idx_of[k] for d in differing):
                differing.append({"action": idx_of[k], "original": orig, "replay": code,
                                  "cmd": traj.actions[idx_of[k]].label(80)})
    return {"same": same, "different": diff, "differing_actions": differing}


def _fanout_summary(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per N: e2e and fan-out phase per system (means over the repeats)."""
    out: dict[str, Any] = {}
    per: dict[str, dict[str, dict[str, float]]] = {}
    for name, rs in runs.items():
        for n in rs[0].get("per_n", {}):
            pns = [r["per_n"][n] for r in rs if n in r.get("per_n", {})]
            per.setdefault(n, {})[name] = {k: _mean(pns, k) for k in
                                           ("e2e_ms", "phase_ms", "cr_ms")}
    for n, by in per.items():
        if "deltabox" not in by:
            continue
        row: dict[str, Any] = {}
        floor = by.get("floor", {}).get("e2e_ms")
        dbx = by["deltabox"]["e2e_ms"]
        for name, pn in by.items():
            row[name] = {**pn, "over_floor": _ratio(pn["e2e_ms"], floor) if floor else None,
                         "ratio_vs_deltabox": _ratio(pn["e2e_ms"], dbx)}
        row["deltabox_overhead_pct"] = _pct(dbx, floor) if floor else None
        fphase = by.get("floor", {}).get("phase_ms")
        dphase = by["deltabox"]["phase_ms"]
        # The fan-out phase alone: the prefix, run once per system, adds its own noise.
        row["deltabox_phase_overhead_pct"] = _pct(dphase, fphase) if fphase else None
        for name in row:
            if isinstance(row[name], dict):
                row[name]["phase_ratio_vs_deltabox"] = _ratio(row[name]["phase_ms"], dphase)
        out[n] = row
    return out


def aggregate(trajectories: list[dict[str, Any]]) -> dict[str, Any]:
    """Per mode: DeltaBox's overhead per trajectory and in total, baseline ratios, agreement."""
    out: dict[str, Any] = {}
    for mode in MODES:
        runs = [r for t in trajectories for r in t["runs"] if r["mode"] == mode]
        if not runs:
            continue
        tot: dict[str, float] = {}
        for r in runs:
            for name, s in r["summary"]["per_system"].items():
                tot[name] = tot.get(name, 0.0) + s["e2e_ms"]
        m: dict[str, Any] = {
            "trajectories": [r["trajectory"] for r in runs],
            "overhead_pct": [r["summary"].get("overhead_pct") for r in runs],
            "total_e2e_ms": tot,
            "total_overhead_pct": _pct(tot.get("deltabox", math.nan), tot["floor"])
            if tot.get("floor") else None,
            # checkpoints asked for at each action's end, taken while the agent thinks
            "turn_overhead_pct": [r["summary"]["per_system"].get("deltabox_turn", {})
                                  .get("overhead_pct") for r in runs],
            "turn_total_overhead_pct": _pct(tot["deltabox_turn"], tot["floor"])
            if tot.get("floor") and "deltabox_turn" in tot else None,
            "total_ratio_vs_deltabox": _total_ratios(runs),
            "baselines_slower_everywhere": all(r["summary"].get("baselines_slower") for r in runs),
            "codes_agree_everywhere": all(r["summary"].get("codes_agree") for r in runs),
            "hashes_agree_everywhere": all(r["summary"].get("hashes_agree") for r in runs),
        }
        out[mode] = m
    return out


def _total_ratios(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Each baseline's time / DeltaBox's over the same work, all trajectories together."""
    sums: dict[str, list[float]] = {}
    for r in runs:
        for b, (mine, dbx) in r["summary"].get("comparable_e2e_ms", {}).items():
            acc = sums.setdefault(b, [0.0, 0.0])
            acc[0] += mine
            acc[1] += dbx
    return {b: _ratio(m, d) for b, (m, d) in sums.items()}


TARGET_OVERHEAD_PCT = 3.0


def targets(agg: dict[str, Any]) -> dict[str, Any]:
    mcts = agg.get("mcts")
    out: dict[str, Any] = {}
    if mcts:
        worst = max((v for v in mcts["overhead_pct"] if v is not None), default=None)
        out["mcts_overhead_pct_worst_trajectory"] = {
            "value": worst, "target": f"<= {TARGET_OVERHEAD_PCT:g}",
            "pass": None if worst is None else worst <= TARGET_OVERHEAD_PCT}
        out["mcts_overhead_pct_total"] = {
            "value": mcts["total_overhead_pct"], "target": f"<= {TARGET_OVERHEAD_PCT:g}",
            "pass": None if mcts["total_overhead_pct"] is None
            else mcts["total_overhead_pct"] <= TARGET_OVERHEAD_PCT}
        turn = mcts.get("turn_total_overhead_pct")
        if turn is not None:
            out["mcts_overhead_pct_total_turn_checkpoints"] = {
                "value": turn, "target": f"<= {TARGET_OVERHEAD_PCT:g} (checkpoints at the "
                "actions' ends, taken during the untimed think pause; a rollback in the next "
                "shell action's call, rollback_to=; rollbacks waited for the checkpoints)",
                "pass": turn <= TARGET_OVERHEAD_PCT}
    out["every_baseline_slower"] = {
        "value": {m: a["total_ratio_vs_deltabox"] for m, a in agg.items()},
        "target": "every baseline's e2e > DeltaBox's, in every run",
        "pass": all(a["baselines_slower_everywhere"] for a in agg.values()) if agg else None}
    out["exit_codes_identical"] = {
        "value": {m: a["codes_agree_everywhere"] for m, a in agg.items()},
        "target": "every system's exit codes == DeltaBox's (the floor's too, but in fan-out)",
        "pass": all(a["codes_agree_everywhere"] for a in agg.values()) if agg else None}
    out["state_hashes_identical"] = {
        "value": {m: a["hashes_agree_everywhere"] for m, a in agg.items()},
        "target": "workdir / git status / site-packages hashes == DeltaBox's at the same nodes",
        "pass": all(a["hashes_agree_everywhere"] for a in agg.values()) if agg else None}
    return out


METHOD = {
    "timing": "client-side wall time (time.perf_counter) around each SDK call or host "
              "operation; e2e_ms = sum of the timed operations (actions + C/R operations); "
              "think pauses, state hashing and kills of replaced sandboxes are not counted",
    "overhead_pct": "(e2e of the system - e2e of the floor) / e2e of the floor * 100, both "
                    "measured in the same run on the same actions",
    "cr_share_pct": "DeltaBox's own C/R time / its own action time * 100 (the same "
                    "question without the run-to-run noise of two separate replays)",
    "sandboxes": "every system runs in DeltaBox sandboxes forked from one base checkpoint "
                 "(repo + venv: the task's image); actions go through sbx.exec / sbx.files "
                 "with the trajectory's interpreter, env, cwd and the same timeout",
    "codes": "exit code per expansion step; strings: timeout, no-match (edit's old text "
             "absent), missing (file absent)",
    "hashes": "sha256 of the workdir's files (without .git, __pycache__, .pytest_cache, "
              "*.egg-info), of `git status --porcelain` and of the venv's site-packages "
              "listing, after the action that follows each rollback (mcts), every 5 actions "
              "(linear), in the first and last child of each N (fanout) and at the end",
}


def results_doc(trajectories: list[dict[str, Any]], plan: Plan, command: str, kind: str,
                errors: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The results.json document (without machine and cleanup, which the caller adds)."""
    agg = aggregate(trajectories)
    return {"benchmark": "swebench", "mode": kind, "command": command, "plan": plan.json(),
            "method": METHOD, "trajectories": trajectories, "errors": errors or [],
            "summary": agg, "targets": targets(agg)}


def resummarize(doc: dict[str, Any]) -> dict[str, Any]:
    """Recompute every summary, the aggregate and the targets from the raw operations of a
    results.json (after a change to the summaries; nothing is measured again)."""
    from .trajectory import from_dict, load

    for t in doc["trajectories"]:
        info = t["trajectory"]
        try:
            traj = load(info["file"])
        except OSError:      # the file moved: only the original return codes are missing
            traj = from_dict({"pypi": {"name": "x", "version": "0"}, "actions": [
                {"kind": "create", "path": "x", "content": ""}] * info["actions"]})
        for r in t["runs"]:
            r["summary"] = summarize_run(r, traj)
    doc["summary"] = aggregate(doc["trajectories"])
    doc["targets"] = targets(doc["summary"])
    return doc
