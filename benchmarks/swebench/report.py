"""Plots and RESULTS.md from a results.json of benchmarks.swebench.run (no measuring).

    .venv/bin/python -m benchmarks.swebench.report --in DIR [--md PATH]

Redraws DIR/latency_cdf.png, DIR/e2e_vs_floor.png, DIR/fanout.png and writes RESULTS.md
(default: benchmarks/swebench/RESULTS.md) with the machine the numbers come from.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from benchmarks.common import finish_figure, percentile, pyplot

COLORS = {"floor": "#7f7f7f", "deltabox": "#1f77b4", "deltabox_turn": "#17becf",
          "copytree": "#d62728",
          "docker_commit": "#ff7f0e", "restart_replay": "#9467bd"}
SYSTEMS = tuple(COLORS)
MD_DEFAULT = Path(__file__).resolve().parent / "RESULTS.md"


def short(name: str) -> str:
    """A trajectory's file stem, shortened for axis labels."""
    for prefix in ("mini-swe-agent-", "moatless__"):
        if name.startswith(prefix):
            name = ("msa-" if prefix.startswith("mini") else "moatless-") + name[len(prefix):]
    return (name.replace("__marshmallow-code__", " ").replace("__psf__", " ")
            .replace("deepseek-", "ds-").replace("-dev", ""))


def _runs(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for t in doc.get("trajectories", []) for r in t["runs"]]


def _ops(run: dict[str, Any], name: str) -> list[dict[str, Any]]:
    """A system's operations in a run, its repeat (if it ran twice) included."""
    rs = [run["systems"].get(name), run.get("repeats", {}).get(name)]
    return [o for r in rs if r for o in r["ops"]]


# ---- plots -------------------------------------------------------------------------------

def _cdf(ax: Any, values: dict[str, list[float]], title: str) -> None:
    for name in SYSTEMS:
        xs = sorted(v for v in values.get(name, []) if v > 0)
        if not xs:
            continue
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        ax.step(xs, ys, where="post", color=COLORS[name],
                label=f"{name} (n={len(xs)}, p50 {percentile(xs, 50):.1f} ms)")
    ax.set_xscale("log")
    ax.set_xlabel("latency (ms), log scale")
    ax.set_ylabel("fraction of operations")
    ax.set_title(title, fontsize=10, loc="left")
    ax.grid(which="both", alpha=0.25)
    ax.legend(fontsize=7, loc="lower right")


def plot_cdf(doc: dict[str, Any], path: Path) -> None:
    """Latency CDF per system: saving state, restoring state, and the actions themselves."""
    save: dict[str, list[float]] = {}
    restore: dict[str, list[float]] = {}
    acts: dict[str, list[float]] = {}
    for r in _runs(doc):
        for name in r["systems"]:
            for o in _ops(r, name):
                if o["op"] == "checkpoint":
                    save.setdefault(name, []).append(o["ms"])
                elif o["op"] == "rollback":
                    restore.setdefault(name, []).append(o["ms"])
                elif o["op"] == "fork":      # one call for N children: per child
                    restore.setdefault(name, []).extend([o["ms"] / o["count"]] * o["count"])
                elif o["op"] == "child":
                    restore.setdefault(name, []).append(o["ms"])
                elif o["op"] == "action":
                    acts.setdefault(name, []).append(o["ms"])
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(18, 5.5))
    _cdf(axes[0], save, "checkpoint (every mode)")
    _cdf(axes[1], restore, "rollback, and per fan-out child (fork / fresh sandbox + restore)")
    _cdf(axes[2], acts, "the agent's actions (same commands on every system)")
    finish_figure(fig, path, "SWE-bench trajectory replay: operation latency", doc["machine"])


