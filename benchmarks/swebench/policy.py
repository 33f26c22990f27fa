"""Issue 5's benchmark on the real trajectories: the checkpoint policy (auto) against
always-full checkpoints, a rollback check of the policy's decisions, and the turn
inspector's overhead on the same actions. See README.md, section "policy".

    .venv/bin/python -m benchmarks.swebench.policy --quick --out DIR     # < 8 min here
    .venv/bin/python -m benchmarks.swebench.policy --out DIR             # every trajectory
    .venv/bin/python -m benchmarks.swebench.policy --trajectory FILE --out DIR
    .venv/bin/python -m benchmarks.swebench.policy --report-only --out DIR   # PNG + markdown

Two private daemons run side by side: "on" (the eBPF inspector loaded; the run waits until
`inspector_backend` says ebpf) and "off" (`deltaboxd --no-inspector`). Each builds the
trajectory's base image itself (benchmarks.swebench.env). Per trajectory:

1. policy (daemon "on"): the trajectory replayed linearly in a fresh sandbox from the base,
   a checkpoint after every action, once with mode="auto" and once with mode="full" (the
   order alternates from trajectory to trajectory); every checkpoint's kind, reasons, daemon
   and client time, freeze time, files and bytes changed.
2. verify (daemon "on"): a third auto replay that takes the state hash
   (systems.state_hash) right after every checkpoint, then rolls back to a sample of its
   checkpoints (up to --verify-per-kind of each kind, spread over the run, in a seeded
   shuffled order) and compares the hash after each rollback with the one taken then.
3. overhead: the same actions with no checkpoint (the floor), in a fresh sandbox on each
   daemon, every action run in both, the order alternating action by action (on/off,
   off/on, ...), for --rounds rounds: the latency of each action, the sandbox cgroup's CPU
   time around it (cgroup2 cpu.stat) and each daemon process's CPU over the round (the
   inspector's event consumer runs in the "on" daemon).

Writes DIR/results.json (every raw measurement), DIR/policy.png and the markdown
(default benchmarks/swebench/RESULTS-policy.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import DEFAULT_OUT as COMMON_OUT
from benchmarks.common import (PrivateDaemon, default_cache_dir, finish_figure, leakcheck, log,
                               machine_info, make_settle, other_daemons, percentile, pyplot,
                               run_main, terminate_as_exception, wait_inspector, write_json)

from . import core, env
from .report import _f, machine_lines, short
from .run import QUICK
from .systems import Ctx, run_action, state_hash
from .trajectory import TRAJECTORY_DIR, Trajectory, all_files, load

DEFAULT_OUT = COMMON_OUT / "swebench-policy"
MD_DEFAULT = Path(__file__).resolve().parent / "RESULTS-policy.md"
QUICK_ACTIONS = 40             # --quick: the first 40 actions of each trajectory
KINDS = ("skipped", "fs", "full")
KIND_COLORS = {"skipped": "#2ca02c", "fs": "#1f77b4", "full": "#d62728"}
TARGET_SKIPPED = 0.50          # issue 5: at least 50 % of turns skipped
TARGET_OVERHEAD_PCT = 2.0      # issue 5: inspector overhead <= 2 %
UNIFIED = Path("/sys/fs/cgroup/unified")


@dataclasses.dataclass
class Options:
    max_actions: int | None = None     # replay only the first N actions (None: all)
    rounds: int = 5                    # overhead rounds (every action on both daemons)
    think: float = 0.2                 # untimed pause before each action in the C/R runs
    timeout: float = 120.0
    warmup_actions: int = 20
    verify_per_kind: int = 4
    seed: int = 1

    def json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ---- small pure helpers (tested) ---------------------------------------------------------

def spread(items: list[Any], k: int) -> list[Any]:
    """Up to k items evenly spread over the list, first and last included."""
    if k <= 0 or not items:
        return []
    if len(items) <= k:
        return list(items)
    if k == 1:
        return [items[-1]]
    idx = sorted({round(i * (len(items) - 1) / (k - 1)) for i in range(k)})
    return [items[i] for i in idx]


def verify_sample(kinds: list[str], per_kind: int, seed: int) -> list[int]:
    """Indices of the checkpoints to roll back to: up to per_kind of each kind, spread over
    the run, in a seeded shuffled order (so rollbacks go back and forth, not only back)."""
    chosen: list[int] = []
    for kind in KINDS:
        chosen += spread([i for i, k in enumerate(kinds) if k == kind], per_kind)
    rng = random.Random(seed)
    rng.shuffle(chosen)
    return chosen


ARMS = ("on", "off")


def pair_order(i: int, r: int) -> tuple[str, str]:
    """Which arm runs action i first in round r: on/off, off/on, on/off, ... (A B B A A B
    ...), the mirror image in odd rounds, so that neither arm always goes first or always
    follows the other's work."""
    return ("on", "off") if (i + r) % 2 == 0 else ("off", "on")


def parse_cpu_stat(text: str) -> dict[str, float]:
    """cgroup2 cpu.stat -> ms (usage, user, system)."""
    vals = dict(line.split(None, 1) for line in text.splitlines() if " " in line)
    out = {}
    for key in ("usage", "user", "system"):
        try:
            out[f"{key}_ms"] = int(vals[f"{key}_usec"]) / 1000.0
        except (KeyError, ValueError):
            pass
    return out


def proc_cpu_ms(pid: int | None) -> float | None:
    """utime + stime of a process (all its threads), in ms."""
    if pid is None:
        return None
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * 1000.0 / os.sysconf("SC_CLK_TCK")


def _pct(a: float, b: float) -> float:
    return (a / b - 1) * 100.0 if b else math.nan


def _ratio(a: float, b: float) -> float:
    return a / b if b else math.nan


# ---- measuring -----------------------------------------------------------------------------

def _pause(seconds: float) -> None:
    if seconds > 0:
        time.sleep(seconds)


def _effects_summary(report: Any) -> dict[str, Any]:
    """Counts of what the inspector saw in a turn (the lists themselves can be long)."""
    e = report.effects
    if e is None:
        return {"watched": False, "backend": report.backend}
    d = e.model_dump()
    out: dict[str, Any] = {"watched": True, "events": d.get("events"),
                           "complete": d.get("complete"), "lost_events": d.get("lost_events")}
    for k, v in d.items():
        if isinstance(v, list) and v and k not in ("incomplete_reasons",):
            out[k] = len(v)
    return out


def _checkpoint(sbx: Any, mode: str, label: str) -> tuple[Any, float, str]:
    """sbx.checkpoint(mode), client-side ms; like systems.DeltaBox, a process DeltaCR cannot
    capture makes it fall back to mode fs (recorded)."""
    from deltabox import errors

    refused = ""
    t0 = time.perf_counter()
    try:
        cp = sbx.checkpoint(mode=mode, label=label)
    except errors.FailedPrecondition as e:
        refused = str(e)[:300]
        cp = sbx.checkpoint(mode="fs", label=label)
    return cp, (time.perf_counter() - t0) * 1000, refused


