"""Autograde a class: grades.csv, nbgrader's gradebook and HTML feedback per student.

    python -m autograder.grade SUBMISSIONS [--out build/grading] [--jobs N] [--timeout S]
                               [--memory GIB] [--modules 01_ddp_pytorch,...] [--students roster.txt]
    make grade SUBMISSIONS=folder-or-zip

SUBMISSIONS is a folder in nbgrader's layout (``<student>/<module>/<module>.ipynb``, and each other notebook of a
module of several, ``autograder.paths.notebooks``), a folder per student, a flat folder or an LMS zip (see
``autograder/collect.py`` for the accepted names).

What happens:

1. The submissions are normalised into ``OUT/collected/<student>/<module>/``.
2. Each module's source (``solutions/<module>``, hidden tests included) is registered in the
   main gradebook ``OUT/nbgrader/gradebook.db`` (nbgrader's SQLite, a real nbgrader course
   root you can open with formgrader) and in a one-module template gradebook
   ``OUT/templates/<module>`` that every submission's scratch root starts from.
3. Every (student, module) is checked in the grader's process first: an empty file, a file
   that is not JSON or not a valid notebook is an "invalid notebook" (score 0, never run); a
   read-only cell whose checksum differs from the source, or that is missing, makes the
   status "tests modified" (the notebook is still graded: nbgrader restores the original
   test cells, ``OverwriteCells.add_missing_cells`` re-adds deleted ones, so the score is what
   the original tests give; the status tells the instructor to look). A module of several notebooks: each
   notebook so; one that was not handed in, or cannot be graded (it is set aside), scores 0 and the row's detail
   names it, the others are graded; none of them gradable is an "invalid notebook".
4. Every remaining submission is autograded in its own process and scratch root (its notebook beside the
   module's released files, never the solutions' scripts: see ``RELEASED``), up to
   ``--jobs`` at a time, with a wall-clock and a memory limit (``autograder/contain.py`` says
   exactly what is contained and what is not). A submission past the time limit is "timed
   out" (score 0); a kernel that dies (``os._exit``, a segfault) or is killed for using more
   than the memory limit is "kernel died" (score 0); nbgrader failing on the notebook for
   another reason is "invalid notebook" (score 0, the error in the detail column). Its kernel runs with
   ``COURSE_ASKED`` (the hidden cases its test cells run, ``autograder.checks.asked``); after nbgrader has run
   the notebook, the job's own process, where no notebook code ran, decides the score of every cell that
   ``autograder.checks`` judges from the plain data the cell handed in, whatever the kernel reported. The
   pre-check also lists the lines of the student's own cells that reach for the grading machinery (the
   ``flags`` column, ``autograder.checks.tamper``; it decides nothing).
5. The parent (only it) merges each result into the main gradebook, copies the HTML feedback
   to ``OUT/feedback/<student>/<module>/<notebook>.html`` and writes ``OUT/grades.csv``:
   one row per (student, module) expected (every student found or listed in ``--students`` x
   every module graded) with columns student, module, score, max_score, status, seconds,
   detail, flags; status is one of graded, timed out, kernel died, invalid notebook, tests modified,
   missing. ``OUT/timings.json`` has grading seconds per submission per module.

Reruns are incremental: a (student, module) whose submission folder, module source, nbgrader config
and grading code (autograder/, coursekit/, nbgrader's version) hash the same as last time is not graded again (``OUT/cache.json``); a
timed-out or killed one is retried when the limits changed. Rerunning on the same input gives
the same grades.csv and no duplicate gradebook rows.
The parts: ``autograder.job`` (one submission's job, local or on a cluster's node), ``autograder.cache``,
``autograder.gradebook`` (the merge into the main gradebook), ``autograder.reports`` (grades.csv, timings,
the feedback folder), ``autograder.cluster`` (``--address``); this file plans, runs and records them.
Notebooks run with ``COURSE_GRADING=1`` (their parameters cell skips the demo training runs),
``COURSE_SIZE=smoke``, no GPU.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
import warnings
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from autograder.cache import Cache, cache_key, module_hash
from autograder.checks.tamper import scan
from autograder.collect import Found, collect
from autograder.contain import jail_available, jail_missing_reason
from autograder.gradebook import forget, merge, plain_feedback
from autograder.job import DATA, config_text, hidden_paths, job_threads, run_job
from autograder.paths import SOLUTIONS, modules, notebooks, tool_env
from autograder.release import strip_scripts
from autograder.reports import STATUSES, write_reports

# nbgrader's gradebook makes SQLAlchemy warn about its own session use on every merge (about 150 lines in a run of
# the test class): the instructor sees the progress bar, a line per problem and the summary, not that.
warnings.filterwarnings("ignore", message=r"Object of type <\w+> not in session", module=r"nbgrader\.")

DEFAULT_TIMEOUT = 300          # seconds per submission (wall clock, kernel start included)
DEFAULT_MEMORY = 8 * 2**30     # bytes RSS of the whole process tree of one submission
IGNORE = shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__")


# ---------------------------------------------------------------- nbgrader course roots

def _api(root: Path):
    from nbgrader.apps import NbGraderAPI
    from traitlets.config.loader import PyFileConfigLoader

    if str(Path(sys.executable).parent) not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = tool_env()["PATH"]     # nbgrader runs `alembic` from PATH: this venv's bin/
    return NbGraderAPI(config=PyFileConfigLoader("nbgrader_config.py", path=str(root)).load_config())


def _register(root: Path, module: str) -> None:
    """generate_assignment ``module`` in the course root ``root`` (its gradebook gets the cells)."""
    shutil.rmtree(root / "solutions" / module, ignore_errors=True)
    shutil.copytree(SOLUTIONS / module, root / "solutions" / module, ignore=IGNORE)
    r = _api(root).generate_assignment(module, force=True, create=True)
    if not r.get("success"):
        raise RuntimeError(f"could not register {module}:\n{r.get('log')}\n{r.get('error')}")
    strip_scripts(root / "course" / module)    # the release as students get it: scripts' answers stubbed


def prepare(out: Path, wanted: list[str]) -> dict[str, Path]:
    """Template roots (one module each) and the main course root; redone only when a source changed."""
    from nbgrader.api import Gradebook, MissingEntry

    main = out / "nbgrader"
    main.mkdir(parents=True, exist_ok=True)
    (main / "nbgrader_config.py").write_text(config_text(main))
    hashes_file = main / "registered.json"
    registered = json.loads(hashes_file.read_text()) if hashes_file.exists() else {}
    templates = {}
    for m in wanted:
        digest = module_hash(m)
        tpl = out / "templates" / m
        if not (tpl / "gradebook.db").exists() or (tpl / "hash").read_text() != digest:
            shutil.rmtree(tpl, ignore_errors=True)
            tpl.mkdir(parents=True)
            (tpl / "nbgrader_config.py").write_text(config_text(tpl))
            _register(tpl, m)
            (tpl / "hash").write_text(digest)
        templates[m] = tpl
        if registered.get(m) != digest:
            with Gradebook(f"sqlite:///{main / 'gradebook.db'}") as gb:
                try:
                    gb.remove_assignment(m)    # the source changed: old grades are void
                except MissingEntry:
                    pass
            for sub in ("autograded", "feedback"):
                for d in (main / sub).glob(f"*/{m}"):
                    shutil.rmtree(d)
            _register(main, m)
            registered[m] = digest
            hashes_file.write_text(json.dumps(registered, indent=1, sort_keys=True))
        offline_digits(tpl / DATA)
    return templates


def offline_digits(folder: Path) -> None:
    """The course's offline data set (``coursekit.data.load_digits``: scikit-learn's digits on MNIST's canvas, kept
    as .npy files) made once in ``folder``, which every job of the template gets as its ``COURSE_DATA``
    (``autograder.job``): each kernel then reads it instead of importing scikit-learn (about 1 s per kernel) and
    writing it again, and every job grades on the same data, whatever the grading machine's own data folder holds."""
    from coursekit.data import load_digits

    for train in (True, False):
        load_digits(train=train, data_dir=str(folder), quiet=True)


