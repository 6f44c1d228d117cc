"""python -m bench [--short] [--out DIR] [--only SECTION,...]: see bench/__init__.py."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

from bench.report import REPO, figure, machine, markdown

SECTIONS = ["notebooks", "fit_cost", "throughput", "data", "grading", "memory", "mutants"]
# measured only when asked for (--only): the GPU check needs a GPU machine (make gpu-check)
OPTIONAL = ["gpu"]

# Targets: what the course promises (README, `make bench`); RESULTS.md sets each figure against its target
COURSE_WALL_S = 600          # every notebook, CPU mode, in at most 10 minutes
NOTEBOOK_PEAK_MIB = 2048     # each notebook at most 2 GiB in Binder mode
FIT_COST_S = 15              # one trivial 2-worker fit()
FIT_TORCHRUN_RATIO = 1.5     # that fit() / torchrun starting the same 2-process job
THROUGHPUT_RATIO = 0.9       # Ray Train DDP / torchrun DDP
GRADING_S = 30               # per submission per module
MEMORY_TOLERANCE = 0.10      # measured / predicted model state per rank
MUTANTS_KILLED = 0.95        # per exercise: the share of its non-equivalent mutants that its checks catch


# psutil's process start times can read a fraction of a second early (whole-second boot time plus clock ticks),
# so a new process may seem slightly older than the request for it; one prestarted at ray.init is seconds older
PRESTARTED_S = -1.0


def _env() -> dict:
    """Child processes find the bench package (Ray's workers too: they inherit the raylet's environment)."""
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": str(REPO) + (os.pathsep + path if path else "")}


def _run(cmd: list[str], log: Path, timeout_s: float) -> float:
    """Run a command with its output in ``log``; return its wall time; raise with the log's tail if it fails."""
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        try:
            proc = subprocess.run(cmd, cwd=REPO, env=_env(), stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{' '.join(cmd)} did not finish in {timeout_s:.0f} s (log: {log})") from None
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed with status {proc.returncode} (log: {log}):\n"
                           + log.read_text()[-3000:])
    return wall


def _ray_train(ctx: dict) -> dict:
    """Sections 2 and 3 share one Ray session (one job); a failure is remembered, not run twice."""
    if "ray_train" not in ctx:
        try:
            ctx["ray_train"] = _job("ray_train", ctx["work"], ctx["short"], 900)
        except Exception as e:
            ctx["ray_train"] = e
    if isinstance(ctx["ray_train"], Exception):
        raise RuntimeError("the Ray Train job failed (see fit_cost's error)") from ctx["ray_train"]
    return ctx["ray_train"]


def _job(name: str, work: Path, short: bool, timeout_s: float) -> dict:
    out = work / f"{name}.json"
    out.unlink(missing_ok=True)
    _run([sys.executable, "-m", "bench.jobs", name, str(out), *(["--short"] if short else [])],
         work / f"{name}.log", timeout_s)
    return json.loads(out.read_text())


def _torchrun(module_args: list[str], log: Path, timeout_s: float) -> float:
    return _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                 "-m", *module_args], log, timeout_s)


# -- the sections ------------------------------------------------------------------------------------

def _short_notebook(work: Path) -> Path:
    """``--short``: a two-cell notebook (the course's imports, one forward and backward pass) instead of a
    module's: the same execution and memory sampling, in seconds instead of minutes (CI runs every module's
    notebook in tests/test_notebooks.py already)."""
    import nbformat

    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("import torch\nfrom coursekit.models import build_model\nfrom coursekit.runtime import detect"),
        nbformat.v4.new_code_cell("rt = detect()\nmodel = build_model('small_cnn')\n"
                                  "model(torch.randn(4, 1, 28, 28)).sum().backward()\nprint(rt.describe())"),
    ], metadata={"kernelspec": {"name": "ray-train-course", "display_name": "Python (Ray Train course)",
                                "language": "python"}})
    path = work / "short" / "00_short.ipynb"
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)
    return path