def _cp_record(cp: Any, client_ms: float, refused: str) -> dict[str, Any]:
    return {"cp": cp.id, "kind": cp.kind, "reasons": list(cp.reasons), "client_ms": client_ms,
            "server_ms": cp.duration_ms, "freeze_ms": cp.freeze_ms,
            "files_changed": cp.files_changed, "bytes_changed": cp.bytes_changed,
            "processes_from": cp.processes_from, "refused": refused}


def _store_used(socket: str) -> int | None:
    import deltabox

    os.sync()
    try:
        i = deltabox.info(socket=socket)
    except deltabox.DeltaBoxError:
        return None
    return i.store_bytes_total - i.store_bytes_free


def linear_run(ctx: Ctx, mode: str, think: float) -> dict[str, Any]:
    """The trajectory in a fresh sandbox, checkpoint(mode) after every action."""
    turns: list[dict[str, Any]] = []
    t_wall = time.perf_counter()
    used0 = _store_used(ctx.socket)
    sbx = ctx.fresh()
    try:
        for i, a in enumerate(ctx.traj.actions):
            _pause(think)
            t0 = time.perf_counter()
            code = run_action(ctx, sbx, a)
            act_ms = (time.perf_counter() - t0) * 1000
            cp, ms, refused = _checkpoint(sbx, mode, f"{mode} {i}")
            rec = {"action": i, "code": code, "action_ms": act_ms, **_cp_record(cp, ms, refused)}
            if mode == "auto":
                rec["effects"] = _effects_summary(sbx.turn_effects(cp))
            turns.append(rec)
        used1 = _store_used(ctx.socket)
        final = state_hash(ctx, sbx)
    finally:
        sbx.kill()
    return {"mode": mode, "turns": turns, "final_hash": final,
            "store_used_delta_bytes": None if used0 is None or used1 is None else used1 - used0,
            "wall_ms": (time.perf_counter() - t_wall) * 1000}


def verify_run(ctx: Ctx, think: float, per_kind: int, seed: int) -> dict[str, Any]:
    """An auto replay with the state hash after every checkpoint, then rollbacks to a sample
    of its checkpoints: the hash after each rollback must equal the one taken then."""
    sbx = ctx.fresh()
    cps: list[Any] = []
    turns: list[dict[str, Any]] = []
    checks: list[dict[str, Any]] = []
    try:
        for i, a in enumerate(ctx.traj.actions):
            _pause(think)
            code = run_action(ctx, sbx, a)
            cp, ms, refused = _checkpoint(sbx, "auto", f"verify {i}")
            rec = {"action": i, "code": code, **_cp_record(cp, ms, refused),
                   "effects": _effects_summary(sbx.turn_effects(cp)),
                   "hash": state_hash(ctx, sbx)}
            cps.append(cp)
            turns.append(rec)
        for i in verify_sample([t["kind"] for t in turns], per_kind, seed):
            t = turns[i]
            t0 = time.perf_counter()
            rb = sbx.rollback(cps[i])
            rb_ms = (time.perf_counter() - t0) * 1000
            got = state_hash(ctx, sbx)
            ok = got == t["hash"] and "error" not in got
            chk = {"action": i, "kind": t["kind"], "reasons": t["reasons"], "match": ok,
                   "rollback_ms": rb_ms, "rollback_server_ms": rb.duration_ms,
                   "process_state": rb.process_state, "expected": t["hash"], "got": got}
            if not ok:
                chk["differs"] = sorted(k for k in set(got) | set(t["hash"])
                                        if got.get(k) != t["hash"].get(k))
                chk["action_label"] = ctx.traj.actions[i].label(200)
                r = sbx.exec(["bash", "-c", "git --no-optional-locks status --porcelain "
                              "| head -50"], cwd=ctx.env.workdir, timeout=60)
                chk["git_status_after_rollback"] = r.stdout[-3000:]
                log(f"MISMATCH after rollback to action {i} ({t['kind']}): {chk['differs']}")
            checks.append(chk)
    finally:
        sbx.kill()
    return {"turns": turns, "checks": checks}


def cgroup_cpu(daemon: PrivateDaemon, sandbox_id: str) -> dict[str, float]:
    """The sandbox cgroup's CPU time so far (cgroup2 hierarchy, also on hybrid v1 hosts)."""
    from deltabox.sandbox.cgroups import parent_name

    root = UNIFIED if UNIFIED.is_dir() else Path("/sys/fs/cgroup")
    f = root / parent_name(str(daemon.state_dir.resolve())) / sandbox_id / "cpu.stat"
    try:
        return parse_cpu_stat(f.read_text())
    except OSError:
        return {}


def paired_floor_round(ctxs: dict[str, Ctx], daemons: dict[str, PrivateDaemon],
                       r: int) -> dict[str, Any]:
    """One overhead round: a fresh sandbox on each daemon, then every action, no checkpoint,
    run once in each sandbox, the order alternating action by action (`pair_order`); per
    action and arm the latency and the sandbox cgroup's CPU; per arm the daemon's CPU over
    the round (the inspector's consumer runs in the "on" daemon)."""
    sbx = {arm: ctxs[arm].fresh() for arm in ARMS}
    pids = {arm: daemons[arm].proc.pid if daemons[arm].proc is not None else None
            for arm in ARMS}
    try:
        d0 = {arm: proc_cpu_ms(pids[arm]) for arm in ARMS}
        actions = []
        for i, a in enumerate(ctxs["on"].traj.actions):
            rec: dict[str, Any] = {"action": i, "order": pair_order(i, r)}
            for arm in rec["order"]:
                c0 = cgroup_cpu(daemons[arm], sbx[arm].id)
                t0 = time.perf_counter()
                code = run_action(ctxs[arm], sbx[arm], a)
                rec[f"{arm}_ms"] = (time.perf_counter() - t0) * 1000
                c1 = cgroup_cpu(daemons[arm], sbx[arm].id)
                rec[f"{arm}_code"] = code
                if "usage_ms" in c0 and "usage_ms" in c1:
                    rec[f"{arm}_cpu_ms"] = c1["usage_ms"] - c0["usage_ms"]
            actions.append(rec)
        d1 = {arm: proc_cpu_ms(pids[arm]) for arm in ARMS}
    finally:
        for b in sbx.values():
            b.kill()
    out: dict[str, Any] = {"round": r, "actions": actions, "loadavg": os.getloadavg()[0]}
    if all(d0[a] is not None and d1[a] is not None for a in ARMS):
        out["daemon_cpu_ms"] = {a: d1[a] - d0[a] for a in ARMS}   # type: ignore[operator]
    return out


