"""Find the submissions in a folder or an LMS zip and lay them out the way nbgrader wants them.

Accepted inputs (``SUBMISSIONS`` is a folder or a ``.zip`` file; a zip is extracted first and
then read like a folder; ``.ipynb_checkpoints`` and hidden files are skipped). ``<module>`` is
a module folder name under ``solutions/`` (e.g. ``01_ddp_pytorch``); ``<student>`` is any
name without a path separator (non-ASCII is fine).

1. nbgrader's layout: ``<student>/<module>/<module>.ipynb`` (plus the module's scripts, which
   are replaced by the instructor's versions anyway). A module folder without
   ``<module>.ipynb`` but with exactly one other notebook (``<module>-Copy1.ipynb``,
   ``Untitled.ipynb``) is graded as that module's notebook (the row's detail says so); with
   several other notebooks it is an "invalid notebook".
2. A folder per student: ``<student>/<module>.ipynb``.
3. A flat folder or LMS download, anywhere in the tree, file names read by nbgrader's own
   ``FileNameCollectorPlugin`` (the one ``nbgrader zip_collect`` uses: a ``named_regexp`` with
   ``student_id``/``file_id``/``timestamp`` groups, ``file_id`` being the module, with or
   without ``.ipynb``). An instructor's own ``c.FileNameCollectorPlugin.named_regexp`` in
   ``autograder/nbgrader_config.py`` is tried first; then these, and the first that matches wins:

   - ``<module>_<student>_attempt_<timestamp>[_<anything>].ipynb``  (nbgrader's documented
     example, e.g. ``01_ddp_pytorch_ada_attempt_2024-05-01-10-00-00_01_ddp_pytorch.ipynb``)
   - ``<student>_[LATE_]<digits>_<digits>_<module>[-N].ipynb``  (Canvas' download naming)
   - ``<module>_<student>.ipynb``
   - ``<student>_<module>[<-_ ><anything>].ipynb``  (e.g. ``ada_01_ddp_pytorch.ipynb``)

   Several files for the same (student, module): the one with the latest timestamp, else the
   last by name, is graded (the detail names it). Files matching none of these are reported
   as unmatched and not graded (nobody can tell whose they are).

Everything found is copied into ``OUT/collected/<student>/<module>/`` (rebuilt on every run),
which is what gets graded and hashed.
"""
from __future__ import annotations

import logging
import re
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path

from autograder.paths import CONFIG

# the plugin logs a warning for every name a pattern does not match: several per file, all expected
_QUIET = logging.getLogger("autograder.collect.names")
_QUIET.setLevel(logging.ERROR)


@dataclass
class Found:
    student: str
    module: str
    folder: Path            # the normalised folder OUT/collected/<student>/<module>
    origin: str             # where it came from, relative to SUBMISSIONS
    detail: str = ""        # e.g. "graded <module>-Copy1.ipynb as <module>.ipynb"
    invalid: str = ""       # set when the folder cannot be graded at all


def _instructor_regexp() -> str:
    """``c.FileNameCollectorPlugin.named_regexp`` from the course's nbgrader config ("" when not set)."""
    from traitlets.config.loader import PyFileConfigLoader

    config = PyFileConfigLoader(CONFIG.name, path=str(CONFIG.parent)).load_config()
    return config.FileNameCollectorPlugin.get("named_regexp", "") if "FileNameCollectorPlugin" in config else ""


def _collectors(modules: list[str]) -> list:
    """nbgrader's FileNameCollectorPlugin, once per naming convention (see the module's docstring)."""
    from nbgrader.plugins import FileNameCollectorPlugin

    m = "|".join(re.escape(x) for x in sorted(modules, key=len, reverse=True))
    patterns = [p for p in [_instructor_regexp()] if p] + [
        rf"^(?P<file_id>{m})_(?P<student_id>.+?)_attempt_(?P<timestamp>[0-9\-]+)(?:_.*)?\.ipynb$",
        rf"^(?P<student_id>[^_]+)_(?:LATE_)?\d+_\d+_(?P<file_id>{m})(?:-\d+)?\.ipynb$",
        rf"^(?P<file_id>{m})_(?P<student_id>.+)\.ipynb$",
        rf"^(?P<student_id>.+?)_(?P<file_id>{m})(?:[-_ ].*)?\.ipynb$",
    ]
    return [FileNameCollectorPlugin(named_regexp=p, log=_QUIET) for p in patterns]