def plot_e2e(doc: dict[str, Any], path: Path) -> None:
    """End-to-end time of each system / the floor's, per trajectory and mode."""
    plt = pyplot()
    modes = [m for m in ("linear", "mcts", "fanout") if any(r["mode"] == m for r in _runs(doc))]
    fig, axes = plt.subplots(len(modes), 1, figsize=(14, 4.2 * max(1, len(modes))),
                             squeeze=False)
    for ax, mode in zip([a[0] for a in axes], modes):
        runs = [r for r in _runs(doc) if r["mode"] == mode]
        width = 0.8 / len(SYSTEMS)
        for si, name in enumerate(SYSTEMS):
            xs, ys = [], []
            for i, r in enumerate(runs):
                ps = r["summary"]["per_system"].get(name)
                if ps and ps.get("over_floor") is not None:
                    xs.append(i - 0.4 + width * (si + 0.5))
                    ys.append(ps["over_floor"])
            if xs:
                ax.bar(xs, ys, width * 0.9, color=COLORS[name], label=name, alpha=0.85)
                for x, y in zip(xs, ys):
                    ax.annotate(f"{y:.2f}", (x, y), textcoords="offset points", xytext=(0, 2),
                                ha="center", fontsize=6, rotation=90)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.axhline(1.03, color="gray", linestyle="--", linewidth=0.8)
        ax.annotate("floor + 3 %", (len(runs) - 0.5, 1.03), textcoords="offset points",
                    xytext=(0, 2), ha="right", fontsize=7, color="gray")
        ax.set_xticks(range(len(runs)))
        ax.set_xticklabels([short(r["trajectory"]) for r in runs], fontsize=7)
        top = max([p.get_height() for p in ax.patches] or [1.0])
        if top > 4:
            ax.set_yscale("log")
            from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter

            ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
            ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
            ax.yaxis.set_minor_formatter(NullFormatter())
        else:
            ax.set_ylim(0, top * 1.15)
        ax.set_ylabel("e2e time / floor's")
        extra = " (all N together)" if mode == "fanout" else ""
        ax.set_title(f"{mode}: end-to-end time normalised to the no-C/R floor{extra}",
                     fontsize=10, loc="left")
        ax.grid(axis="y", which="both", alpha=0.25)
        ax.legend(fontsize=7, ncol=len(SYSTEMS), loc="lower right", bbox_to_anchor=(1.0, 1.0),
                  frameon=False)
    finish_figure(fig, path, "SWE-bench trajectory replay: end-to-end", doc["machine"])


