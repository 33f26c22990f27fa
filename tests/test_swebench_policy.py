"""benchmarks.swebench.policy without a daemon: the pure helpers (sampling, interleaving,
cpu.stat parsing), the summaries and targets of a small synthetic results.json, and the
report (markdown + PNG) regenerated from it, as `--report-only` does."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from benchmarks.common import write_json
from benchmarks.swebench import policy


def test_spread_and_verify_sample() -> None:
    assert policy.spread([], 3) == []
    assert policy.spread([1, 2], 4) == [1, 2]
    assert policy.spread(list(range(10)), 3) == [0, 4, 9]    # round(4.5) == 4
    assert policy.spread(list(range(10)), 1) == [9]
    kinds = ["skipped"] * 12 + ["fs"] * 5 + ["full"]
    a = policy.verify_sample(kinds, 3, seed=7)
    assert a == policy.verify_sample(kinds, 3, seed=7)          # seeded
    assert sorted(a) == [0, 6, 11, 12, 14, 16, 17]
    assert a != sorted(a) or len(a) < 3                        # shuffled: back and forth
    assert policy.verify_sample(kinds, 0, seed=1) == []


def test_pair_order_alternates_and_mirrors() -> None:
    r0 = [policy.pair_order(i, 0) for i in range(4)]
    r1 = [policy.pair_order(i, 1) for i in range(4)]
    assert r0 == [("on", "off"), ("off", "on"), ("on", "off"), ("off", "on")]
    assert r1 == [tuple(reversed(p)) for p in r0]
    firsts = [p[0] for p in r0 + r1]
    assert firsts.count("on") == firsts.count("off")


def test_parse_cpu_stat_and_proc_cpu() -> None:
    text = "usage_usec 83605\nuser_usec 41802\nsystem_usec 41803\nnice_usec 0\n"
    assert policy.parse_cpu_stat(text) == {"usage_ms": 83.605, "user_ms": 41.802,
                                           "system_ms": 41.803}
    assert policy.parse_cpu_stat("") == {}
    import os

    me = policy.proc_cpu_ms(os.getpid())
    assert me is not None and me >= 0
    assert policy.proc_cpu_ms(None) is None


def _turn(i: int, kind: str, ms: float, nbytes: int = 0) -> dict[str, Any]:
    return {"action": i, "code": 0, "action_ms": 50.0, "cp": f"cp-{i}", "kind": kind,
            "reasons": ["files written: /testbed/x"] if kind == "fs" else
            ["first checkpoint"] if kind == "full" else ["nothing recovery-relevant changed"],
            "client_ms": ms, "server_ms": ms * 0.8, "freeze_ms": ms * 0.5,
            "files_changed": 1 if nbytes else 0, "bytes_changed": nbytes,
            "processes_from": None, "refused": ""}


def _round(r: int, on: list[float], off: list[float]) -> dict[str, Any]:
    return {"round": r, "loadavg": 1.0, "daemon_cpu_ms": {"on": 30.0, "off": 10.0},
            "actions": [{"action": i, "order": list(policy.pair_order(i, r)), "on_ms": a,
                         "off_ms": b, "on_code": 0, "off_code": 0, "on_cpu_ms": a / 2,
                         "off_cpu_ms": b / 2} for i, (a, b) in enumerate(zip(on, off))]}


def _trajectory(name: str, kinds: list[str], mismatch: bool = False) -> dict[str, Any]:
    auto = [_turn(i, k, {"skipped": 2.0, "fs": 5.0, "full": 9.0}[k],
                  100 if k != "skipped" else 0) for i, k in enumerate(kinds)]
    full = [dict(_turn(i, "full", 9.0, 100 if k != "skipped" else 0),
                 reasons=["mode=full requested"]) for i, k in enumerate(kinds)]
    h = {"workdir": "a", "git_status": "b", "site_packages": "c"}
    checks = [{"action": 0, "kind": kinds[0], "reasons": auto[0]["reasons"], "match": True,
               "rollback_ms": 3.0, "rollback_server_ms": 2.0, "process_state": "restored",
               "expected": h, "got": h}]
    if mismatch:
        checks.append({"action": 1, "kind": "skipped", "reasons": ["nothing"], "match": False,
                       "rollback_ms": 3.0, "rollback_server_ms": 2.0, "process_state": "",
                       "expected": h, "got": dict(h, workdir="z"), "differs": ["workdir"],
                       "action_label": "sed -i s/a/b/ x.py"})
    return {"trajectory": {"name": name, "actions": len(kinds)},
            "policy": {"auto": {"mode": "auto", "turns": auto, "final_hash": h,
                                "store_used_delta_bytes": 4096},
                       "full": {"mode": "full", "turns": full, "final_hash": h,
                                "store_used_delta_bytes": 65536}},
            "verify": {"turns": auto, "checks": checks},
            "overhead": [_round(0, [101.0, 50.0], [100.0, 49.0]),
                         _round(1, [99.0, 51.0], [100.0, 50.0])]}


def _doc(mismatch: bool = False) -> dict[str, Any]:
    trajs = [_trajectory("mini-swe-agent-x__psf__requests-1", ["full", "skipped", "skipped",
                                                               "fs"], mismatch),
             _trajectory("moatless__psf__requests-2", ["fs", "skipped"])]
    for t in trajs:
        t["summary"] = policy.summarize_trajectory(t)
    return policy.results_doc(trajs, policy.Options(), "test", "test", [])


def test_summaries_and_targets() -> None:
    doc = _doc()
    s = doc["trajectories"][0]["summary"]
    assert s["kinds"] == {"skipped": 2, "fs": 1, "full": 1}
    assert s["auto"]["client_ms_total"] == 18.0 and s["full"]["client_ms_total"] == 36.0
    assert s["ratio_full_over_auto"]["client_ms_total"] == 2.0
    assert s["auto"]["snapshots"] == 2 and s["full"]["snapshots"] == 4
    assert s["codes_agree"] and s["final_hash_agree"]
    agg = doc["summary"]
    assert agg["kinds"] == {"skipped": 3, "fs": 2, "full": 1}
    assert math.isclose(agg["fractions"]["skipped"], 0.5)
    ov = agg["overhead"]
    assert ov["rounds"] == 4 and ov["pairs"] == 8
    assert math.isclose(ov["on"]["action_ms"], 2 * (101 + 50 + 99 + 51))
    assert math.isclose(ov["action_overhead_pct"], (602 / 598 - 1) * 100)
    lo, hi = ov["action_overhead_ci95_pct"]
    assert lo <= ov["action_overhead_pct"] <= hi
    assert ov["on"]["daemon_cpu_ms"] == 120.0 and ov["daemon_cpu_extra_ms"] == 80.0
    t = doc["targets"]
    assert t["skipped_fraction"]["pass"] is True           # 50 % is enough
    assert t["no_wrong_skip"]["pass"] is True
    assert t["inspector_overhead_pct"]["pass"] is True     # +0.67 %
    bad = _doc(mismatch=True)
    assert bad["targets"]["no_wrong_skip"]["pass"] is False
    assert bad["summary"]["verify"]["mismatches"][0]["differs"] == ["workdir"]


def test_report_only_regenerates_markdown_and_png(tmp_path: Path) -> None:
    doc = _doc(mismatch=True)
    doc["duration_s"] = 60.0
    doc["cleanup"] = {"own_leaks": [], "leakcheck_clean": True}
    machine = {"cpu_model": "test cpu", "nproc": 2, "git_commit": "abc123def456",
               "time_utc": "2026-01-01T00:00:00Z", "loadavg_start": [0.5, 0, 0],
               "loadavg_end": [0.7, 0, 0], "inspector_backend": "ebpf (test)",
               "deltabox": {"store_backend": "btrfs-loop"}}
    write_json(tmp_path / "results.json", doc, machine)
    # stale summaries in the file must not matter: --report-only recomputes them
    raw = json.loads((tmp_path / "results.json").read_text())
    raw["summary"] = {}
    raw["targets"] = {}
    (tmp_path / "results.json").write_text(json.dumps(raw))
    md_path = tmp_path / "RESULTS-policy.md"
    assert policy.main(["--report-only", "--out", str(tmp_path), "--md", str(md_path)]) == 0
    md = md_path.read_text()
    assert (tmp_path / "policy.png").stat().st_size > 10_000
    assert "![policy](policy.png)" in md
    assert "| skipped_fraction" in md and "PASS" in md and "**FAIL**" in md
    assert "50.0% (3/6 turns)" in md
    assert "**MISMATCH** msa-x requests-1 action 1" in md
    assert "abc123def456" in md and "test cpu" in md and "load average 0.50" in md
    assert "2.00x" in md                                     # full / auto checkpoint time
    assert "| **all** |" in md