# ---------------------------------------------------------------- checks before running anything

def precheck(notebook: Path, template: Path, module: str) -> tuple[str, str]:
    """(invalid, modified): why the notebook cannot be graded, and which read-only cells changed (compared with the
    released notebook of the same name)."""
    import nbformat
    from nbgrader.utils import compute_checksum

    if not notebook.exists():
        return f"no {notebook.name}", ""
    raw = notebook.read_bytes()
    if not raw.strip():
        return "empty file", ""
    try:
        json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        return f"not a notebook: the file is not valid JSON ({str(e)[:80]})", ""
    try:
        nb = nbformat.reads(raw.decode("utf-8"), as_version=4)
        nbformat.validate(nb)
    except Exception as e:  # noqa: BLE001  (nbformat raises several kinds)
        return f"not a valid notebook ({type(e).__name__}: {str(e).splitlines()[0][:80]})", ""
    def by_id(notebook):
        return {c.metadata["nbgrader"]["grade_id"]: c for c in notebook.cells
                if c.get("metadata", {}).get("nbgrader", {}).get("grade_id")}

    cells = by_id(nb)
    # the released notebook (hidden tests removed) is what the student started from
    released = nbformat.read(template / "course" / module / notebook.name, as_version=4)
    changed = []
    for gid, ref in by_id(released).items():
        if not ref.metadata["nbgrader"].get("locked"):
            continue
        if gid not in cells:
            changed.append(f"deleted {gid}")
        elif compute_checksum(cells[gid]) != compute_checksum(ref):
            changed.append(f"edited {gid}")
    return "", ", ".join(changed)


