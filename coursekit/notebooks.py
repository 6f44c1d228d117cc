"""Execute course notebooks with papermill and measure them.

    python -m coursekit.notebooks solutions --out build/course   # make course

Each notebook runs in its own kernel, in its own folder (so relative paths to
its scripts work), in CPU mode (GPUs hidden) unless told otherwise. While it
runs, the whole process tree (kernel, Ray's processes and workers, torchrun
children) is sampled for its proportional set size (PSS), so the peak memory
reported is what the machine really had to provide. Figures the notebook
records with ``coursekit.results.record`` come back in ``record``.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from coursekit.proctree import PeakSampler, kill_tree
from coursekit.proctree import process_kind, tree_pss  # noqa: F401  (still importable from here)


def execute(notebook: Path, out: Path, parameters: dict | None = None, env: dict | None = None,
            timeout_s: float = 1800, cpu_only: bool = True, wrap=None) -> dict:
    """Run one notebook; return wall time, peak memory, exit status and the recorded figures.

    ``wrap`` turns the papermill command into the one to start (for example one that enters a memory
    cgroup first); the command it returns must ``exec`` papermill, so the process measured is papermill's."""
    notebook, out = Path(notebook).resolve(), Path(out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    record_file = out.with_suffix(".record.json")
    record_file.unlink(missing_ok=True)
    run_env = {**os.environ, "COURSE_RECORD": str(record_file), "PYTHONUNBUFFERED": "1"}
    if cpu_only:
        run_env["CUDA_VISIBLE_DEVICES"] = ""
    run_env.update(env or {})
    # --log-output: each cell's number and outputs go to the log as they come, so the tail of a failed or stalled
    # run shows where it was
    cmd = [sys.executable, "-m", "papermill", str(notebook), str(out), "--cwd", str(notebook.parent),
           "--no-progress-bar", "--log-output"]
    for key, value in (parameters or {}).items():
        cmd += ["-p", key, str(value)]
    if wrap is not None:
        cmd = wrap(cmd)
    log = out.with_suffix(".log")
    start = time.perf_counter()
    with open(log, "w") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=run_env)
        with PeakSampler(proc.pid, interval_s=1.0) as sampler:
            try:
                returncode = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                kill_tree(proc.pid)
                proc.wait(timeout=60)
                returncode = -9
                with open(log, "a") as log_file:
                    log_file.write(f"\n[coursekit] stopped after {timeout_s:.0f} s: {running_cell(out)}\n")
        peak, peak_by_kind = sampler.peak, sampler.peak_by_kind
    wall = time.perf_counter() - start
    record = json.loads(record_file.read_text()) if record_file.exists() else {}
    return {"notebook": str(notebook), "output": str(out), "log": str(log), "returncode": returncode,
            "wall_s": round(wall, 1), "peak_pss_mib": round(peak / 2**20), "record": record,
            # what the machine held at that peak, per kind of process, largest first
            "peak_by_process_mib": {(k if n == 1 else f"{k} x{n}"): round(b / 2**20) for k, (b, n) in
                                    sorted(peak_by_kind.items(), key=lambda kv: -kv[1][0])},
            "log_tail": log.read_text()[-3000:] if returncode else ""}


def running_cell(out: Path) -> str:
    """Which cell papermill's output notebook ``out`` says was running (papermill saves it as each cell starts),
    with when it started and the first line of its code."""
    try:
        import nbformat

        cells = nbformat.read(str(out), as_version=4).cells
    except Exception as e:  # no notebook written yet, or one cut off mid-write
        return f"no cell found running ({type(e).__name__} reading {out.name})"
    for index, cell in enumerate(cells):
        meta = cell.get("metadata", {}).get("papermill", {})
        if meta.get("status") == "running":
            first = next((line for line in cell.source.splitlines() if line.strip()), "")
            return f"cell {index + 1} (started {meta.get('start_time')}) was running: {first[:120]}"
    return "no cell was running"


