"""The report of a benchmark run (``bench.py``): medians and quartiles, ratios paired round by
round, where the commands go, and each target met or missed, rendered as text. Pure: it reads
the runs' figures and the report's dict, never a server.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from measure import med
from modes import DEADLINE, LEAN, TRACED

# Variants compared with the plain flow only (not with chord or group).
VARIANTS = (DEADLINE, TRACED)
# The size of the per-command profile ("where the commands go"): its first KxN when absent.
PROFILE_SIZE = "200x5"
PROFILE_MODES = ("flow", "chord", "group")


# --- summary ------------------------------------------------------------------------------


@dataclass
class Run:
    """One mode's run of one round at one size: what ``bench.py`` measured."""

    mode: str
    size: str
    round: int
    children: int
    enqueue_s: float
    e2e_s: float
    commands: int
    by_command: dict[str, int] = field(default_factory=dict)

    @property
    def enqueue_rate(self) -> float:
        return self.children / self.enqueue_s

    @property
    def e2e_rate(self) -> float:
        return self.children / self.e2e_s

    @property
    def commands_per_child(self) -> float:
        return self.commands / self.children


def paired(runs: list[Run], num: str, den: str, metric: Callable[[Run], float]) -> list[float]:
    """Per-round ratios of two modes: both ran in the same round, under the same load."""
    by = {(r.mode, r.round): r for r in runs}
    rounds = sorted({r.round for r in runs})
    return [
        metric(by[(num, k)]) / metric(by[(den, k)])
        for k in rounds
        if (num, k) in by and (den, k) in by
    ]


METRICS: dict[str, Callable[[Run], float]] = {
    "enqueue_children_per_s": lambda r: r.enqueue_rate,
    "e2e_children_per_s": lambda r: r.e2e_rate,
    "commands_per_child": lambda r: r.commands_per_child,
}


def summarize(runs: list[Run], modes: Sequence[str]) -> dict[str, Any]:
    out: dict[str, Any] = {"modes": {}, "ratios": {}}
    for mode in modes:
        mine = [r for r in runs if r.mode == mode]
        out["modes"][mode] = {name: med([f(r) for r in mine]) for name, f in METRICS.items()}
        top: dict[str, int] = {}
        for r in mine:
            for cmd, n in r.by_command.items():
                top[cmd] = top.get(cmd, 0) + n
        children = sum(r.children for r in mine)
        flows = sum(int(r.size.split("x")[0]) for r in mine)
        ordered = sorted(top.items(), key=lambda kv: (-kv[1], kv[0]))
        # The mean over the rounds, split by command (the commands_per_child above is the
        # median of the rounds' totals): "where the commands go".
        out["modes"][mode]["commands_per_child_by_command"] = {
            cmd: round(n / children, 3) for cmd, n in ordered
        }
        out["modes"][mode]["commands_per_flow_by_command"] = {
            cmd: round(n / flows, 2) for cmd, n in ordered
        }
    for num in modes:
        for den in modes:
            if num in VARIANTS:  # a capability's cost: against the plain flow alone
                if den != "flow":
                    continue
            elif not num.startswith("flow") or den not in ("group", "chord", "flow"):
                continue
            if num == den or (num == "flow" and den.startswith("flow")):
                continue
            key = f"{num}/{den}"
            out["ratios"][key] = {}
            for name, f in METRICS.items():
                values = paired(runs, num, den, f)
                out["ratios"][key][name] = {
                    "median": med(values),
                    "min": min(values, default=float("nan")),
                    "max": max(values, default=float("nan")),
                }
    return out


def fmt_rate(x: float) -> str:
    return f"{x:,.0f}"


def fmt_ratio(r: dict[str, float]) -> str:
    return f"{r['median']:.2f}x [{r['min']:.2f}-{r['max']:.2f}]"


def render(report: dict[str, Any]) -> str:
    lines: list[str] = []
    modes = report["modes"]
    keys = [k for summary in report["sizes"].values() for k in summary["ratios"]]
    w = max(len(x) for x in [*modes, *keys]) + 2
    head = (
        f"{'size':<9}{'mode':<{w}}{'enqueue ch/s':>14}{'e2e ch/s':>12}{'cmds/child':>12}"
        f"{'held B/child':>14}"
    )
    lines += [head, "-" * len(head)]
    for label, summary in report["sizes"].items():
        held = report["held"].get(label, {})
        for mode in modes:
            m = summary["modes"][mode]
            h = held.get(mode)
            lines.append(
                f"{label:<9}{mode:<{w}}{fmt_rate(m['enqueue_children_per_s']):>14}"
                f"{fmt_rate(m['e2e_children_per_s']):>12}{m['commands_per_child']:>12.1f}"
                f"{(f'{h:,.0f}' if h is not None else '-'):>14}"
            )
        for key, ratios in summary["ratios"].items():
            num, den = key.split("/")
            hr = held[num] / held[den] if held.get(num) and held.get(den) else None
            lines.append(
                f"{'':<9}{key:<{w}}{ratios['enqueue_children_per_s']['median']:>13.2f}x"
                f"{ratios['e2e_children_per_s']['median']:>11.2f}x"
                f"{ratios['commands_per_child']['median']:>11.2f}x"
                f"{(f'{hr:.2f}x' if hr else '-'):>14}"
            )
        lines.append("")
    lines.append("ch/s = children per second, median of the rounds; a ratio is the median of the")
    lines.append("per-round paired ratios (both modes ran in the same round); held B/child = INFO")
    lines.append("used_memory delta per enqueued child that no worker consumed.")
    return "\n".join(lines)