def precheck_folder(folder: Path, template: Path, module: str) -> tuple[str, str, str]:
    """(invalid, modified, missing) of a submission's folder: :func:`precheck` of each of the module's notebooks.

    A module of one notebook: exactly ``precheck`` of it (``missing`` is ""). A module of several: a notebook the
    folder lacks is not graded (nbgrader scores its cells 0) and ``missing`` says so, unless the folder lacks all of
    them (invalid, naming them). A notebook that cannot be graded (empty, not JSON, not a notebook) beside one that
    can is set aside, renamed ``<name>.ipynb.unreadable`` in this collected copy (nbgrader's autograde would fail on
    it, and the others would lose their points with it): its cells score 0 and ``missing`` says why; when none can be
    graded the submission is invalid, each notebook's name before its reason. The changed read-only cells of all of
    them together."""
    names = notebooks(module)
    if len(names) == 1:
        return (*precheck(folder / f"{names[0]}.ipynb", template, module), "")
    present = [n for n in names if (folder / f"{n}.ipynb").exists()]
    absent = [f"{n}.ipynb" for n in names if n not in present]
    if not present:
        return f"no {' or '.join(absent)}", "", ""
    unreadable, modified = [], []
    for n in present:
        why, changed = precheck(folder / f"{n}.ipynb", template, module)
        unreadable += [(n, why)] if why else []
        modified += [changed] if changed else []
    if len(unreadable) == len(present):
        return "; ".join(f"{n}.ipynb: {why}" for n, why in unreadable), "", ""
    for n, _ in unreadable:
        (folder / f"{n}.ipynb").rename(folder / f"{n}.ipynb.unreadable")
    missing = ([f"not handed in (its cells score 0): {', '.join(absent)}"] if absent else []) + (
        [f"could not be graded, set aside (its cells score 0): "
         f"{', '.join(f'{n}.ipynb ({why})' for n, why in unreadable)}"] if unreadable else [])
    return "", ", ".join(modified), "; ".join(missing)