def notebooks(ctx: dict) -> dict:
    from coursekit.notebooks import execute, find_notebooks

    chosen = [_short_notebook(ctx["work"])] if ctx["short"] else find_notebooks(REPO / "solutions")
    rows, figures, table = [], [], ["| notebook | status | wall (s) | peak PSS (MiB) | largest at the peak (MiB) |",
                                    "|---|---|---|---|---|"]
    for nb in chosen:
        r = execute(nb, ctx["work"] / "notebooks" / nb.name, env={"COURSE_PLATFORM": "binder"}, timeout_s=1800)
        ok = r["returncode"] == 0
        rows.append({k: r[k] for k in ("notebook", "returncode", "wall_s", "peak_pss_mib", "peak_by_process_mib",
                                       "record", "log")})
        top = ", ".join(f"{k} {v}" for k, v in list(r["peak_by_process_mib"].items())[:4])
        table.append(f"| {nb.name} | {'ok' if ok else 'FAILED'} | {r['wall_s']} | {r['peak_pss_mib']} | {top} |")
        figures.append(figure(f"{nb.stem} peak memory", r["peak_pss_mib"], "MiB", NOTEBOOK_PEAK_MIB, "<=",
                              note=f"whole process tree at its peak; largest there (MiB): {top}"))
        if not ok:
            raise RuntimeError(f"{nb.name} failed (log {r['log']}):\n{r['log_tail']}")
    total = sum(r["wall_s"] for r in rows)
    figures.insert(0, figure(f"sum of wall times ({len(rows)} notebook{'s' if len(rows) > 1 else ''})", total, "s",
                             COURSE_WALL_S, "<="))
    return {"figures": figures, "details": rows, "table": table,
            "how": "`coursekit.notebooks.execute` (papermill) on every solution notebook with COURSE_PLATFORM=binder "
                   "(the cpu sizes Binder runs, lean Ray, CPU only); peak = PSS of the whole process tree sampled every second."}