def measure_trajectory(daemons: dict[str, PrivateDaemon], traj: Trajectory,
                       host: env.HostEnv, opts: Options, index: int) -> dict[str, Any]:
    """Base images on both daemons, then the policy runs, the verify run and the overhead
    rounds (module docstring)."""
    t_start = time.perf_counter()
    bases: dict[str, env.SandboxEnv] = {}
    out: dict[str, Any] = {"trajectory": traj.describe(), "environment": {}, "errors": []}
    try:
        for arm in ("on", "off"):
            bases[arm] = env.build_base(daemons[arm].socket, traj, host)
            out["environment"][arm] = bases[arm].info
        ctxs = {arm: Ctx(socket=d.socket, state_dir=d.state_dir, scratch=d.scratch, traj=traj,
                         env=bases[arm], timeout=opts.timeout, think=opts.think,
                         settle=make_settle(d.socket)) for arm, d in daemons.items()}

        def settle() -> float:
            return sum(c.settle() for c in ctxs.values())

        if opts.warmup_actions:
            out["warmup_ms"] = {arm: core.warm_up(c, opts.warmup_actions)
                                for arm, c in ctxs.items()}
        # 1. auto vs full, alternating which goes first
        out["policy"] = {}
        for mode in (("auto", "full") if index % 2 == 0 else ("full", "auto")):
            settle()
            log(f"{traj.name[:48]}: linear, checkpoint mode={mode} ...")
            out["policy"][mode] = linear_run(ctxs["on"], mode, opts.think)
        out["policy_order"] = list(out["policy"])
        # 2. rollbacks to a sample of auto checkpoints
        settle()
        log(f"{traj.name[:48]}: verify (hash after each auto checkpoint, rollbacks) ...")
        out["verify"] = verify_run(ctxs["on"], opts.think, opts.verify_per_kind,
                                   opts.seed + index)
        # 3. the floor with and without the inspector, interleaved action by action
        out["overhead"] = []
        for r in range(opts.rounds):
            settle()
            res = paired_floor_round(ctxs, daemons, r)
            out["overhead"].append(res)
            s = summarize_overhead([res])
            log(f"{traj.name[:48]}: floor round {r}: actions on "
                f"{s['on']['action_ms'] / 1000:.2f} s, off {s['off']['action_ms'] / 1000:.2f} s"
                f" ({_f(s.get('action_overhead_pct'), '+.1f', ' %')}); sandbox cpu "
                f"{_f(s.get('cgroup_usage_overhead_pct'), '+.1f', ' %')}")
    finally:
        for b in bases.values():
            try:
                b.setup_sandbox.kill()
            except Exception:
                pass
    out["duration_s"] = time.perf_counter() - t_start
    out["summary"] = summarize_trajectory(out)
    return out


# ---- summaries ---------------------------------------------------------------------------

def _kinds(turns: list[dict[str, Any]]) -> dict[str, int]:
    return {k: sum(1 for t in turns if t["kind"] == k) for k in KINDS}


def _cp_totals(turns: list[dict[str, Any]]) -> dict[str, Any]:
    cl = [t["client_ms"] for t in turns]
    sv = [t["server_ms"] for t in turns]
    return {"n": len(turns), "client_ms_total": sum(cl), "server_ms_total": sum(sv),
            "freeze_ms_total": sum(t["freeze_ms"] for t in turns),
            "client_ms_p50": percentile(cl, 50), "server_ms_p50": percentile(sv, 50),
            "client_ms_p90": percentile(cl, 90), "server_ms_p90": percentile(sv, 90),
            "bytes_changed_total": sum(t["bytes_changed"] for t in turns),
            "files_changed_total": sum(t["files_changed"] for t in turns),
            "snapshots": sum(1 for t in turns if t["kind"] != "skipped"),
            "action_ms_total": sum(t["action_ms"] for t in turns if "action_ms" in t)}


def bootstrap_ratio(pairs: list[tuple[float, float]], n: int = 2000,
                    seed: int = 0) -> tuple[float, float]:
    """95 % interval of sum(on) / sum(off) - 1 (in %) over resampled action pairs."""
    if len(pairs) < 2:
        return (math.nan, math.nan)
    rng = random.Random(seed)
    k = len(pairs)
    vals = []
    for _ in range(n):
        on = off = 0.0
        for _ in range(k):
            a, b = pairs[rng.randrange(k)]
            on += a
            off += b
        vals.append(_pct(on, off))
    return percentile(vals, 2.5), percentile(vals, 97.5)