def profile(report: dict[str, Any]) -> dict[str, Any]:
    """Where the commands go: every mode's Redis commands per child and per flow, split by
    command name, at PROFILE_SIZE (the first KxN measured when it was not)."""
    sizes = report["sizes"]
    if not sizes:
        return {}
    label = PROFILE_SIZE if PROFILE_SIZE in sizes else next(iter(sizes))
    flows, children = (int(x) for x in label.split("x"))
    modes: dict[str, Any] = {}
    for mode, m in sizes[label]["modes"].items():
        per_child = m["commands_per_child_by_command"]
        per_flow = m["commands_per_flow_by_command"]
        modes[mode] = {
            "commands_per_child": round(sum(per_child.values()), 3),
            "commands_per_flow": round(sum(per_flow.values()), 2),
            "by_command": {
                cmd: {"per_child": per_child[cmd], "per_flow": per_flow[cmd]} for cmd in per_child
            },
        }
    return {
        "size": label,
        "flows": flows,
        "children_per_flow": children,
        "rounds": report["config"]["rounds"],
        "modes": modes,
    }


def render_profile(prof: dict[str, Any], modes: Sequence[str] = PROFILE_MODES) -> str:
    shown = [m for m in modes if m in prof.get("modes", {})]
    if not shown:
        return ""
    by = {m: prof["modes"][m]["by_command"] for m in shown}
    names = sorted(
        {cmd for m in shown for cmd in by[m]},
        key=lambda c: (-max(by[m].get(c, {}).get("per_child", 0) for m in shown), c),
    )
    w = max(len("command"), *(len(n) for n in names)) + 2
    lines = [
        f"where the commands go, {prof['size']}: Redis commands per child | per flow of "
        f"{prof['children_per_flow']} (mean of {prof['rounds']} rounds)",
        f"{'command':<{w}}" + "".join(f"{m:>18}" for m in shown),
    ]
    lines.append("-" * len(lines[1]))
    for cmd in names:
        cells = ""
        for m in shown:
            c = by[m].get(cmd)
            cells += f"{c['per_child']:>9.2f} | {c['per_flow']:>6.1f}" if c else f"{'-':>18}"
        lines.append(f"{cmd:<{w}}{cells}")
    sums = [prof["modes"][m] for m in shown]
    total = "".join(
        f"{t['commands_per_child']:>9.2f} | {t['commands_per_flow']:>6.1f}" for t in sums
    )
    lines.append(f"{'total':<{w}}{total}")
    return "\n".join(lines)


def targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target, met or missed (``met`` None: an informational row), with its median
    ratio and the min-max over the rounds, and the two sides' figures (``a`` / ``b``; beside
    ``a``, BullMQ's children/s where BullMQ was measured)."""
    rows: list[dict[str, Any]] = []

    def add(
        name: str,
        size: str,
        r: dict[str, float],
        ok: bool | None,
        a: str,
        b: str,
        unit: str,
        bullmq: str = "-",
    ) -> None:
        rows.append(
            {
                "target": name,
                "size": size,
                "value": r["median"],
                "min": r.get("min"),
                "max": r.get("max"),
                "met": ok,
                "a": a,
                "bullmq": bullmq,
                "b": b,
                "unit": unit,
            }
        )

    for label, vs in (report.get("bullmq") or {}).items():
        r = vs["ratio"]
        add(
            "enqueue, flow / BullMQ FlowProducer >= 1.2x",
            label,
            r,
            r["median"] >= 1.2,
            fmt_rate(vs["flow_children_per_s"]),
            "-",
            "ch/s",
            fmt_rate(vs["bullmq_children_per_s"]),
        )
    flows = [m for m in report["modes"] if m in ("flow", LEAN)]
    for label, summary in report["sizes"].items():
        n = int(label.split("x")[1])
        ratios, modes = summary["ratios"], summary["modes"]
        held = report["held"].get(label, {})
        held_r = report.get("held_ratios", {}).get(label, {})
        for mode in flows:
            fc, fg = ratios.get(f"{mode}/chord"), ratios.get(f"{mode}/group")
            if fc is None or fg is None:
                continue
            # flow is what the targets are about; flow-lean's rows are information.
            target = mode == "flow"

            def met(ok: bool, target: bool = target) -> bool | None:
                return ok if target else None

            want = 1.2 if n >= 50 else 1.1
            r = fc["e2e_children_per_s"]
            add(
                f"e2e, {mode} / chord >= {want}x",
                label,
                r,
                met(r["median"] >= want),
                fmt_rate(modes[mode]["e2e_children_per_s"]),
                fmt_rate(modes["chord"]["e2e_children_per_s"]),
                "ch/s",
            )
            if n >= 50:
                r = fg["e2e_children_per_s"]
                add(
                    f"e2e, {mode} / group (0.95x)",
                    label,
                    r,
                    None,
                    fmt_rate(modes[mode]["e2e_children_per_s"]),
                    fmt_rate(modes["group"]["e2e_children_per_s"]),
                    "ch/s",
                )
            r = fc["commands_per_child"]
            add(
                f"Redis cmds/child, {mode} / chord <= 1.0x",
                label,
                r,
                met(r["median"] <= 1),
                f"{modes[mode]['commands_per_child']:.1f}",
                f"{modes['chord']['commands_per_child']:.1f}",
                "cmds",
            )
            r = held_r.get(f"{mode}/chord") or {}
            if r and held.get(mode) and held.get("chord"):
                add(
                    f"held B/child, {mode} / chord <= 1.0x",
                    label,
                    r,
                    met(r["median"] <= 1),
                    f"{held[mode]:,.0f}",
                    f"{held['chord']:,.0f}",
                    "B",
                )
        for mode in VARIANTS:
            r_all = ratios.get(f"{mode}/flow")
            if r_all is None:
                continue
            what = "deadline=3600" if mode == DEADLINE else "traced"
            r = r_all["e2e_children_per_s"]
            add(
                f"e2e, {mode} / flow ({what})",
                label,
                r,
                None,
                fmt_rate(modes[mode]["e2e_children_per_s"]),
                fmt_rate(modes["flow"]["e2e_children_per_s"]),
                "ch/s",
            )
            r = r_all["commands_per_child"]
            add(
                f"Redis cmds/child, {mode} / flow",
                label,
                r,
                None,
                f"{modes[mode]['commands_per_child']:.1f}",
                f"{modes['flow']['commands_per_child']:.1f}",
                "cmds",
            )
    for label, summary in (report.get("chains") or {}).items():
        modes, ratios = summary["modes"], summary["ratios"]
        for key, what in (("flow-chain/chord-chain", "chains"), ("flow/chord", "plain")):
            num, den = key.split("/")
            # A chain child costs what a chord's header chain costs: at least its rate.
            target = key == "flow-chain/chord-chain"
            add(
                f"e2e, {num} / {den} ({what})" + (" >= 1.0x" if target else ""),
                f"{label} ch",
                ratios[key]["e2e"],
                ratios[key]["e2e"]["median"] >= 1.0 if target else None,
                fmt_rate(modes[num]["e2e_tasks_per_s"]),
                fmt_rate(modes[den]["e2e_tasks_per_s"]),
                "tasks/s",
            )
        add(
            "Redis cmds/task, flow-chain / chord-chain <= 1.1x",
            f"{label} ch",
            ratios["flow-chain/chord-chain"]["commands_per_task"],
            ratios["flow-chain/chord-chain"]["commands_per_task"]["median"] <= 1.1,
            f"{modes['flow-chain']['commands_per_task']:.1f}",
            f"{modes['chord-chain']['commands_per_task']:.1f}",
            "cmds",
        )
    plain = report.get("plain")
    if plain:
        r = plain["ratio"]
        add(
            "plain task/s, install / without >= 0.97x",
            f"{plain['tasks']} tasks",
            r,
            r["median"] >= 0.97,
            fmt_rate(plain["rate_install"]),
            fmt_rate(plain["rate_no_install"]),
            "tasks/s",
        )
        cmds = plain["commands_per_task_install"] / plain["commands_per_task_no_install"]
        add(
            "plain task Redis cmds, install / without",
            f"{plain['tasks']} tasks",
            {"median": cmds},
            None,
            f"{plain['commands_per_task_install']:.2f}",
            f"{plain['commands_per_task_no_install']:.2f}",
            "cmds",
        )
    return rows


def render_targets(rows: list[dict[str, Any]]) -> str:
    w = max([len("target"), *(len(row["target"]) for row in rows)]) + 2
    head = (
        f"{'target':<{w}}{'size':<10}{'ratio':>6} {'[min-max]':<12}{'met':<5}"
        f"{'A':>8}{'BullMQ':>8}{'B':>8} unit"
    )
    lines = [head, "-" * (len(head) + 4)]
    for row in rows:
        lo, hi = row.get("min"), row.get("max")
        span = f"[{lo:.2f}-{hi:.2f}]" if lo is not None and hi is not None else "-"
        met = "info" if row["met"] is None else "yes" if row["met"] else "NO"
        lines.append(
            f"{row['target']:<{w}}{row['size']:<10}{row['value']:>5.2f}x {span:<12}{met:<5}"
            f"{row['a']:>8}{row['bullmq']:>8}{row['b']:>8} {row['unit']}"
        )
    lines.append("ratio = A / B: the median of the per-round paired ratios (both sides ran in the")
    lines.append("same round), [min-max] over the rounds; A and B: their medians (held: B/child,")
    lines.append("enqueue: flow and BullMQ's FlowProducer, B unused); info = no target.")
    return "\n".join(lines)