def fit_cost(ctx: dict) -> dict:
    r = _ray_train(ctx)
    fits = r["fits"]
    runs = []
    for i in range(1 if ctx["short"] else 3):
        stamps = ctx["work"] / f"torchrun-trivial-{i}.json"
        wall = _torchrun(["bench.trivial_ddp", str(stamps)], ctx["work"] / f"torchrun-trivial-{i}.log", 300)
        runs.append({"wall_s": wall, **json.loads(stamps.read_text())})
    fit_s = min(f["fit_s"] for f in fits)
    torchrun_s = min(x["wall_s"] for x in runs)
    best = min(fits, key=lambda f: f["fit_s"])

    def cell(x):
        return "-" if x is None else f"{x:.1f}"

    head = "| step of fit() | " + " | ".join(f"fit {i + 1}" for i in range(len(fits))) + " |"
    steps = [("fit() called -> controller process created", "until_controller_process_created_s"),
             ("controller process -> starts the worker group (imports Ray Train and torch, asks for resources)",
              "controller_process_to_ready_s"),
             ("-> worker processes created (placement group, 2 new processes)",
              "controller_ready_to_worker_process_created_s"),
             ("-> worker actors ready (each imports Ray Train)", "worker_process_to_actor_ready_s"),
             ("-> train context on the workers (each imports torch)", "actor_ready_to_train_context_s"),
             ("-> train function starts (gloo process group, launch)", "train_context_to_train_func_s"),
             ("train function (one report)", "train_func_s"),
             ("report -> the controller's poll sees the end", "report_to_shutdown_s"),
             ("-> fit() returns (worker group shut down)", "shutdown_to_fit_return_s"),
             ("**fit() total**", "fit_s")]
    table = [head, "|---|" + "---|" * len(fits)]
    table += [f"| {label} | " + " | ".join(cell(f.get(key)) for f in fits) + " |" for label, key in steps]
    table += ["", "| for comparison | seconds |", "|---|---|",
              f"| ray.init (once, before the fits) | {r['ray_init_s']:.1f} |",
              f"| a fresh Python process: import torch.distributed, ray.train.torch | "
              f"{cell(r.get('fresh_process_import_torch_and_ray_train_s'))} |",
              f"| a fresh Python process: import Ray Train's TrainController | "
              f"{cell(r.get('fresh_process_import_train_controller_s'))} |",
              f"| two plain 1-CPU Ray actors, created and answering (prestarted processes "
              f"{'used' if r['plain_actor_process_created_after_s'] < PRESTARTED_S else 'not used'}) | {r['two_plain_actors_s']:.1f} |",
              f"| the same with a runtime_env of their own, as Ray Train's workers have (new processes "
              f"after {r['own_runtime_env_actor_process_created_after_s']:.1f} s) | {r['two_actors_own_runtime_env_s']:.1f} |",
              f"| torchrun 2 processes: gloo group, barrier, exit (whole command) | {torchrun_s:.1f} |"]
    before = best["until_train_func_start_s"]
    why = (f"{before:.0f} of the best fit's {best['fit_s']:.0f} s pass before the train function starts: "
           f"{cell(best.get('until_controller_process_created_s'))} s until Ray Train's controller process "
           f"exists, {cell(best.get('controller_to_worker_process_created_s'))} s until its worker processes "
           f"exist, {best['worker_process_to_train_func_s']:.0f} s from there to the train function (a fresh process "
           f"imports torch and Ray Train in {cell(r.get('fresh_process_import_torch_and_ray_train_s'))} s alone on "
           "this machine, several times that while two start together on 2 busy cores). Every fit() starts its "
           "worker processes anew (torchrun starts 2 processes and no more); the controller's own part before "
           f"them (its import of Ray Train: {cell(r.get('fresh_process_import_train_controller_s'))} s alone, "
           "the placement group, the worker actors) is the other half. "
           + ("A runtime_env of their own (Ray Train's worker actors have one) did not stop the probe's actors "
              "from taking prestarted processes. "
              if r["own_runtime_env_actor_process_created_after_s"] < PRESTARTED_S else
              "The probe's actors with a runtime_env of their own got new processes, as Ray Train's do: under the "
              "course's job runtime_env no actor of a fit reuses an idle prestarted process, so a fit cannot "
              "start on warm processes in Ray 2.60. ")
           + "Done: the install drops rfc3987-syntax, whose grammar every process importing Ray compiled at "
           "start-up; the raylet starts a fit's processes together (worker_maximum_startup_concurrency 8) and "
           "prestarts no idle processes (none could be used); the controller polls its workers every 0.1 s "
           f"(Ray's default 2 s), so it sees the end {cell(best.get('report_to_shutdown_s'))} s after the report; "
           f"the rest of the end ({cell(best.get('shutdown_to_fit_return_s'))} s) waits for Ray Train's "
           "placement-group cleaner, which checks on the controller once a second (no setting) and is stopped "
           "before fit() returns. "
           "Tried, no gain: preloading ray.train.torch into 6 warm workers (+3 GiB idle, none used), raylet "
           "worker niceness 0. What remains is new processes importing Ray Train (pandas, pyarrow, Ray Data) and "
           "torch, the controller's before its workers', on 2 cores; no public setting changes what they import.")
    return {"figures": [figure("Ray Train fit() of a trivial function, 2 CPU workers", fit_s, "s", FIT_COST_S, "<=",
                               note=why),
                        figure("ray.init (reported separately)", r["ray_init_s"], "s"),
                        figure("torchrun, same trivial 2-process job", torchrun_s, "s"),
                        figure("fit() / torchrun", fit_s / torchrun_s, "x", FIT_TORCHRUN_RATIO, "<=",
                               note="see the fit() figure's note")],
            "details": {"ray": r, "torchrun": runs}, "table": table,
            "how": ("Ray started first (`coursekit.raysetup.init_ray`, timed apart); then `TorchTrainer.fit()` of a "
                    "train function that only calls `ray.train.report` once, on 2 CPU workers "
                    f"({len(fits)} fit(s); the best counts). The function reports when it started and when its "
                    "worker process was created (psutil); Ray Train's controller logs when it starts the worker "
                    "group, when the worker actors answer, when their train context is set and when it shuts "
                    "them down (its JSON log in the Ray session's logs/train folder): together they split the "
                    "fit. torchrun: the whole "
                    "`torchrun --standalone --nproc_per_node 2 -m bench.trivial_ddp` command "
                    "(import torch.distributed, init_process_group gloo, barrier, exit).")}