# what run_definitions runs of an earlier notebook: nothing that trains, measures, checks or shows
DEFINITIONS = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def run_definitions(notebook: str | Path, namespace: dict) -> dict:
    """Run in ``namespace`` (a notebook's ``globals()``) the definitions of an earlier notebook as saved on disk:
    the top-level imports, functions and classes of its code cells, in order, the student's answers included
    (a second part of a module builds on the first part's answers). Nothing else runs: no assignment, no call, no
    loop or ``if`` block, so nothing that trains, measures or checks, and no graded test cell.

    Prints and returns what it did: ``answers`` (the names the answer cells define), ``unwritten`` (those whose cell
    still raises ``NotImplementedError``) and ``skipped`` (cells that could not be read or run, with why)."""
    import nbformat
    from IPython.core.inputtransformer2 import TransformerManager

    path = Path(notebook)
    if not path.exists():
        raise FileNotFoundError(f"{path} is not in {Path.cwd()}: this notebook runs that notebook's definitions (your "
                                "answers included) from its saved file; open it, save it (File > Save), and run "
                                "this cell again")
    try:
        nb = nbformat.read(path, as_version=4)
    except Exception as e:  # noqa: BLE001  (nbformat raises several kinds for a damaged file)
        raise ValueError(f"{path} could not be read as a notebook ({type(e).__name__}: {e}); restore it from a "
                         "checkpoint (File > Revert Notebook to Checkpoint) or fetch it again") from None
    transform = TransformerManager().transform_cell        # IPython's own reading of %magics and !commands
    answers, unwritten, skipped, count = [], [], [], 0
    for index, cell in enumerate(nb.cells, start=1):
        grading = cell.metadata.get("nbgrader", {})
        if cell.cell_type != "code" or (grading.get("grade") and not grading.get("solution")):
            continue
        try:
            body = [s for s in ast.parse(transform(cell.source)).body if isinstance(s, DEFINITIONS)]
        except SyntaxError as e:
            skipped.append(f"cell {index}: {e.msg} (line {e.lineno})")
            continue
        if not body:
            continue
        try:
            exec(compile(ast.Module(body=body, type_ignores=[]), f"{path.name}, cell {index}", "exec"), namespace)
        except Exception as e:  # noqa: BLE001  (an import or a default argument of the student's that fails)
            skipped.append(f"cell {index}: {type(e).__name__}: {e}")
            continue
        count += len(body)
        names = [s.name for s in body if not isinstance(s, (ast.Import, ast.ImportFrom))]
        if grading.get("solution"):
            answers += names
            if "raise NotImplementedError" in cell.source:
                unwritten += names
    print(f"from {path.name}: {count} imports and definitions, your answers {', '.join(answers) or 'none'}")
    if unwritten:
        print(f"  not written yet: {', '.join(unwritten)} (the cells that use them will fail until you write them "
              f"in {path.name} and save it)")
    for why in skipped:
        print(f"  left out: {why}")
    return {"answers": answers, "unwritten": unwritten, "skipped": skipped}


def find_notebooks(folder: Path) -> list[Path]:
    return sorted(p for p in Path(folder).glob("[0-9]*/*.ipynb") if ".ipynb_checkpoints" not in p.parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Execute the course notebooks and report time and memory.")
    p.add_argument("folder", type=Path, help="solutions or course")
    p.add_argument("--out", type=Path, default=Path("build/course"))
    p.add_argument("--size", default="cpu", help="COURSE_SIZE for the run (smoke, cpu, gpu)")
    p.add_argument("--only", default=None, help="run only notebooks whose name contains this")
    p.add_argument("--platform", default=None,
                   help="COURSE_PLATFORM for the run: binder measures the notebooks as Binder runs them")
    p.add_argument("--gpu", action="store_true",
                   help="let the notebooks see this machine's GPUs (by default they run on the CPU)")
    args = p.parse_args(argv)
    rows = []
    for nb in find_notebooks(args.folder):
        if args.only and args.only not in nb.name:
            continue
        print(f"executing {nb} ...", flush=True)
        env = {"COURSE_SIZE": args.size, **({"COURSE_PLATFORM": args.platform} if args.platform else {})}
        r = execute(nb, args.out / nb.name, env=env, cpu_only=not args.gpu)
        status = "ok" if r["returncode"] == 0 else f"FAILED (see {r['log']})"
        print(f"  {status}: {r['wall_s']} s, peak {r['peak_pss_mib']} MiB PSS, recorded {r['record']}", flush=True)
        print(f"  at the peak (MiB): {r['peak_by_process_mib']}", flush=True)
        rows.append(r)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "report.json").write_text(json.dumps(rows, indent=1))
    lines = ["| notebook | status | wall time (s) | peak memory (MiB PSS, whole tree) |", "|---|---|---|---|"]
    lines += [f"| {Path(r['notebook']).name} | {'ok' if r['returncode'] == 0 else 'failed'} | {r['wall_s']} | "
              f"{r['peak_pss_mib']} |" for r in rows]
    lines.append(f"| total | | {sum(r['wall_s'] for r in rows):.1f} | max {max((r['peak_pss_mib'] for r in rows), default=0)} |")
    (args.out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(r["returncode"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