def scan_folder(folder: Path, module: str) -> list[str]:
    """``autograder.checks.tamper.scan`` of each of the module's notebooks in ``folder`` (a module of several: each
    line after its notebook's name)."""
    names = notebooks(module)
    if len(names) == 1:
        return scan(folder / f"{names[0]}.ipynb")
    return [f"{n}.ipynb: {line}" for n in names if (folder / f"{n}.ipynb").exists()
            for line in scan(folder / f"{n}.ipynb")]


def _status(run: dict, timeout: float, memory: int) -> tuple[str, str]:
    o, r = run["outcome"], run["result"]
    if o.killed == "timeout":
        return "timed out", f"stopped after {timeout:.0f} s"
    if o.killed == "memory":
        return "kernel died", f"killed: used more than {memory / 2**30:.1f} GiB of memory"
    if r.get("success"):
        return "graded", ""
    text = (r.get("error", "") + r.get("log", "") + o.output)
    if "DeadKernelError" in text or "Kernel died" in text or "kernel died" in text.lower():
        return "kernel died", "the kernel exited or crashed while running the notebook"
    lines = [ln for ln in text.splitlines() if ln.strip()]
    last = lines[-1].strip()[:200] if lines else f"grader exited with {o.returncode}"
    return "invalid notebook", f"nbgrader could not grade it: {last}"


# ---------------------------------------------------------------- planning: what to run

@dataclasses.dataclass(frozen=True)
class Job:
    """One submission to autograde in its own process."""

    found: Found
    key: str           # cache key: what its grade depends on (see cache_key)
    detail: str        # notes for its row (from collecting it; read-only cells it changed)
    timeout: float     # seconds
    status: str        # its status if nbgrader grades it: "graded", or "tests modified"
    feedback: bool = True   # write its HTML feedback page
    flags: str = ""    # lines of the student's code that reach for the grading machinery (autograder.checks.tamper)


def plan(found: list[Found], wanted: list[str], templates: dict[str, Path], main: Path, cache: Cache,
         timeout: float, memory: int, max_scores: dict[str, float],
         feedback: bool = True) -> tuple[dict, list[Job], int]:
    """(rows known without running anything, jobs to run, how many rows came from the cache).

    A submission is not run when its cached row still holds or when the pre-check finds it invalid."""
    rows: dict[tuple[str, str], dict] = {}
    jobs: list[Job] = []
    n_cached = 0
    limits = [timeout, memory]
    for f in found:
        if f.module not in wanted:
            continue
        key = cache_key(f)
        cached = cache.row(f, key, limits, main, feedback)
        if cached is not None:
            rows[(f.student, f.module)] = cached
            n_cached += 1
            continue
        invalid, modified, missing = (f.invalid, "", "") if f.invalid else precheck_folder(
            f.folder, templates[f.module], f.module)
        if invalid:
            row = {"student": f.student, "module": f.module, "score": 0.0, "max_score": max_scores[f.module],
                   "seconds": 0.0, "status": "invalid notebook", "detail": invalid, "flags": ""}
            forget(main, f.student, f.module)
            plain_feedback(main, row)
            rows[(f.student, f.module)] = row
            cache.store(f, key, row, limits)
            continue
        detail = "; ".join(x for x in (f.detail, missing, modified and f"read-only cells changed: {modified}") if x)
        flags = " | ".join(scan_folder(f.folder, f.module))
        jobs.append(Job(f, key, detail, timeout, "tests modified" if modified else "graded", feedback, flags))
    return rows, jobs, n_cached


def slowest_first(jobs: list[Job], timings: Path) -> list[Job]:
    """By the last run's mean seconds per module, so that a long submission does not start last."""
    previous = {}
    if timings.exists():
        try:
            previous = {m: t["mean_s"] for m, t in json.loads(timings.read_text())["seconds_per_submission"].items()}
        except (ValueError, KeyError):
            previous = {}
    return sorted(jobs, key=lambda j: (-previous.get(j.found.module, 0.0), j.found.module, j.found.student))