def throughput(ctx: dict) -> dict:
    ray_r = _ray_train(ctx)["throughput"]
    steps, warmup = (5, 2) if ctx["short"] else (40, 5)
    out = ctx["work"] / "torchrun-throughput.json"
    wall = _torchrun(["bench.ddp_loop", "--steps", str(steps), "--warmup", str(warmup), "--out", str(out)],
                     ctx["work"] / "torchrun-throughput.log", 600)
    tr = json.loads(out.read_text())
    ratio = ray_r["samples_per_s"] / tr["samples_per_s"]
    table = ["| launcher | samples/s | step (ms) | torch threads/worker | whole run (s) |", "|---|---|---|---|---|",
             f"| Ray Train (TorchTrainer.fit) | {ray_r['samples_per_s']:.1f} | {ray_r['step_ms']:.0f} | "
             f"{ray_r['torch_threads']} | {ray_r['fit_s']:.1f} |",
             f"| torchrun | {tr['samples_per_s']:.1f} | {tr['step_ms']:.0f} | {tr['torch_threads']} | {wall:.1f} |"]
    return {"figures": [figure("Ray Train DDP / torchrun DDP samples per second", ratio, "x", THROUGHPUT_RATIO, ">="),
                        figure("Ray Train DDP", ray_r["samples_per_s"], "samples/s"),
                        figure("torchrun DDP", tr["samples_per_s"], "samples/s")],
            "details": {"ray_train": ray_r, "torchrun": tr, "torchrun_wall_s": wall}, "table": table,
            "how": (f"module 02's ResNet18 on the digits, 2 CPU workers (gloo), global batch {tr['global_batch_size']}, "
                    f"the same loop (`bench/ddp_loop.py`) under both launchers; `coursekit.stepmeter.StepMeter` "
                    f"times {steps} optimizer steps after {warmup} warm-up steps inside the workers "
                    "(start-up excluded). Module 07's scripts measure the same way but train its ViT, not "
                    "module 02's model.")}


def data(ctx: dict) -> dict:
    r = _job("data", ctx["work"], ctx["short"], 900)
    last = r["passes"][-1]
    ratio = last["raydata_rows_per_s"] / last["dataloader_rows_per_s"]
    table = ["| pass | DataLoader rows/s | Ray Data rows/s | Ray Data / DataLoader |", "|---|---|---|---|"]
    table += [f"| {p['pass']} | {p['dataloader_rows_per_s']:.0f} | {p['raydata_rows_per_s']:.0f} | "
              f"{p['raydata_rows_per_s'] / p['dataloader_rows_per_s']:.2f} |" for p in r["passes"]]
    figures = [figure("Ray Data / DataLoader rows per second", ratio, "x"),
               figure("DataLoader", last["dataloader_rows_per_s"], "rows/s"),
               figure("Ray Data", last["raydata_rows_per_s"], "rows/s")]
    nb = ctx.get("notebook_records", {}).get("03_ray_data")
    per_pass_s = last["raydata_s"]
    notes = [f"Ray Data needs {per_pass_s:.1f} s per pass over {r['rows']} small images, the DataLoader "
             f"{last['dataloader_s']:.1f} s: on a data set this small Ray Data's fixed cost per execution (planning, "
             "the streaming executor, read and map tasks on the CPUs left beside training) dominates; it pays off "
             "where data does not fit in one process or preprocessing needs more CPUs/nodes than the trainer's "
             "(module 03's streaming part)."]
    if nb and "raydata_rows_per_s" in nb:
        notes.append(f"module 03's notebook measured in section 1: DataLoader {nb['dataloader_rows_per_s']:.0f} rows/s, "
                     f"Ray Data {nb['raydata_rows_per_s']:.0f} rows/s")
    return {"figures": figures, "details": r, "table": table, "notes": notes,
            "how": (f"module 03's comparison (its notebook's DataLoader vs Ray Data cell, with its `preprocess` and "
                    f"`coursekit.raydata` plan/timed): {r['rows']} PNG digits ({r.get('source', '?')}) read, decoded, normalised and batched "
                    f"({r['batch_size']} per batch) by a DataLoader with Ray Data's CPUs as worker processes and by "
                    "`ray.data.read_images(...).map_batches(preprocess)`. No target; the last pass counts "
                    "(the first includes starting processes).")}