def _visible(path: Path, base: Path) -> bool:
    return not any(part.startswith(".") or part == "__pycache__" for part in path.relative_to(base).parts)


def collect(submissions: Path, out: Path, modules: list[str]) -> tuple[list[Found], list[str]]:
    """Normalise ``submissions`` into ``out/collected``; return what was found and unmatched files."""
    submissions = Path(submissions)
    base = submissions
    if submissions.is_file() and zipfile.is_zipfile(submissions):
        base = out / "extracted"
        shutil.rmtree(base, ignore_errors=True)
        with zipfile.ZipFile(submissions) as z:
            z.extractall(base)       # zipfile drops absolute paths and '..' components
    elif not submissions.is_dir():
        raise SystemExit(f"error: {submissions} is neither a folder nor a zip file of submissions")
    known = set(modules)
    collected = out / "collected"
    shutil.rmtree(collected, ignore_errors=True)
    candidates: dict[tuple[str, str], list[tuple[str, Path, str]]] = {}   # (s, m) -> [(sortkey, path, kind)]
    unmatched: list[str] = []
    folders: dict[tuple[str, str], Path] = {}

    # 1. nbgrader layout: <student>/<module>/
    for sdir in sorted(p for p in base.iterdir() if p.is_dir() and not p.name.startswith(".")):
        for mdir in sorted(p for p in sdir.iterdir() if p.is_dir() and p.name in known):
            folders[(sdir.name, mdir.name)] = mdir
    claimed = {p for f in folders.values() for p in f.rglob("*")}

    collectors = _collectors(modules)
    for nb in sorted(base.rglob("*.ipynb")):
        if nb in claimed or not _visible(nb, base) or not nb.is_file():
            continue
        rel = nb.relative_to(base)
        if len(rel.parts) == 2 and nb.stem in known:                      # 2. <student>/<module>.ipynb
            candidates.setdefault((rel.parts[0], nb.stem), []).append(("", nb, str(rel)))
            continue
        for collector in collectors:                                      # 3. flat / LMS names
            info = collector.collect(nb.name)
            module = (info or {}).get("file_id", "").removesuffix(".ipynb")
            if module in known and info.get("student_id"):
                key = (info["student_id"].strip(), module)
                candidates.setdefault(key, []).append((info.get("timestamp") or "", nb, str(rel)))
                break
        else:
            unmatched.append(str(rel))

    found: list[Found] = []
    for (student, module), mdir in sorted(folders.items()):
        dest = collected / student / module
        shutil.copytree(mdir, dest, ignore=shutil.ignore_patterns(".*", "__pycache__"))
        f = Found(student, module, dest, str(mdir.relative_to(base)))
        target = dest / f"{module}.ipynb"
        if not target.exists():
            others = sorted(p.name for p in dest.glob("*.ipynb"))
            if len(others) == 1:
                (dest / others[0]).rename(target)
                f.detail = f"graded {others[0]} as {module}.ipynb"
            elif others:
                f.invalid = f"no {module}.ipynb and several other notebooks ({', '.join(others)})"
            else:
                continue      # a module folder without any notebook: treated as not submitted
        found.append(f)
    have = {(f.student, f.module) for f in found}
    for (student, module), items in sorted(candidates.items()):
        if (student, module) in have or "/" in student or not student:
            continue
        items.sort(key=lambda t: (t[0], t[1].name))
        _, nb, origin = items[-1]
        dest = collected / student / module
        dest.mkdir(parents=True)
        shutil.copy(nb, dest / f"{module}.ipynb")
        detail = f"{len(items)} files; graded {nb.name}" if len(items) > 1 else ""
        found.append(Found(student, module, dest, origin, detail))
    return sorted(found, key=lambda f: (f.student, f.module)), unmatched
