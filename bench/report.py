"""Figures with targets, the machine description, and RESULTS.md."""
from __future__ import annotations

import datetime
import math
import os
import platform
import subprocess
from pathlib import Path

from coursekit.paths import REPO  # the one repository root


def figure(name: str, value, unit: str, target: float | None = None, op: str = "<=",
           tolerance: float | None = None, note: str = "") -> dict:
    """One measured figure against its target.

    ``op`` is ``<=`` (at most the target), ``>=`` (at least) or ``~`` (within ``tolerance`` of it,
    relative). ``ratio`` is value / target; ``status`` is ``met``, ``missed by X`` or ``reported``
    (no target)."""
    row = {"name": name, "value": value, "unit": unit, "target": target, "op": op, "note": note,
           "ratio": None, "status": "reported"}
    if value is None or (isinstance(value, float) and math.isnan(value)):
        row["status"] = "not measured"
        return row
    if target is None:
        return row
    row["ratio"] = round(value / target, 3) if target else None
    if op == "<=":
        ok, miss = value <= target, value - target
    elif op == ">=":
        ok, miss = value >= target, target - value
    elif op == "~":
        tol = tolerance if tolerance is not None else 0.1
        row["tolerance"] = tol
        ok, miss = abs(value / target - 1) <= tol, abs(value - target) - tol * abs(target)
    else:
        raise ValueError(f"op must be <=, >= or ~, not {op!r}")
    row["status"] = "met" if ok else f"missed by {_fmt(miss)} {unit} ({100 * miss / abs(target):.0f}%)".replace(" ()", "")
    return row


def _fmt(x) -> str:
    if isinstance(x, (int,)) or (isinstance(x, float) and abs(x) >= 100):
        return f"{x:.0f}"
    if isinstance(x, float):
        return f"{x:.3g}" if abs(x) < 1 else f"{x:.1f}"
    return str(x)


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception:
        return ""


def _version(module: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:
        return None


def machine() -> dict:
    """CPUs, memory, GPU (or none), library versions, date and the git commit."""
    import psutil

    gpu = "none"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        if out.returncode == 0 and out.stdout.strip():
            gpu = "; ".join(out.stdout.strip().splitlines())
    except (OSError, subprocess.SubprocessError):
        pass
    commit = _git("rev-parse", "HEAD")
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
    return {
        "cpus": os.cpu_count(), "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_model": _cpu_model(), "memory_gib": round(psutil.virtual_memory().total / 2**30, 1), "gpu": gpu,
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "os": platform.platform(), "python": platform.python_version(),
        "torch": _version("torch"), "ray": _version("ray"), "deepspeed": _version("deepspeed"),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "git_commit": commit + (" (with uncommitted changes)" if dirty else ""),
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


TITLES = {
    "notebooks": "1. Notebooks in Binder/CPU mode (cpu sizes, lean Ray)",
    "fit_cost": "2. Ray Train fixed cost per fit() (2 CPU workers) vs torchrun",
    "throughput": "3. Steady-state throughput, module 02's ResNet18: Ray Train DDP vs torchrun DDP",
    "data": "4. Ray Data vs a DataLoader, module 03's preprocessing",
    "grading": "5. Grading seconds per submission per module",
    "memory": "6. Per-rank model-state memory vs coursekit.planner.predict",
    "mutants": "7. Mutation testing of the grader's checks: the share of each exercise's mutants caught",
    "gpu": "8. The GPU path (make gpu-check): notebooks at the gpu size, 07's scripts in bf16, NCCL, grading",
}


def _cell(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return _fmt(x)
    return str(x)


def _measured_apart(section: dict, header: dict) -> list[str]:
    """For a section measured by ``--only`` after the run in the header: when, where, and what it replaced."""
    here = section.get("measured")
    if not here or here.get("date") == header.get("date"):
        return []
    out = ["", f"Measured apart from the run above: `{here.get('command', 'python -m bench --only ...')}` on "
           f"{here['date']}, commit `{here.get('git_commit', '?')}`, load average at start "
           f"{here.get('load_average_at_start', '?')}."]
    before = section.get("previous")
    if before:
        figures = "; ".join(f"{f['name']} {_cell(f['value'])} {f['unit']}" for f in before["figures"])
        out.append(f"It replaces the figures measured on {before['measured'].get('date', '?')}: {figures}.")
    return out


def markdown(results: dict) -> str:
    m = results["machine"]
    lines = ["# Performance harness results", "",
             f"`python -m bench{' --short' if results['mode'] == 'short' else ''}` on {m['date']}, "
             f"commit `{m['git_commit']}`; the run took {results.get('total_s', 0):.0f} s.", "",
             f"Machine: {m['cpus']} CPUs ({m['cpu_model']}), {m['memory_gib']} GiB memory, GPU: {m['gpu']}; "
             f"load average at start {m['load_average_at_start']}. Python {m['python']}, torch {m['torch']}, "
             f"ray {m['ray']}, deepspeed {m['deepspeed']}.", ""]
    if results["mode"] == "short":
        lines += ["**Short mode** (CI): the same code paths with the smallest settings; the figures are "
                  "not the course's measurements.", ""]
    lines += ["## Figures against targets", "",
              "| section | figure | value | target | ratio | status |", "|---|---|---|---|---|---|"]
    for key, section in results["sections"].items():
        for f in section.get("figures", []):
            target = "-" if f["target"] is None else (
                f"{f['op']} {_cell(f['target'])} {f['unit']}" if f["op"] != "~"
                else f"{_cell(f['target'])} {f['unit']} ± {100 * f.get('tolerance', 0.1):.0f}%")
            lines.append(f"| {key} | {f['name']} | {_cell(f['value'])} {f['unit']} | {target} | "
                         f"{_cell(f['ratio'])} | {f['status']} |")
        if section.get("error"):
            lines.append(f"| {key} | (section failed) | - | - | - | error: see below |")
    for key, section in results["sections"].items():
        lines += ["", f"## {TITLES.get(key, key)}", ""]
        lines.append(f"Took {section.get('seconds', 0):.0f} s.")
        lines += _measured_apart(section, m)
        if section.get("how"):
            lines += ["", section["how"]]
        if section.get("table"):
            lines += [""] + section["table"]
        if section.get("notes"):
            lines += [""] + [f"- {n}" for n in section["notes"]]
        missed = [f for f in section.get("figures", []) if f["status"].startswith("missed")]
        for f in missed:
            if f.get("note"):
                lines.append(f"- **{f['name']}** {f['status']}: {f['note']}")
        if section.get("error"):
            lines += ["", "**Error** (the section did not finish):", "", "```", section["error"][-2000:], "```"]
    return "\n".join(lines) + "\n"