def grading(ctx: dict) -> dict:
    out = ctx["work"] / "grading-bench"
    args = ["--students", "1", "--jobs", "1", "--modules", "01_ddp_pytorch", "--fixed-repeats", "1"] if ctx["short"] \
        else ["--students", "2", "--jobs", "1,2", "--cluster-nodes", "2", "--fixed-repeats", "3"]
    wall = _run([sys.executable, "-m", "autograder.benchmark", *args, "--out", str(out),
                 "--json", str(out / "summary.json")], ctx["work"] / "grading-bench.log", 5400)
    summary = json.loads((out / "summary.json").read_text())
    runs, fixed = summary["runs"], summary["fixed_cost_s"]
    one_per_cpu = next((r for name, r in runs.items() if name == f"local, --jobs {os.cpu_count()}"),
                       list(runs.values())[0])
    timings = one_per_cpu["modules"]
    figures = [figure(f"{m} s/submission", t["mean_s"], "s", GRADING_S, "<=", note=f"slowest {t['max_s']:.1f} s")
               for m, t in timings.items()]
    figures += [figure(f"submissions per minute, {name}", r["per_minute"], "/min") for name, r in runs.items()]
    figures += [figure(f"fixed cost per job, {name}", v, "s") for name, v in fixed.items()]
    table = ["| module | " + " | ".join(f"{name}: s/submission (fixed s)" for name in runs) + " | tree RSS (MiB) |",
             "|---|" + "---|" * (len(runs) + 1)]
    for m in timings:
        cells = [f"{r['modules'][m]['mean_s']:.1f} ({r['modules'][m]['mean_fixed_s']})" if m in r["modules"] else "-"
                 for r in runs.values()]
        table.append(f"| {m} | " + " | ".join(cells) + f" | {timings[m]['max_tree_rss_mib']} |")
    table += ["", "| run | submissions | s, first job to last | per minute |", "|---|---|---|---|"]
    table += [f"| {name} | {r['submissions']} | {r['jobs_wall_s']} | {r['per_minute']} |" for name, r in runs.items()]
    if summary.get("class_minutes"):
        table += ["", f"A class of {summary['class_size']} x every module on nodes of {summary['node_cpus']} CPUs, one "
                  f"submission per CPU at a time, each as long as here with one job per CPU "
                  f"({summary['per_student_s']} s per student): "
                  + ", ".join(f"{n} node(s) {v} min" for n, v in summary["class_minutes"].items()) + "."]
    return {"figures": figures, "details": {**summary, "wall_s": wall}, "table": table,
            "how": f"`python -m autograder.benchmark {' '.join(args)}`: submissions alternately the reference "
                   "solution and the untouched notebook, graded by nbgrader in the grading jail, once per local "
                   "--jobs and once on a local Ray cluster of one-CPU nodes; seconds of each submission's own "
                   "process, and its fixed cost outside nbgrader's autograde (a fresh process per job vs a fork "
                   "of a warm worker, timed alternately on the same untouched notebook)."}