# ---------------------------------------------------------------- running: each job in its process

def run_jobs(jobs: list[Job], templates: dict[str, Path], hide_also: list[Path], workers: int, memory: int):
    """Run the jobs, ``workers`` at a time; yield (job, run) as each one finishes (see run_job)."""
    jobs_base = Path(tempfile.mkdtemp(prefix="course-grading-"))
    hide = [*hide_also, jobs_base.resolve()]
    try:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            futures = {pool.submit(run_job, j.found, templates[j.found.module], jobs_base, hide, j.timeout, memory,
                                   j.feedback, threads=job_threads(workers)): j
                       for j in jobs}
            for fut in as_completed(futures):
                run = fut.result()
                try:
                    yield futures[fut], run
                finally:
                    shutil.rmtree(run["job"], ignore_errors=True)
    finally:
        shutil.rmtree(jobs_base, ignore_errors=True)


def _progress(jobs: list[Job], quiet: bool, where: str = ""):
    """A progress bar over the jobs (None when quiet or without tqdm)."""
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        return None
    return tqdm(total=len(jobs), disable=quiet or not jobs, unit="notebook", desc=where or None, file=sys.stderr)


def record(job: Job, run: dict, main: Path, out: Path, max_score: float, memory: int) -> dict:
    """The row of a finished job: its grades merged into the main gradebook (or forgotten), its feedback
    and its log."""
    f = job.found
    status, why = _status(run, job.timeout, memory)
    row = {"student": f.student, "module": f.module, "score": 0.0, "max_score": max_score,
           "seconds": round(run["outcome"].seconds, 1), "peak_rss_mib": round(run["outcome"].peak_rss / 2**20)}
    if run["result"].get("autograde_seconds") is not None:
        # the job's fixed cost: everything but nbgrader's autograde (process start, imports, feedback page, merge)
        row["fixed_s"] = round(run["outcome"].seconds - run["result"]["autograde_seconds"], 2)
    if status == "graded":
        row["score"] = round(merge(main, run, f.student, f.module), 2)
        status = job.status
        if job.feedback and run["result"].get("feedback") is False:
            why = "feedback could not be generated"
    else:
        forget(main, f.student, f.module)
    row["status"] = status
    if run.get("node") and not run.get("jailed"):      # graded on a Ray cluster's node that has no jail
        why = "; ".join(x for x in (why, f"graded on {run['node']} without the jail (no bubblewrap there)") if x)
    row["detail"] = "; ".join(x for x in (job.detail, why) if x)
    row["flags"] = job.flags
    if status not in ("graded", "tests modified"):
        plain_feedback(main, row)
    logdir = out / "logs" / f.student
    logdir.mkdir(parents=True, exist_ok=True)
    (logdir / f"{f.module}.log").write_text(
        run["outcome"].output + "\n" + run["result"].get("log", "") + run["result"].get("error", ""))
    return row


# ---------------------------------------------------------------- reports

# ---------------------------------------------------------------- the class