def summarize_overhead(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Sums per arm over every round and action, the overhead of "on" against "off" (wall
    of the actions with a bootstrap interval over the action pairs, the sandbox cgroups'
    CPU, the daemons' CPU), per-round figures and the median per-action ratio."""
    acts = [a for r in rounds for a in r["actions"]]
    out: dict[str, Any] = {"rounds": len(rounds), "pairs": len(acts)}
    for arm in ARMS:
        out[arm] = {"action_ms": sum(a[f"{arm}_ms"] for a in acts)}
        if acts and all(f"{arm}_cpu_ms" in a for a in acts):
            out[arm]["cgroup_usage_ms"] = sum(a[f"{arm}_cpu_ms"] for a in acts)
        if rounds and all("daemon_cpu_ms" in r for r in rounds):
            out[arm]["daemon_cpu_ms"] = sum(r["daemon_cpu_ms"][arm] for r in rounds)
    on, off = out["on"], out["off"]
    out["action_overhead_pct"] = _pct(on["action_ms"], off["action_ms"])
    out["action_overhead_ci95_pct"] = bootstrap_ratio([(a["on_ms"], a["off_ms"])
                                                       for a in acts])
    if "cgroup_usage_ms" in on and "cgroup_usage_ms" in off:
        out["cgroup_usage_overhead_pct"] = _pct(on["cgroup_usage_ms"], off["cgroup_usage_ms"])
        if "daemon_cpu_ms" in on and "daemon_cpu_ms" in off:
            # everything the inspector costs in CPU: its probes (in the sandbox's cgroup)
            # and its event consumer (in the daemon)
            out["cpu_with_daemon_overhead_pct"] = _pct(
                on["cgroup_usage_ms"] + on["daemon_cpu_ms"],
                off["cgroup_usage_ms"] + off["daemon_cpu_ms"])
    if "daemon_cpu_ms" in on and "daemon_cpu_ms" in off:
        out["daemon_cpu_extra_ms"] = on["daemon_cpu_ms"] - off["daemon_cpu_ms"]
        out["daemon_cpu_extra_pct_of_actions"] = _pct(
            off["action_ms"] + out["daemon_cpu_extra_ms"], off["action_ms"])
    out["per_round_overhead_pct"] = [
        _pct(sum(a["on_ms"] for a in r["actions"]), sum(a["off_ms"] for a in r["actions"]))
        for r in rounds]
    ratios = [a["on_ms"] / a["off_ms"] for a in acts if a["off_ms"] > 0]
    out["per_action_median_pct"] = (statistics.median(ratios) - 1) * 100 if ratios else None
    # a fixed cost per exec shows here (the proportional part in the sums above)
    out["per_action_median_diff_ms"] = (statistics.median(a["on_ms"] - a["off_ms"]
                                                          for a in acts) if acts else None)
    out["codes_agree"] = all(a.get("on_code") == a.get("off_code") for a in acts)
    return out


def summarize_trajectory(t: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    pol = t.get("policy", {})
    if "auto" in pol:
        kinds = _kinds(pol["auto"]["turns"])
        n = sum(kinds.values())
        out["kinds"] = kinds
        out["fractions"] = {k: v / n if n else math.nan for k, v in kinds.items()}
    for mode in ("auto", "full"):
        if mode in pol:
            out[mode] = _cp_totals(pol[mode]["turns"])
            out[mode]["store_used_delta_bytes"] = pol[mode].get("store_used_delta_bytes")
    if "auto" in out and "full" in out:
        a, f = out["auto"], out["full"]
        out["ratio_full_over_auto"] = {
            k: _ratio(f[k], a[k]) for k in ("client_ms_total", "server_ms_total",
                                            "client_ms_p50", "server_ms_p50",
                                            "freeze_ms_total", "bytes_changed_total",
                                            "snapshots")}
        codes_a = [x["code"] for x in pol["auto"]["turns"]]
        codes_f = [x["code"] for x in pol["full"]["turns"]]
        out["codes_agree"] = codes_a == codes_f
        out["final_hash_agree"] = pol["auto"].get("final_hash") == pol["full"].get("final_hash")
    v = t.get("verify")
    if v:
        checks = v["checks"]
        out["verify"] = {
            "kinds": _kinds(v["turns"]),
            "checked": {k: sum(1 for c in checks if c["kind"] == k) for k in KINDS},
            "mismatches": [{k: c.get(k) for k in ("action", "kind", "reasons", "differs",
                                                   "action_label")}
                           for c in checks if not c["match"]],
            "rollback_ms_p50": percentile([c["rollback_ms"] for c in checks], 50),
        }
    if t.get("overhead"):
        out["overhead"] = summarize_overhead(t["overhead"])
    return out


def aggregate(trajs: list[dict[str, Any]]) -> dict[str, Any]:
    """Over every trajectory: turn kinds, checkpoint time and bytes auto vs full, the
    verification, the inspector's overhead (sums over all trajectories and rounds)."""
    out: dict[str, Any] = {"trajectories": [t["trajectory"]["name"] for t in trajs]}
    auto = [x for t in trajs for x in t.get("policy", {}).get("auto", {}).get("turns", [])]
    full = [x for t in trajs for x in t.get("policy", {}).get("full", {}).get("turns", [])]
    if auto:
        kinds = _kinds(auto)
        out["kinds"] = kinds
        out["fractions"] = {k: v / len(auto) for k, v in kinds.items()}
        fr = [t["summary"]["fractions"]["skipped"] for t in trajs
              if "fractions" in t.get("summary", {})]
        out["skipped_fraction_min_trajectory"] = min(fr) if fr else None
    if auto and full:
        a, f = _cp_totals(auto), _cp_totals(full)
        out["auto"], out["full"] = a, f
        out["ratio_full_over_auto"] = {
            k: _ratio(f[k], a[k]) for k in ("client_ms_total", "server_ms_total",
                                            "client_ms_p50", "server_ms_p50",
                                            "freeze_ms_total", "bytes_changed_total",
                                            "snapshots")}
        sa = [t["summary"].get("auto", {}).get("store_used_delta_bytes") for t in trajs]
        sf = [t["summary"].get("full", {}).get("store_used_delta_bytes") for t in trajs]
        if all(x is not None for x in sa + sf):
            out["auto"]["store_used_delta_bytes"] = sum(sa)
            out["full"]["store_used_delta_bytes"] = sum(sf)
        out["codes_agree_everywhere"] = all(t["summary"].get("codes_agree") for t in trajs)
        out["final_hash_agree_everywhere"] = all(t["summary"].get("final_hash_agree")
                                                 for t in trajs)
    checks = [dict(c, trajectory=t["trajectory"]["name"])
              for t in trajs for c in t.get("verify", {}).get("checks", [])]
    if checks:
        out["verify"] = {
            "checked": {k: sum(1 for c in checks if c["kind"] == k) for k in KINDS},
            "matched": sum(1 for c in checks if c["match"]),
            "mismatches": [{k: c.get(k) for k in ("trajectory", "action", "kind", "reasons",
                                                   "differs", "action_label")}
                           for c in checks if not c["match"]]}
    rounds = [r for t in trajs for r in t.get("overhead", [])]
    if rounds:
        out["overhead"] = summarize_overhead(rounds)
    return out


def targets(agg: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    fr = agg.get("fractions", {}).get("skipped")
    out["skipped_fraction"] = {
        "value": fr, "target": f">= {TARGET_SKIPPED:.0%} of turns skipped (all trajectories)",
        "pass": None if fr is None else fr >= TARGET_SKIPPED}
    v = agg.get("verify")
    out["no_wrong_skip"] = {
        "value": None if not v else f"{v['matched']}/{sum(v['checked'].values())} rollbacks "
        "restored the hash",
        "target": "every sampled auto checkpoint restores its state hash",
        "pass": None if not v else not v["mismatches"]}
    ov = agg.get("overhead", {}).get("action_overhead_pct")
    out["inspector_overhead_pct"] = {
        "value": ov, "target": f"<= {TARGET_OVERHEAD_PCT:g} % (wall time of the actions, "
        "inspector loaded vs --no-inspector)",
        "pass": None if ov is None or not math.isfinite(ov) else ov <= TARGET_OVERHEAD_PCT}
    return out


METHOD = {
    "daemons": "two private deltaboxd side by side on the same machine, each with its own "
               "state dir: 'on' (the eBPF inspector loaded, waited for) and 'off' "
               "(--no-inspector); each builds the trajectory's base image itself",
    "policy": "linear replay in a fresh sandbox forked from the base, sbx.checkpoint(mode) "
              "after every action, mode auto and mode full, order alternating per "
              "trajectory, --think untimed pause before each action; client_ms = "
              "perf_counter around sbx.checkpoint, server_ms = Checkpoint.duration_ms",
    "verify": "a third auto replay with systems.state_hash right after every checkpoint "
              "(the hash commands fall into the next turn, so its kinds may differ from the "
              "clean auto run's); then rollbacks to up to verify_per_kind checkpoints of "
              "each kind, seeded shuffled order, hash compared",
    "overhead": "the floor (actions only, no checkpoint, no think pause): per round a fresh "
                "sandbox on each daemon, every action run once in each, the order alternating "
                "action by action (on/off, off/on, ...; mirrored in odd rounds), settled "
                "(sync, btrfs cleaner) before each round; action_ms = client-side latency of "
                "each action; cgroup cpu = the sandbox cgroup's cpu.stat usage (cgroup2) "
                "around each action; daemon_cpu_ms = utime+stime of each daemon process over "
                "the round (the inspector's event consumer runs in the 'on' one); overhead = "
                "sum over all actions, rounds and trajectories, on / off - 1, with a "
                "bootstrap 95 % interval over the action pairs",
    "caveat": "the 'off' daemon's sandboxes run while the 'on' daemon's probes are attached "
              "(tracepoints are system-wide, filtered by cgroup in the program), as on a "
              "host where any other inspector-enabled daemon runs: the unwatched cost (an "
              "early return per syscall) is in both arms",
}


# ---- figures and markdown ------------------------------------------------------------------

def plot(doc: dict[str, Any], path: Path) -> Path:
    plt = pyplot()
    trajs = doc.get("trajectories", [])
    names = [short(t["trajectory"]["name"]) for t in trajs]
    fig, axes = plt.subplots(1, 3, figsize=(19, 6))
    ax = axes[0]
    bottom = [0.0] * len(trajs)
    for kind in KINDS:
        vals = [t["summary"].get("fractions", {}).get(kind, 0.0) * 100 for t in trajs]
        ns = [t["summary"].get("kinds", {}).get(kind, 0) for t in trajs]
        ax.bar(range(len(trajs)), vals, bottom=bottom, color=KIND_COLORS[kind], label=kind)
        for i, (v, n) in enumerate(zip(vals, ns)):
            if v >= 6:
                ax.annotate(f"{n}", (i, bottom[i] + v / 2), ha="center", va="center",
                            fontsize=7, color="white")
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.axhline(TARGET_SKIPPED * 100, color="black", linestyle="--", linewidth=0.8)
    ax.set_xticks(range(len(trajs)))
    ax.set_xticklabels(names, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("% of turns (auto checkpoints)")
    ax.set_ylim(0, 100)
    ax.set_title("checkpoint kinds per trajectory (mode auto); dashed: 50 % skipped target",
                 fontsize=9, loc="left")
    ax.legend(fontsize=8, loc="lower right")

    ax = axes[1]
    w = 0.38
    for j, (mode, color) in enumerate((("auto", "#1f77b4"), ("full", "#d62728"))):
        ys = [t["summary"].get(mode, {}).get("client_ms_total", 0.0) / 1000 for t in trajs]
        xs = [i - w / 2 + j * w for i in range(len(trajs))]
        ax.bar(xs, ys, w * 0.95, color=color, label=f"mode={mode}")
    for i, t in enumerate(trajs):
        r = t["summary"].get("ratio_full_over_auto", {}).get("client_ms_total")
        top = max(t["summary"].get(m, {}).get("client_ms_total", 0.0) for m in ("auto", "full"))
        if r is not None and math.isfinite(r):
            ax.annotate(f"{r:.2f}x", (i, top / 1000), textcoords="offset points",
                        xytext=(0, 3), ha="center", fontsize=7)
    ax.set_xticks(range(len(trajs)))
    ax.set_xticklabels(names, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("total checkpoint time, client side (s)")
    ax.set_title("checkpoint after every action: auto vs always-full (label: full / auto)",
                 fontsize=9, loc="left")
    ax.legend(fontsize=8)

    ax = axes[2]
    ovs = [t["summary"].get("overhead", {}) for t in trajs]
    labels = list(names)
    if doc.get("summary", {}).get("overhead"):
        ovs.append(doc["summary"]["overhead"])
        labels.append("all")

    def val(o: dict[str, Any], key: str) -> float:
        v = o.get(key)
        return v if isinstance(v, (int, float)) and math.isfinite(v) else 0.0

    xs = list(range(len(ovs)))
    wall = [val(o, "action_overhead_pct") for o in ovs]
    err_lo, err_hi = [], []
    for o, w0 in zip(ovs, wall):
        lo, hi = o.get("action_overhead_ci95_pct") or (None, None)
        ok = all(isinstance(v, (int, float)) and math.isfinite(v) for v in (lo, hi))
        err_lo.append(max(0.0, w0 - lo) if ok else 0.0)
        err_hi.append(max(0.0, hi - w0) if ok else 0.0)
    ax.bar([x - 0.27 for x in xs], wall, 0.26, color="#9467bd", yerr=[err_lo, err_hi],
           capsize=3, label="wall time of the actions (95 % interval)")
    ax.bar(xs, [val(o, "cgroup_usage_overhead_pct") for o in ovs], 0.26, color="#8c564b",
           label="sandbox cgroup CPU")
    ax.bar([x + 0.27 for x in xs], [val(o, "cpu_with_daemon_overhead_pct") for o in ovs],
           0.26, color="#e377c2", label="sandbox + daemon CPU")
    lim = 15.0       # trajectories of a few ms of actions (moatless: 3 edits) are all noise
    for i, o in enumerate(ovs[:len(trajs)]):
        for rp in o.get("per_round_overhead_pct", []):
            if rp is not None and math.isfinite(rp):
                ax.plot(i - 0.27, max(-lim, min(lim, rp)), marker=".", color="black",
                        markersize=4)
    ax.set_ylim(-lim, lim)
    ax.axhline(TARGET_OVERHEAD_PCT, color="black", linestyle="--", linewidth=0.8)
    ax.axhline(0, color="black", linewidth=0.6)
    ax.set_xticks(xs)
    ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("inspector loaded vs --no-inspector (%)")
    ax.set_title("inspector overhead on the floor (dots: per round; dashed: 2 % target;\n"
                 f"clipped to +-{lim:g} %: see the markdown for the values)", fontsize=9,
                 loc="left")
    ax.legend(fontsize=7)
    finish_figure(fig, path, "issue 5: checkpoint policy and turn inspector on SWE-bench "
                  "trajectories", doc.get("machine", {}))
    return path


def _s(ms: float | None) -> str:
    return "-" if ms is None else f"{ms / 1000:.2f} s"


def _bytes(b: float | None) -> str:
    if b is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(b) < 1024 or unit == "GiB":
            return f"{b:.0f} {unit}" if unit == "B" else f"{b:.1f} {unit}"
        b /= 1024
    return "-"


def markdown(doc: dict[str, Any], png: str = "results-policy/policy.png") -> str:
    agg = doc.get("summary", {})
    m = doc.get("machine", {})
    tg = doc.get("targets", {})
    trajs = doc.get("trajectories", [])
    lines = [
        "# Checkpoint policy and turn inspector on the SWE-bench trajectories (issue 5)",
        "",
        "Generated by `python -m benchmarks.swebench.policy` from `results.json` "
        f"(regenerate: `--report-only`). Run: `{doc.get('command', '?')}` ({doc.get('kind')}"
        f", {_f(doc.get('duration_s', 0) / 60, '.1f')} min). Method: README.md, section "
        "\"policy\".",
        "",
        *machine_lines(m),
        f"- inspector: {m.get('inspector_backend', '?')}; other deltaboxd processes on the "
        f"machine at start: {len(m.get('other_deltaboxd_at_start', []))}",
        "",
        "## Targets",
        "",
        "| target | value | verdict |",
        "|---|---|---|",
    ]
    for name, t in tg.items():
        v = t["value"]
        if name == "skipped_fraction" and v is not None:
            vs = f"{v:.1%} ({agg['kinds']['skipped']}/{sum(agg['kinds'].values())} turns)"
        elif name == "inspector_overhead_pct" and v is not None:
            ov = agg.get("overhead", {})
            lo, hi = ov.get("action_overhead_ci95_pct") or (None, None)
            vs = (f"{v:+.2f} % (95 % interval {_f(lo, '+.2f')} .. {_f(hi, '+.2f')} %; "
                  f"sandbox CPU {_f(ov.get('cgroup_usage_overhead_pct'), '+.2f', ' %')})")
        else:
            vs = "-" if v is None else str(v)
        verdict = "n/a" if t["pass"] is None else ("PASS" if t["pass"] else "**FAIL**")
        lines.append(f"| {name} ({t['target']}) | {vs} | {verdict} |")
    lines += ["", f"![policy]({png})", "", "## Turn kinds with mode=auto", "",
              "| trajectory | turns | skipped | fs | full | most common first reason of fs / full |",
              "|---|---|---|---|---|---|"]
    for t in trajs:
        s = t["summary"]
        k, fr = s.get("kinds", {}), s.get("fractions", {})
        reasons: dict[str, int] = {}
        for x in t.get("policy", {}).get("auto", {}).get("turns", []):
            if x["kind"] != "skipped" and x["reasons"]:
                key = f"{x['kind']}: {x['reasons'][0].split(':')[0][:90]}"
                reasons[key] = reasons.get(key, 0) + 1
        top = max(reasons.items(), key=lambda kv: kv[1]) if reasons else ("-", 0)
        lines.append(f"| {short(t['trajectory']['name'])} | {sum(k.values())} | "
                     + " | ".join(f"{k.get(x, 0)} ({_f(fr.get(x, 0) * 100, '.0f', ' %')})"
                                  for x in KINDS)
                     + f" | {top[0]} ({top[1]}x) |")
    if "kinds" in agg:
        k, fr = agg["kinds"], agg["fractions"]
        lines.append(f"| **all** | {sum(k.values())} | "
                     + " | ".join(f"**{k[x]} ({fr[x] * 100:.0f} %)**" for x in KINDS) + " | |")
    lines += ["", "## Checkpoint cost: auto vs always-full (same daemon, same base, "
              "same run)", "",
              "| trajectory | total client auto / full (ratio) | total daemon auto / full "
              "(ratio) | p50 client auto / full | freeze total auto / full | snapshots auto /"
              " full | bytes changed auto / full | store used auto / full |",
              "|---|---|---|---|---|---|---|---|"]
    rows = [(short(t["trajectory"]["name"]), t["summary"]) for t in trajs]
    if "auto" in agg:
        rows.append(("**all**", agg))
    for name, s in rows:
        a, f, r = s.get("auto", {}), s.get("full", {}), s.get("ratio_full_over_auto", {})
        if not a or not f:
            continue
        lines.append(
            f"| {name} | {a['client_ms_total']:.0f} / {f['client_ms_total']:.0f} ms "
            f"({_f(r.get('client_ms_total'), '.2f', 'x')}) | {a['server_ms_total']:.0f} / "
            f"{f['server_ms_total']:.0f} ms ({_f(r.get('server_ms_total'), '.2f', 'x')}) | "
            f"{a['client_ms_p50']:.2f} / {f['client_ms_p50']:.2f} ms | "
            f"{a['freeze_ms_total']:.0f} / {f['freeze_ms_total']:.0f} ms | "
            f"{a['snapshots']} / {f['snapshots']} | {_bytes(a['bytes_changed_total'])} / "
            f"{_bytes(f['bytes_changed_total'])} | {_bytes(a.get('store_used_delta_bytes'))} / "
            f"{_bytes(f.get('store_used_delta_bytes'))} |")
    if "auto" in agg:
        a, f = agg["auto"], agg["full"]
        lines += ["", f"Actions in the same runs: {_s(a['action_ms_total'])} (auto) and "
                  f"{_s(f['action_ms_total'])} (full); checkpoints add "
                  f"{a['client_ms_total'] / max(a['action_ms_total'], 1e-9) * 100:.1f} % and "
                  f"{f['client_ms_total'] / max(f['action_ms_total'], 1e-9) * 100:.1f} % to "
                  "them. Exit codes auto vs full identical: "
                  f"{agg.get('codes_agree_everywhere')}; final state hashes identical: "
                  f"{agg.get('final_hash_agree_everywhere')}. \"bytes changed\" is the "
                  "daemon's `bytes_changed` (file bytes in the new layer; 0 for a skipped "
                  "checkpoint, which aliases its parent); \"store used\" is the store's "
                  "used-space delta over the run (after sync, before the sandbox is killed)."]
    v = agg.get("verify")
    lines += ["", "## Rollback check of auto checkpoints", ""]
    if v:
        vk = {k: sum(t["summary"].get("verify", {}).get("kinds", {}).get(k, 0) for t in trajs)
              for k in KINDS}
        lines.append(f"{v['matched']} of {sum(v['checked'].values())} rollbacks restored the "
                     "state hash taken right after the checkpoint (checked per kind: "
                     + ", ".join(f"{k} {n}" for k, n in v["checked"].items()) + "; the verify "
                     "run's own kinds: " + ", ".join(f"{k} {n}" for k, n in vk.items()) + ").")
        for mm in v["mismatches"]:
            lines.append(f"- **MISMATCH** {short(mm['trajectory'])} action {mm['action']} "
                         f"(`{(mm.get('action_label') or '')[:80]}`), kind {mm['kind']}, "
                         f"reasons {mm['reasons']}: differs in {mm.get('differs')}")
    else:
        lines.append("not run")
    ov = agg.get("overhead")
    lines += ["", "## Inspector overhead (floor: the same actions, no checkpoints)", "",
              "| trajectory | rounds x actions | actions on / off (sum) | overhead wall (95 % "
              "interval) | per round | per-action median (ms) | sandbox CPU on / off | overhead "
              "CPU | daemon CPU on / off | CPU incl. daemon |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    rows = [(short(t["trajectory"]["name"]), t["summary"].get("overhead")) for t in trajs]
    if ov:
        rows.append(("**all**", ov))
    for name, o in rows:
        if not o:
            continue
        on, off = o["on"], o["off"]
        lo, hi = o.get("action_overhead_ci95_pct") or (None, None)
        per_round = ", ".join(_f(x, "+.1f") for x in o["per_round_overhead_pct"][:6])
        if len(o["per_round_overhead_pct"]) > 6:
            per_round += ", ..."
        lines.append(
            f"| {name} | {o['rounds']} x {o['pairs'] // max(o['rounds'], 1)} | "
            f"{_s(on.get('action_ms'))} / {_s(off.get('action_ms'))} | "
            f"{_f(o.get('action_overhead_pct'), '+.2f', ' %')} ({_f(lo, '+.1f')} .. "
            f"{_f(hi, '+.1f')}) | {per_round} | {_f(o.get('per_action_median_pct'), '+.1f', ' %')} "
            f"({_f(o.get('per_action_median_diff_ms'), '+.2f')})"
            f" | {_s(on.get('cgroup_usage_ms'))} / {_s(off.get('cgroup_usage_ms'))} | "
            f"{_f(o.get('cgroup_usage_overhead_pct'), '+.2f', ' %')} | "
            f"{_s(on.get('daemon_cpu_ms'))} / {_s(off.get('daemon_cpu_ms'))} | "
            f"{_f(o.get('cpu_with_daemon_overhead_pct'), '+.2f', ' %')} |")
    if ov:
        lines += ["", "Every action ran once on each daemon, in two sandboxes side by side, "
                  "the order alternating from action to action (on/off, off/on, ...; mirrored "
                  "in odd rounds). The interval is a bootstrap over the action pairs. Sandbox "
                  "CPU: the cgroups' cpu.stat usage during the actions (the probes run in the "
                  "syscalling task's context, so their cost is there). Daemon CPU: the "
                  "daemon process's own CPU over the rounds; with the inspector it includes "
                  "draining and decoding the sandbox's events (the extra is "
                  f"{_f(ov.get('daemon_cpu_extra_pct_of_actions'), '.2f', ' %')} of the "
                  "actions' wall time; it runs concurrently, on the other cpu when one is "
                  "free). \"CPU incl. daemon\" = (sandbox + daemon CPU) on vs off. Exit codes "
                  f"on vs off identical: {ov.get('codes_agree')}."]
    lines += ["", "## Reading the figures", ""] + reading_notes(doc)
    lines += ["", "## Method", ""] + [f"- **{k}**: {v}" for k, v in doc.get("method",
                                                                          {}).items()]
    if doc.get("errors"):
        lines += ["", "## Errors", ""] + [f"- {e['trajectory']}: {e['error'][:300]}"
                                         for e in doc["errors"]]
    cl = doc.get("cleanup", {})
    if cl:
        found = [x for x in (cl.get("leakcheck") or "").splitlines() if x.startswith("leak")]
        lines += ["", "Cleanup: this run's own leftovers (mounts, loop devices, processes, "
                  f"cgroups of its two daemons): {cl.get('own_leaks') or 'none'}; "
                  "`../shared/tools/leakcheck` (the whole machine, other engineers' running "
                  "daemons included): "
                  + ("clean" if cl.get("leakcheck_clean") else
                     f"not clean, {len(found)} findings (results.json, `cleanup`)") + "."]
    return "\n".join(lines) + "\n"


def reading_notes(doc: dict[str, Any]) -> list[str]:
    """Plain statements derived from the summary (what the figures do and do not show)."""
    agg = doc.get("summary", {})
    out: list[str] = []
    k = agg.get("kinds")
    if k and not k.get("full"):
        out.append("- No auto checkpoint was `full`: every command of these agents runs in a "
                   "fresh subshell and nothing outlives its action, so no turn changed process "
                   "state; the policy's process path is not exercised by these trajectories "
                   "(and the rollback check has no `full` sample). It is by the catalog tests "
                   "(tests/test_policy.py).")
    if "auto" in agg and "full" in agg:
        a, f = agg["auto"], agg["full"]
        r = agg["ratio_full_over_auto"]
        out.append(f"- The policy saves checkpoint time ({_f(r.get('client_ms_total'), '.2f')}x "
                   f"client side, {_f(r.get('server_ms_total'), '.2f')}x daemon side, "
                   f"{_f(r.get('freeze_ms_total'), '.2f')}x time frozen) and snapshots "
                   f"({a['snapshots']} vs {f['snapshots']}: skipped turns alias their parent, "
                   "no layer is made).")
        rb = r.get("bytes_changed_total")
        if rb is not None and math.isfinite(rb) and abs(rb - 1) < 0.05:
            out.append("- It does not save bytes: a full checkpoint of a turn that changed no "
                       "file also stores ~0 file bytes (the new layer is an empty btrfs "
                       "snapshot), so bytes changed and the store's used space are about the "
                       "same with and without the policy.")
    ov = agg.get("overhead")
    if ov:
        lo, hi = ov.get("action_overhead_ci95_pct") or (None, None)
        out.append(f"- Inspector: {_f(ov.get('action_overhead_pct'), '+.2f', ' %')} on the "
                   f"actions' wall time (95 % interval {_f(lo, '+.2f')} .. {_f(hi, '+.2f')} %), "
                   f"{_f(ov.get('cgroup_usage_overhead_pct'), '+.2f', ' %')} on the sandboxes' "
                   "CPU (the probes), and the daemon's event consumer adds "
                   f"{_f((ov.get('daemon_cpu_extra_ms') or 0) / 1000, '.1f')} s of CPU "
                   f"({_f(ov.get('daemon_cpu_extra_pct_of_actions'), '.2f', ' %')} of the "
                   "actions' wall time), on the daemon's trio thread. The median action is "
                   f"{_f(ov.get('per_action_median_diff_ms'), '+.2f')} ms slower with the "
                   "inspector: a small fixed cost per exec, which weighs most on the "
                   "shortest commands.")
    return out or ["- (nothing measured)"]


def results_doc(trajs: list[dict[str, Any]], opts: Options, command: str, kind: str,
                errors: list[dict[str, Any]]) -> dict[str, Any]:
    agg = aggregate(trajs)
    return {"benchmark": "swebench-policy", "kind": kind, "command": command,
            "options": opts.json(), "method": METHOD, "trajectories": trajs,
            "errors": errors, "summary": agg, "targets": targets(agg)}


def report(out: Path, md: Path) -> tuple[Path, Path]:
    """Re-summarise DIR/results.json (nothing measured), redraw the PNG, write markdown."""
    doc = json.loads((out / "results.json").read_text())
    for t in doc["trajectories"]:
        t["summary"] = summarize_trajectory(t)
    doc["summary"] = aggregate(doc["trajectories"])
    doc["targets"] = targets(doc["summary"])
    png = plot(doc, out / "policy.png")
    try:
        rel = os.path.relpath(png, md.parent)
    except ValueError:
        rel = str(png)
    md.write_text(markdown(doc, rel))
    return png, md


# ---- CLI ---------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.swebench.policy", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"default {DEFAULT_OUT}")
    p.add_argument("--quick", action="store_true",
                   help=f"the quick set ({', '.join(QUICK)}), first {QUICK_ACTIONS} actions, "
                   "5 overhead rounds")
    p.add_argument("--trajectory", action="append", type=Path, default=[], metavar="FILE",
                   help="a trajectory JSON (repeatable; default: every trajectory, or the "
                   "quick set with --quick)")
    p.add_argument("--max-actions", type=int, help=f"replay the first N actions (--quick: "
                   f"{QUICK_ACTIONS}; default all)")
    p.add_argument("--rounds", type=int, help="overhead rounds per trajectory, each every "
                   "action on both daemons, interleaved (default 5)")
    p.add_argument("--think", type=float, default=Options.think,
                   help="untimed pause before each action of the checkpointed runs "
                   "(default %(default)s s)")
    p.add_argument("--timeout", type=float, default=Options.timeout)
    p.add_argument("--warmup", type=int, default=Options.warmup_actions,
                   help="actions run untimed once per daemon and trajectory first")
    p.add_argument("--verify-per-kind", type=int, default=Options.verify_per_kind)
    p.add_argument("--seed", type=int, default=Options.seed)
    p.add_argument("--md", type=Path, default=MD_DEFAULT, help="default %(default)s")
    p.add_argument("--report-only", action="store_true",
                   help="measure nothing: regenerate DIR/policy.png and the markdown from "
                   "DIR/results.json")
    p.add_argument("--cache-dir", type=Path, default=default_cache_dir())
    p.add_argument("--tmp-parent", type=Path, default=Path("/var/tmp"))
    p.add_argument("--keep-state", action="store_true")
    return p.parse_args(argv)


def make_options(args: argparse.Namespace) -> Options:
    return Options(max_actions=args.max_actions or (QUICK_ACTIONS if args.quick else None),
                   rounds=args.rounds or 5, think=args.think,
                   timeout=args.timeout, warmup_actions=args.warmup,
                   verify_per_kind=args.verify_per_kind, seed=args.seed)


def run(args: argparse.Namespace) -> int:
    opts = make_options(args)
    files = list(args.trajectory) or ([TRAJECTORY_DIR / q for q in QUICK] if args.quick
                                      else all_files())
    full_trajs = [load(f) for f in dict.fromkeys(files)]
    t_start = time.time()
    load_start = os.getloadavg()
    others = other_daemons()
    if others:
        log(f"warning: {len(others)} other deltaboxd process(es) running; timings may be noisy")
    # the host side (downloads) for the whole trajectory: the wheelhouse is keyed on it
    hosts = {t.path: env.prepare_host(t, args.cache_dir) for t in full_trajs}
    trajs = [dataclasses.replace(t, actions=t.actions[:opts.max_actions])
             if opts.max_actions else t for t in full_trajs]
    command = " ".join(["python -m benchmarks.swebench.policy", *sys.argv[1:]])
    kind = "quick" if args.quick else ("full" if not args.trajectory else "custom")
    done: list[dict[str, Any]] = []
    errors: list[dict[str, Any]] = []
    machine: dict[str, Any] = {}
    daemons = {"on": PrivateDaemon(parent=args.tmp_parent, keep=args.keep_state),
               "off": PrivateDaemon(parent=args.tmp_parent, keep=args.keep_state,
                                    extra_args=["--no-inspector"])}
    json_path = args.out / "results.json"
    with terminate_as_exception():
        try:
            for d in daemons.values():
                d.start()
            backend = wait_inspector(daemons["on"])
            log(f"inspector: {backend}; off daemon: {daemons['off'].info().inspector_backend}")
            machine = machine_info(daemons["on"].socket)
            machine.update(inspector_backend=backend,
                           off_daemon_inspector=daemons["off"].info().inspector_backend)
            for i, t in enumerate(trajs):
                log(f"trajectory {t.name}: {len(t.actions)} actions, {t.spec}")
                try:
                    done.append(measure_trajectory(daemons, t, hosts[t.path], opts, i))
                except Exception as e:       # one broken task must not lose the others
                    log(f"trajectory {t.name} failed: {type(e).__name__}: {e}")
                    errors.append({"trajectory": t.name,
                                   "error": f"{type(e).__name__}: {e}"[:3000]})
                write_json(json_path, results_doc(done, opts, command, kind, errors), machine)
        finally:
            for d in daemons.values():
                d.stop()
    doc = results_doc(done, opts, command, kind, errors)
    doc["duration_s"] = time.time() - t_start
    machine.update(loadavg_start=load_start, loadavg_end=os.getloadavg(),
                   other_deltaboxd_at_start=others)
    clean, text = leakcheck()
    doc["cleanup"] = {"own_leaks": [x for d in daemons.values() for x in d.leaks],
                      "problems": [x for d in daemons.values() for x in d.cleanup_problems],
                      "leakcheck_clean": clean, "leakcheck": text}
    write_json(json_path, doc, machine)
    png, md = report(args.out, args.md)
    print_summary(doc)
    print(f"JSON: {json_path}\nPNG:  {png}\nMD:   {md}")
    if errors:
        return 1
    return 3 if doc["cleanup"]["own_leaks"] else 0


def print_summary(doc: dict[str, Any]) -> None:
    agg = doc["summary"]
    if "fractions" in agg:
        fr = agg["fractions"]
        print("turn kinds (auto): " + ", ".join(f"{k} {agg['kinds'][k]} ({fr[k]:.1%})"
                                                for k in KINDS))
    if "ratio_full_over_auto" in agg:
        r = agg["ratio_full_over_auto"]
        print(f"checkpoint time total client auto {agg['auto']['client_ms_total']:.0f} ms / "
              f"full {agg['full']['client_ms_total']:.0f} ms (full/auto "
              f"{r['client_ms_total']:.2f}x; daemon side {r['server_ms_total']:.2f}x)")
    if "verify" in agg:
        v = agg["verify"]
        print(f"rollback check: {v['matched']}/{sum(v['checked'].values())} hashes restored")
    if "overhead" in agg:
        o = agg["overhead"]
        print(f"inspector overhead: wall {_f(o.get('action_overhead_pct'), '+.2f', ' %')}, "
              f"sandbox cpu {_f(o.get('cgroup_usage_overhead_pct'), '+.2f', ' %')}")
    for name, t in doc["targets"].items():
        print(f"  {name}: {t['value']} -> "
              f"{'n/a' if t['pass'] is None else 'PASS' if t['pass'] else 'FAIL'}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report_only:
        png, md = report(args.out, args.md)
        print(f"PNG: {png}\nMD:  {md}")
        return 0
    if os.geteuid() != 0:
        print("benchmarks.swebench.policy: run as root (it starts private deltaboxd)",
              file=sys.stderr)
        return 1
    return run(args)


if __name__ == "__main__":
    run_main(main, "the private daemons were stopped")