def memory(ctx: dict) -> dict:
    from coursekit.planner import label

    r = _job("memory", ctx["work"], ctx["short"], 1200)
    figures = []
    table = ["| run | predicted (KiB) | measured, largest rank (KiB) | measured / predicted | activations predicted "
             "(KiB) | activations measured (KiB) | measured / predicted |", "|---|---|---|---|---|---|---|"]
    for row in r["comparison"]:
        name, ratio = label(row), row["measured / predicted"]
        figures.append(figure(f"{name} model state per rank, measured / predicted", ratio, "x", 1.0, "~",
                              tolerance=MEMORY_TOLERANCE))
        acts = ["-", "-", "-"]
        if row.get("activations ratio") is not None:
            figures.append(figure(f"{name} activations per rank, measured / predicted", row["activations ratio"],
                                  "x", 1.0, "~", tolerance=MEMORY_TOLERANCE))
            acts = [f"{row['activations predicted'] / 1024:.0f}", f"{row['activations measured'] / 1024:.0f}",
                    f"{row['activations ratio']:.3f}"]
        table.append(f"| {name} | {row['predicted'] / 1024:.0f} | {row['measured'] / 1024:.0f} | {ratio:.3f} | "
                     + " | ".join(acts) + " |")
    return {"figures": figures, "details": r, "table": table,
            "how": (f"module 07's training functions (train_ray_*.py) on real gloo ranks (Ray Train's context "
                    f"simulated): 2 ranks, and 2 nodes x 2 for HSDP and TP x FSDP2; ViT of {r['num_params']} "
                    "parameters, fp32, Adam; `coursekit.stepmeter.StepMeter` counts each rank's parameters, "
                    "gradients (DDP's: with their copy in its all-reduce buckets; ZeRO's: with its gradient "
                    "buffers) and optimizer state after the backward pass, and the activations the FSDP2 "
                    "script's forward pass saves; `coursekit.planner.compare` against `predict` "
                    "(accumulation=False: the scripts do not accumulate) and `vit_activation_bytes`. "
                    "Target: within 10%.")}


def mutants(ctx: dict) -> dict:
    """Mutation testing of the grader's checks (``autograder.mutants``), one module per process; ``--modules``
    measures only those and keeps the other modules' figures of the last run. Short mode: one exercise of
    module 01 (the same code path)."""
    from autograder import mutants as mt
    from autograder.checks import FILES

    out = ctx["work"] / "mutants" if ctx["short"] else mt.OUT
    previous = (ctx.get("previous") or {}).get("details", {})
    chosen = ["01_ddp_pytorch"] if ctx["short"] else (ctx.get("modules") or list(FILES))
    details = {m: d for m, d in previous.items() if m not in chosen and not ctx["short"]}
    for module in chosen:
        cmd = [sys.executable, "-m", "autograder.mutants", module, "--out", str(out)]
        if ctx["short"]:
            cmd += ["--exercise", "save_checkpoint"]
        if not ctx.get("collect"):
            try:
                _run(cmd, ctx["work"] / f"mutants-{module}.log", 4 * 3600)
            except RuntimeError as e:          # a reference that fails its checks: its exercise says so below
                print(f"[bench]   {module}: {str(e).splitlines()[0]}", flush=True)
        details[module] = mt.collect(mt.latest(module, out))
    figures, table, notes = [], ["| exercise | generated | killed | equivalent | survived | timed out | s |",
                                 "|---|---|---|---|---|---|---|"], []
    for module in sorted(details):
        for exercise, row in details[module]["exercises"].items():
            figures.append(figure(f"{module} {exercise}: mutants killed", row["score"], "share", MUTANTS_KILLED,
                                  ">=", note=row.get("error") or f"{len(row.get('left', []))} left: see below"))
            table.append(f"| {module} {exercise} | {row['generated']} | {row.get('killed', '-')} | "
                         f"{row.get('equivalent', '-')} | {row.get('survived', '-')} | {row.get('timeout', '-')} | "
                         f"{row.get('seconds') or '-'} |")
            notes += [f"{module} {exercise}, equivalent: `{e['mutant']}`: {e['reason']}" for e in row.get("equivalents", [])]
            notes += [f"{module} {exercise}, **{e['verdict']}**: `{e['mutant']}`" for e in row.get("left", [])]
        figures.append(figure(f"{module}: mutation run", details[module]["seconds"], "s"))
    return {"figures": figures, "table": table, "notes": notes, "details": details,
            "how": ("`python -m autograder.mutants` (`make mutants MODULE=...`): each mutant of an exercise's "
                    "reference answer (cosmic-ray's operators and this domain's, on the answer's part of the cell) "
                    "runs in the course's kernel in grading mode, and the exercise's test cells are judged outside "
                    "the kernel by the grader's checks. Killed: a check fails (or the answer raises, or the kernel "
                    "dies); equivalent: survived and listed, with its reason, in "
                    "`autograder/checks/equivalent/MODULE.toml`; a timeout counts like a survivor. "
                    "Figure: killed / (generated - equivalent). Target: at least 95% per exercise.")}