def grade(submissions: Path, out: Path, only: list[str] | None = None, quiet: bool = False,
          jobs: int | None = None, timeout: float | None = None, memory: float | None = None,
          roster: list[str] | None = None, address: str | None = None, feedback: bool = True) -> list[dict]:
    """Grade everything under ``submissions``; return one row per expected (student, module).

    ``timeout`` (seconds) and ``memory`` (bytes) apply to each submission; ``jobs`` submissions
    are graded at once (default: the number of cores). With ``address`` (``auto``, ``HOST:PORT``) every
    submission is a Ray task on that cluster instead (``autograder.cluster``), as many at once as it has CPUs.
    ``feedback=False`` skips the HTML feedback pages of graded submissions (about 1 s each; a later run that
    wants them grades those submissions again).
    """
    from nbgrader.api import Gradebook

    submissions, out = Path(submissions).resolve(), Path(out).resolve()
    if not submissions.exists():
        raise SystemExit(f"error: no submissions at {submissions} (a folder in nbgrader's layout "
                         "SUBMISSIONS/<student>/<module>/<module>.ipynb, a flat folder or an LMS zip)")
    out.mkdir(parents=True, exist_ok=True)
    say = (lambda *a: None) if quiet else (lambda *a: print(*a, file=sys.stderr, flush=True))
    all_modules = modules()
    unknown = set(only or ()) - set(all_modules)
    if unknown:
        raise SystemExit(f"error: no such module under solutions/: {', '.join(sorted(unknown))}")
    found, unmatched = collect(submissions, out, all_modules)
    wanted = list(only) if only else sorted({f.module for f in found})
    students = sorted({f.student for f in found} | set(roster or ()))
    workers = max(1, jobs or os.cpu_count() or 1)
    memory = int(memory or DEFAULT_MEMORY)
    run_start = time.perf_counter()

    templates = prepare(out, wanted)
    main = out / "nbgrader"
    with Gradebook(f"sqlite:///{main / 'gradebook.db'}") as gb:
        max_scores = {m: gb.find_assignment(m).max_score for m in wanted}
        for s in students:
            gb.update_or_create_student(s)
    cache = Cache(out / "cache.json")
    rows, todo, n_cached = plan(found, wanted, templates, main, cache, float(timeout or DEFAULT_TIMEOUT),
                                memory, max_scores, feedback)
    todo = slowest_first(todo, out / "timings.json")
    if todo and address:
        from autograder.cluster import run_jobs_on_ray

        say(f"grading {len(todo)} submission(s) of {len(wanted)} module(s) on the Ray cluster at {address}")
        runs = run_jobs_on_ray(todo, templates, address, memory, hide=hidden_paths(out, submissions))
    else:
        if todo:
            say(f"grading {len(todo)} submission(s) of {len(wanted)} module(s), {workers} at a time"
                f"{'' if jail_available() else f' (no jail: {jail_missing_reason()}; kernels see the whole filesystem and the network)'}")
        runs = run_jobs(todo, templates, hidden_paths(out, submissions), workers, memory)
    bar = _progress(todo, quiet, "on Ray" if address else "")
    jobs_start = time.perf_counter()
    try:
        for job, run in runs:
            f = job.found
            row = record(job, run, main, out, max_scores[f.module], memory)
            rows[(f.student, f.module)] = row
            cache.store(f, job.key, row, [job.timeout, memory])
            if bar is not None:
                bar.set_postfix_str(f"{f.student}/{f.module}", refresh=False)
                bar.update()
    finally:
        if bar is not None:
            bar.close()

    table = [rows.get((s, m)) or {"student": s, "module": m, "score": 0.0, "max_score": max_scores[m],
                                  "status": "missing", "seconds": 0.0, "detail": "", "flags": ""}
             for s in students for m in wanted]
    write_reports(out, main, table, wanted, workers, len(todo), time.perf_counter() - run_start,
                  time.perf_counter() - jobs_start)
    counts = Counter(r["status"] for r in table)
    say("summary: " + ", ".join(f"{counts[s]} {s}" for s in STATUSES if counts[s])
        + f" ({len(todo)} run now, {n_cached} unchanged since the last run)")
    if unmatched:
        say(f"{len(unmatched)} file(s) matched no accepted name and were not graded: {', '.join(unmatched[:5])}"
            + (" ..." if len(unmatched) > 5 else ""))
    return table