def plot_fanout(doc: dict[str, Any], path: Path) -> bool:
    runs = [r for r in _runs(doc) if r["mode"] == "fanout"]
    if not runs:
        return False
    plt = pyplot()
    fig, axes = plt.subplots(1, len(runs), figsize=(6.5 * len(runs), 4.8), squeeze=False)
    for ax, r in zip(axes[0], runs):
        for name in SYSTEMS:
            pn = r["systems"].get(name, {}).get("per_n")
            if not pn:
                continue
            ns = sorted(int(n) for n in pn)
            ax.plot(ns, [pn[str(n)]["phase_ms"] for n in ns], marker="o", color=COLORS[name],
                    label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ns = r["fanout"]["counts"]
        ax.set_xticks(ns)
        ax.set_xticklabels([str(n) for n in ns])
        ax.xaxis.set_minor_formatter(plt.NullFormatter())
        ax.set_xlabel("children N")
        from matplotlib.ticker import FormatStrFormatter, NullFormatter

        ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_ylabel("fan-out phase (ms, log)")
        ax.set_title(f"{short(r['trajectory'])}: N children from the checkpoint after action "
                     f"{r['fanout']['mid']},\nthen the next action in each", fontsize=9,
                     loc="left")
        ax.grid(which="both", alpha=0.25)
        ax.legend(fontsize=7)
    finish_figure(fig, path, "SWE-bench fan-out", doc["machine"])
    return True


def plots(doc: dict[str, Any], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    if not _runs(doc):
        return []
    made = [out / "latency_cdf.png", out / "e2e_vs_floor.png"]
    plot_cdf(doc, made[0])
    plot_e2e(doc, made[1])
    if plot_fanout(doc, out / "fanout.png"):
        made.append(out / "fanout.png")
    return made


# ---- text --------------------------------------------------------------------------------

def _f(v: Any, fmt: str = ".1f", suffix: str = "") -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return f"{v:{fmt}}{suffix}"


def _agree(c: dict[str, Any]) -> str:
    n = sum(x["compared"] for x in c.values())
    bad = sum(len(x["mismatches"]) for x in c.values())
    return f"{n - bad}/{n}" if n else "-"


def turn(ps: dict[str, Any]) -> str:
    """DeltaBox with turn-boundary checkpoints: its e2e time and overhead over the floor."""
    t = ps.get("deltabox_turn")
    return "n/a" if t is None else (f"{t['e2e_ms'] / 1000:.2f} s "
                                    f"({_f(t.get('overhead_pct'), '+.1f', ' %')})")


LABELS = {"deltabox": "DeltaBox"}


def twice(doc: dict[str, Any]) -> list[str]:
    """The systems that ran twice somewhere in the run, in their order of the repeats."""
    names = {n for r in _runs(doc) for n in r.get("repeats", {})}
    return [n for n in ("floor", "deltabox", "deltabox_turn", "docker_commit") if n in names]


def repeated(p: dict[str, Any]) -> str:
    """Where the plan's repeated systems ran twice, if not in every mode it has."""
    if not p.get("repeat", True):
        return " (not in this run: --no-repeat)"
    modes = [m for m in p["modes"] if m in p.get("repeat_modes", p["modes"])]
    return "" if modes == list(p["modes"]) else f" in {', '.join(modes) or 'no mode'}"


def repeat_order(doc: dict[str, Any], p: dict[str, Any]) -> str:
    """How the systems were ordered (core.run_order, modes.run_trees_lockstep), in words."""
    names = [LABELS.get(n, n) for n in twice(doc) or ["floor", "deltabox"]]
    text = f"{', '.join(names[:-1])} and {names[-1]} ran twice{repeated(p)}"
    if p.get("lockstep", False):
        text += (" and, in linear and mcts, every replay in lockstep (step by step, each "
                 "system in turn)")
    else:
        text += f", in the order {', '.join(names + names[::-1])}, then the other baselines"
    return text[0].upper() + text[1:]


def run_rows(doc: dict[str, Any]) -> list[str]:
    rep = twice(doc) or ["floor", "deltabox"]
    head = ("| trajectory | mode | floor | DeltaBox | overhead | C/R share | repeat: "
            f"{', '.join(LABELS.get(n, n) for n in rep)} | DeltaBox, turn checkpoints (overhead) | "
            "copytree | docker_commit | restart_replay | exit codes | state hashes |")
    rows = [head, "|" + "---|" * 13]
    for r in _runs(doc):
        s = r["summary"]
        ps = s["per_system"]
        rat = s.get("ratio_vs_deltabox", {})

        def base(b: str) -> str:
            if b not in ps:
                return "n/a" if b in r.get("not_run", {}) else "-"
            return f"{ps[b]['e2e_ms'] / 1000:.2f} s ({_f(rat.get(b), '.2f', 'x')})"

        rows.append(
            f"| {short(r['trajectory'])} | {r['mode']} | {ps['floor']['e2e_ms'] / 1000:.2f} s | "
            f"{ps['deltabox']['e2e_ms'] / 1000:.2f} s | "
            f"{_f(s.get('overhead_pct'), '+.1f', ' %')} | "
            f"{_f(s.get('cr_share_pct'), '.1f', ' %')} | "
            f"{', '.join(_f(s.get(f'{n}_repeat_pct'), '+.1f', ' %') for n in rep)} | "
            f"{turn(ps)} | "
            f"{base('copytree')} | "
            f"{base('docker_commit')} | {base('restart_replay')} | "
            f"{_agree(s['codes_vs_deltabox'])} | {_agree(s['hashes_vs_deltabox'])} |")
    return rows


def op_rows(doc: dict[str, Any]) -> list[str]:
    """p50 / p90 per system and operation, over every run of a mode."""
    rows = ["| mode | system | checkpoint p50 / p90 | rollback p50 / p90 | fork or child "
            "p50 / p90 (per child) | action p50 |", "|---|---|---|---|---|---|"]
    for mode in ("linear", "mcts", "fanout"):
        runs = [r for r in _runs(doc) if r["mode"] == mode]
        for name in SYSTEMS:
            ops = [o for r in runs for o in _ops(r, name)]
            if not ops:
                continue

            def pp(kind: str) -> str:
                xs: list[float] = []
                for o in ops:
                    if o["op"] == kind == "fork":
                        xs += [o["ms"] / o["count"]] * o["count"]
                    elif o["op"] == kind:
                        xs.append(o["ms"])
                if not xs:
                    return "-"
                return f"{percentile(xs, 50):.1f} / {percentile(xs, 90):.1f} ms"

            child = pp("fork") if name == "deltabox" else pp("child")
            rows.append(f"| {mode} | {name} | {pp('checkpoint')} | {pp('rollback')} | {child} "
                        f"| {pp('action').split(' /')[0]} ms |")
    return rows


def fanout_rows(doc: dict[str, Any]) -> list[str]:
    rows = ["| trajectory | N | floor | DeltaBox (overhead) | copytree | docker_commit | "
            "restart_replay |", "|---|---|---|---|---|---|---|"]
    for r in _runs(doc):
        if r["mode"] != "fanout":
            continue
        for n, row in r["summary"].get("per_n", {}).items():
            def cell(name: str) -> str:
                c = row.get(name)
                if c is None:
                    return "not run"
                return (f"{c['phase_ms']:.0f} ms ({_f(c['phase_ratio_vs_deltabox'], '.2f', 'x')}"
                        f"; e2e {_f(c['ratio_vs_deltabox'], '.2f', 'x')})")
            dbx = row["deltabox"]
            rows.append(f"| {short(r['trajectory'])} | {n} | {row['floor']['phase_ms']:.0f} ms | "
                        f"{dbx['phase_ms']:.0f} ms "
                        f"({_f(row.get('deltabox_phase_overhead_pct'), '+.0f', ' %')}; e2e "
                        f"{_f(row.get('deltabox_overhead_pct'), '+.1f', ' %')}) | "
                        f"{cell('copytree')} | {cell('docker_commit')} | "
                        f"{cell('restart_replay')} |")
    return rows


def target_rows(doc: dict[str, Any]) -> list[str]:
    rows = ["| target | value | pass |", "|---|---|---|"]
    for name, t in doc.get("targets", {}).items():
        v = t["value"]
        if isinstance(v, float):
            vs = f"{v:+.1f} %" if "pct" in name else f"{v:.3g}"
        elif isinstance(v, dict):
            vs = "; ".join(f"{k}: " + (", ".join(f"{b} {x:.2f}x" for b, x in val.items())
                                       if isinstance(val, dict) else str(val))
                           for k, val in v.items())
        else:
            vs = str(v)
        verdict = "n/a" if t["pass"] is None else ("PASS" if t["pass"] else "**FAIL**")
        rows.append(f"| {name} ({t['target']}) | {vs} | {verdict} |")
    return rows


def machine_lines(m: dict[str, Any]) -> list[str]:
    d = m.get("deltabox", {})
    return [
        f"- machine: {m.get('cpu_model', '?')}, {m.get('nproc', '?')} cpus, "
        f"{m.get('memory_bytes', 0) / 2**30:.0f} GiB, "
        f"Linux {m.get('uname', {}).get('release', '?')}",
        f"- DeltaBox store: {d.get('store_backend', '?')} ({d.get('store_fs', '?')}), "
        f"cgroup {d.get('cgroup_version', '?')}, durability {d.get('store_durability', '?')}",
        f"- commit {(m.get('git_commit') or '?')[:12]}"
        + (f" + uncommitted changes to {len(m.get('git_modified_files', []))} files"
           if m.get("git_modified_files") else "")
        + f"; measured {m.get('time_utc', '?')}; load average "
        f"{_f((m.get('loadavg_start') or [None])[0], '.2f')} at start, "
        f"{_f((m.get('loadavg_end') or [None])[0], '.2f')} at end",
    ]


def per_step_lines(doc: dict[str, Any]) -> list[str]:
    """What DeltaBox's C/R costs per expansion against what an action costs, per trajectory
    and mode: why the overhead is large where the agent's commands take milliseconds."""
    out = []
    for r in _runs(doc):
        if r["mode"] == "fanout":
            continue
        ps = r["summary"]["per_system"]
        acts = [o["ms"] for o in _ops(r, "floor") if o["op"] == "action"]
        n = sum(1 for o in r["systems"]["floor"]["ops"] if o["op"] == "action")
        if not n:
            continue
        extra = ps["deltabox"]["action_ms"] - ps["floor"]["action_ms"]
        out.append(f"- {short(r['trajectory'])}, {r['mode']}: DeltaBox's checkpoints and "
                   f"rollbacks cost {ps['deltabox']['cr_ms'] / n:.1f} ms per step; the floor's "
                   f"actions {ps['floor']['e2e_ms'] / n:.1f} ms per step on average (median "
                   f"{percentile(acts, 50):.1f} ms); DeltaBox's own actions, against the floor's: "
                   f"{extra / n:+.1f} ms per step")
    return out


def not_slower_lines(doc: dict[str, Any]) -> list[str]:
    out = []
    for r in _runs(doc):
        for b, x in r["summary"].get("ratio_vs_deltabox", {}).items():
            if x <= 1.0:
                ps = r["summary"]["per_system"]
                out.append(f"- {short(r['trajectory'])}, {r['mode']}: {b} {x:.2f}x (C/R "
                           f"{ps[b]['cr_ms']:.0f} ms vs DeltaBox's {ps['deltabox']['cr_ms']:.0f} "
                           "ms)")
    return out


def vs_original_lines(doc: dict[str, Any]) -> list[str]:
    out = []
    for r in _runs(doc):
        vo = r["summary"].get("vs_original")
        if not vo or r["mode"] != "linear":
            continue
        diffs = ", ".join(f"#{d['action']} `{d['cmd'][:50]}` {d['original']} -> {d['replay']}"
                          for d in vo["differing_actions"][:6])
        out.append(f"- {short(r['trajectory'])}: {vo['same']} same, {vo['different']} "
                   f"different{': ' + diffs if diffs else ''}")
    return out


def markdown(doc: dict[str, Any], results_dir: str, img_dir: str = "results",
             md_arg: str = "") -> str:
    p = doc["plan"]
    m = doc["machine"]
    agg = doc.get("summary", {})
    lines = [
        "# SWE-bench trajectory replay: results",
        "",
        f"Generated by `python -m benchmarks.swebench.report --in {results_dir}{md_arg}` from "
        f"`{results_dir}/results.json`, measured by `{doc.get('command', '?')}` "
        f"({doc.get('mode')} run, {doc.get('duration_s', 0) / 60:.1f} min). What is measured "
        "and how: [README.md](README.md).",
        "",
        *machine_lines(m),
        f"- plan: modes {', '.join(p['modes'])}; mcts {p['expansions']} expansions / "
        f"{p['rollbacks']} rollbacks, seed {p['seed']}; fan-out N = "
        f"{', '.join(map(str, p['fanout_counts']))} (restart_replay up to "
        f"{p['replay_fanout_max']}); per-action timeout {p['timeout']:g} s; think pause "
        f"{p['think']:g} s before each decision (untimed, every system)"
        + (f"; linear replays the first {p['linear_actions']} actions"
           if p.get("linear_actions") else ""),
        "",
        "## Targets",
        "",
        *target_rows(doc),
        "",
    ]
    for mode, a in agg.items():
        lines.append(f"- **{mode}**: DeltaBox overhead over the floor, all trajectories "
                     f"together: {_f(a.get('total_overhead_pct'), '+.1f', ' %')}; baselines' "
                     "end-to-end time / DeltaBox's: " + ", ".join(
                         f"{b} {x:.2f}x" for b, x in a["total_ratio_vs_deltabox"].items()))
        if a.get("turn_total_overhead_pct") is not None:
            lines[-1] += ("; with checkpoints at the actions' ends (exec checkpoint=, taken "
                          "during the think pause): "
                          f"{_f(a['turn_total_overhead_pct'], '+.1f', ' %')}")
    lines += ["", "Per step, in this run:", ""] + per_step_lines(doc)
    slower = not_slower_lines(doc)
    if slower:
        lines += ["", "Runs where a baseline was not slower than DeltaBox:", ""] + slower
    lines += [
        "",
        "## End to end, per trajectory and mode",
        "",
        "Seconds of timed operations (actions + checkpoint / rollback / fork / restore); in "
        f"brackets each baseline's time / DeltaBox's. {repeat_order(doc, p)}; their figures "
        "are the means, and *repeat* gives how far the second replay was from the first (the "
        "noise of replaying the same commands here). *overhead* = (DeltaBox - floor) / floor; "
        "*C/R share* = DeltaBox's checkpoint + rollback time / its own action time (the same "
        "question without two replays' noise). Exit codes and state hashes: agreeing / "
        "compared, every system against DeltaBox at the same steps.",
        "",
        *run_rows(doc),
        "",
        f"![end-to-end time over the floor]({img_dir}/e2e_vs_floor.png)",
        "",
        "## Operation latency",
        "",
        *op_rows(doc),
        "",
        f"![latency CDF]({img_dir}/latency_cdf.png)",
        "",
    ]
    fan = fanout_rows(doc)
    if len(fan) > 2:
        lines += ["## Fan-out", "",
                  "Fan-out phase: make N children from the mid-trajectory checkpoint and run the "
                  "next action in each (the floor runs it N times). In brackets: DeltaBox's phase "
                  "over the floor's, and its e2e overhead (prefix + checkpoint + phase; each "
                  "system runs the prefix once, so the prefix's noise is in it); for the "
                  "baselines, their phase / DeltaBox's and their e2e / DeltaBox's.", "", *fan,
                  "", f"![fan-out]({img_dir}/fanout.png)", ""]
    vo = vs_original_lines(doc)
    if vo:
        lines += ["## Exit codes against the original runs (information)", "",
                  "The replay's environment is not the agent's (Python 3.11 and current test "
                  "tools instead of the SWE-bench image), so some codes differ from the "
                  "recorded ones; every system sees the same ones.", "", *vo, ""]
    if doc.get("errors"):
        lines += ["## Errors", ""] + [f"- {e['trajectory']}: {e['error'][:300]}"
                                      for e in doc["errors"]] + [""]
    c = doc.get("cleanup", {})
    lines += ["## Cleanup", "",
              f"Own leftovers: {c.get('own_leaks') or 'none'}; leakcheck (whole machine): "
              + ("clean." if c.get("leakcheck_clean")
                 else f"NOT clean: {str(c.get('leakcheck'))[:500]}."),
              ""]
    return "\n".join(lines)


def print_summary(doc: dict[str, Any]) -> None:
    print("")
    print("SWE-bench trajectory replay (seconds of timed operations; brackets: baseline / "
          "DeltaBox)")
    for row in run_rows(doc)[2:]:
        print(" ".join(c.strip() for c in row.strip("|").split("|")))
    print("")
    for row in target_rows(doc)[2:]:
        print("  " + " ".join(c.strip() for c in row.strip("|").split("|")))
    print("")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.swebench.report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--in", dest="src", type=Path, required=True,
                   help="directory with results.json")
    p.add_argument("--md", type=Path, default=MD_DEFAULT, help="default %(default)s")
    p.add_argument("--no-plots", action="store_true", help="only RESULTS.md")
    p.add_argument("--resummarize", action="store_true",
                   help="recompute summaries and targets from the raw operations and rewrite "
                   "results.json first (after a change to the summaries; measures nothing)")
    args = p.parse_args(argv)
    path = args.src / "results.json"
    doc = json.loads(path.read_text())
    if args.resummarize:
        from benchmarks.common import write_json

        from .core import resummarize

        machine = doc.pop("machine", {})
        doc = resummarize(doc)
        write_json(path, doc, machine)
        doc["machine"] = machine
    if not args.no_plots:
        for path in plots(doc, args.src):
            print(f"PNG: {path}")
    try:
        shown = str(args.src.resolve().relative_to(Path.cwd()))
    except ValueError:
        shown = str(args.src)
    img_dir = os.path.relpath(args.src.resolve(), args.md.resolve().parent)
    md_arg = "" if args.md.resolve() == MD_DEFAULT else f" --md {args.md}"
    args.md.write_text(markdown(doc, shown, img_dir, md_arg))
    print(f"MD:  {args.md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