def _kept(path: Path, fresh: dict) -> dict:
    """``--only``: the last results of the same mode, whose other sections stay as they were (the header keeps
    their run's machine and date; each re-measured section says when it was measured)."""
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        return fresh
    return old if old.get("mode") == fresh["mode"] and "sections" in old else fresh


def gpu(ctx: dict) -> dict:
    from bench.gpu_check import gpu_section

    return gpu_section(ctx)


FUNCS = {"notebooks": notebooks, "fit_cost": fit_cost, "throughput": throughput, "data": data,
         "grading": grading, "memory": memory, "mutants": mutants, "gpu": gpu}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="The course's performance harness.")
    p.add_argument("--short", action="store_true", help="smallest settings, same code paths (CI: a fraction of the full run's time)")
    p.add_argument("--out", type=Path, default=REPO / "bench", help="where results.json and RESULTS.md go")
    p.add_argument("--only", default=None, help=f"comma-separated sections (default: all of {', '.join(SECTIONS)})")
    p.add_argument("--modules", default=None, help="the mutants section: only these modules (comma-separated); "
                   "the others keep their last figures")
    p.add_argument("--collect", action="store_true", help="the mutants section: the last runs' results in "
                   "build/mutants (python -m autograder.mutants), with the reviewed equivalents as they read now, "
                   "instead of running them again")
    args = p.parse_args(argv)
    chosen = args.only.split(",") if args.only else SECTIONS
    unknown = set(chosen) - set(SECTIONS) - set(OPTIONAL)
    if unknown:
        p.error(f"unknown section(s) {', '.join(sorted(unknown))}; choose from {', '.join(SECTIONS + OPTIONAL)}")
    if "gpu" in chosen:
        from bench.gpu_check import NO_CUDA, cuda_available

        if not cuda_available():                  # before anything is written: results.json keeps its figures
            print(NO_CUDA, file=sys.stderr)
            return 2
    out = args.out.resolve()
    work = out / "work" if out != REPO / "bench" else REPO / "build" / "bench"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    results = {"mode": "short" if args.short else "full", "machine": machine(), "sections": {}}
    if args.only:
        results = _kept(out / "results.json", results)
    measured = {"command": "python -m bench" + (" --short" if args.short else "")
                + (f" --only {args.only}" if args.only else "") + (f" --modules {args.modules}" if args.modules else "")
                + (" --collect" if args.collect else ""), **machine()}
    ctx: dict = {"short": args.short, "work": work, "modules": args.modules.split(",") if args.modules else None,
                 "collect": args.collect}
    start = time.perf_counter()
    for name in chosen:
        print(f"[bench] {name} ...", flush=True)
        t0 = time.perf_counter()
        ctx["previous"] = results["sections"].get(name)
        try:
            section = FUNCS[name](ctx)
            section["error"] = None
        except Exception:
            section = {"figures": [], "error": traceback.format_exc()}
        section["seconds"] = round(time.perf_counter() - t0, 1)
        section["measured"] = measured
        previous = results["sections"].get(name)
        if args.only and previous and previous.get("figures"):   # what this run replaces, in one line
            section["previous"] = {"measured": previous.get("measured", {"date": results["machine"]["date"]}),
                                   "figures": [{k: f[k] for k in ("name", "value", "unit")} for f in previous["figures"]]}
        if name == "notebooks":
            ctx["notebook_records"] = {Path(d["notebook"]).stem: d["record"] for d in section.get("details", [])}
        results["sections"][name] = section
        for f in section["figures"]:
            print(f"[bench]   {f['name']}: {f['value']} {f['unit']} -> {f['status']}", flush=True)
        if section["error"]:
            print(f"[bench]   FAILED: {section['error'].strip().splitlines()[-1]}", flush=True)
        if not args.only:
            results["total_s"] = round(time.perf_counter() - start, 1)
        out.mkdir(parents=True, exist_ok=True)      # written after every section: a stopped run keeps what it had
        (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
        (out / "RESULTS.md").write_text(markdown(results))
    print(f"[bench] done in {time.perf_counter() - start:.0f} s: {out / 'results.json'}, {out / 'RESULTS.md'}", flush=True)
    return 1 if any(s["error"] for s in results["sections"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