def watch(submissions: Path, out: Path, every: float, **options) -> None:
    """Grade ``submissions`` again every ``every`` seconds until interrupted (Ctrl-C): each pass grades only what
    is new or changed since it was last graded (``cache.json``, which also makes a restarted watch pick up where
    it stopped), and writes its feedback and ``grades.csv`` at once, so students can see a grade the same day.

    Ctrl-C (or SIGTERM) stops the watch after the pass under way, so no submission is left half graded; a second
    Ctrl-C stops at once. The signal only sets a flag: Python drops a KeyboardInterrupt that lands in a clean-up
    callback (SQLAlchemy's, while nbgrader's gradebook closes), and the watch would go on."""
    import signal

    quiet = options.get("quiet")
    say = (lambda *a: None) if quiet else (lambda *a: print(*a, file=sys.stderr, flush=True))
    stopping: list[int] = []

    def on_signal(signum, frame):
        if stopping:
            raise KeyboardInterrupt
        stopping.append(signum)
        if not quiet:   # os.write: print() inside a handler can interrupt another print on the same stream
            os.write(sys.stderr.fileno(), b"stopping after this pass (Ctrl-C again stops now)\n")

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    say(f"watching {submissions} every {every:.0f} s (Ctrl-C stops)")
    try:
        while not stopping:
            if Path(submissions).exists():
                grade(submissions, out, **options)
            else:
                say(f"{submissions} does not exist yet")
            next_pass = time.monotonic() + every
            while not stopping and time.monotonic() < next_pass:
                time.sleep(min(0.2, every))
    except KeyboardInterrupt:
        pass
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    say("stopped watching")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("submissions", type=Path, help="folder or .zip of submissions")
    p.add_argument("--out", type=Path, default=Path("build/grading"))
    p.add_argument("--modules", default=None, help="comma-separated modules to grade (default: all found)")
    p.add_argument("--students", type=Path, default=None,
                   help="roster file, one student id a line: students without any submission get 'missing' rows")
    p.add_argument("--jobs", type=int, default=None, help="submissions graded at once (default: cores)")
    p.add_argument("--timeout", type=float, default=None,
                   help=f"seconds per submission (default {DEFAULT_TIMEOUT})")
    p.add_argument("--memory", type=float, default=None,
                   help=f"GiB per submission's process tree (default {DEFAULT_MEMORY / 2**30:.0f})")
    p.add_argument("--address", default=None,
                   help="grade on this Ray cluster (auto, or HOST:PORT): one Ray task per submission")
    p.add_argument("--watch", type=float, default=None, metavar="SECONDS",
                   help="keep grading: every SECONDS, what is new or changed (Ctrl-C stops)")
    p.add_argument("--no-feedback", action="store_true",
                   help="no HTML feedback pages for graded submissions (faster; grades and gradebook as usual)")
    p.add_argument("--quiet", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    roster = None
    if args.students:
        roster = [ln.strip() for ln in args.students.read_text(encoding="utf-8").splitlines()
                  if ln.strip() and not ln.startswith("#")]
    options = dict(only=args.modules.split(",") if args.modules else None, quiet=args.quiet, jobs=args.jobs,
                   timeout=args.timeout, memory=args.memory * 2**30 if args.memory else None, roster=roster,
                   address=args.address, feedback=not args.no_feedback)
    if args.watch:
        watch(args.submissions, args.out, args.watch, **options)
        return 0
    rows = grade(args.submissions, args.out, **options)
    for r in rows:
        print(f"{r['student']:<20} {r['module']:<20} {r['score']:>6} / {r['max_score']:<6} {r['status']:<16} {r['detail']}")
    flagged = [r for r in rows if r.get("flags")]
    if flagged:
        print(f"\n{len(flagged)} submission(s) reach for the grading machinery (the flags column of grades.csv; "
              "this decides nothing, a human looks):")
        for r in flagged:
            print(f"  {r['student']}/{r['module']}: {r['flags']}")
    print(f"grades: {args.out / 'grades.csv'}; feedback: {args.out / 'feedback'}; "
          f"gradebook: {args.out / 'nbgrader' / 'gradebook.db'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
