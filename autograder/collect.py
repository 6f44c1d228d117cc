"""Find the submissions in a folder or an LMS zip and lay them out the way nbgrader wants them.

Accepted inputs (``SUBMISSIONS`` is a folder or a ``.zip`` file; a zip is extracted first and
then read like a folder; ``.ipynb_checkpoints`` and hidden files are skipped). ``<module>`` is
a module folder name under ``solutions/`` (e.g. ``01_ddp_pytorch``); ``<student>`` is any
name without a path separator (non-ASCII is fine). ``<notebook>`` is one of the module's
notebooks (``autograder.paths.notebooks``: most modules have one, named ``<module>``; a module
of several, such as ``05_fsdp2`` with ``05_fsdp2_part2``, is one nbgrader assignment whose
notebooks are graded together, into one row).

1. nbgrader's layout: ``<student>/<module>/<notebook>.ipynb`` (plus the module's scripts, which
   are replaced by the instructor's versions anyway). A module of one notebook: a module folder
   without ``<module>.ipynb`` but with exactly one other notebook (``<module>-Copy1.ipynb``,
   ``Untitled.ipynb``) is graded as that module's notebook (the row's detail says so); with
   several other notebooks it is an "invalid notebook". A module of several notebooks: a
   notebook the folder lacks is stood in for by another notebook of the folder (one not named
   after any of the module's notebooks) only when exactly one such notebook holds cells of the
   missing one (by their nbgrader grade_ids: a ``05_fsdp2_part2-Copy1.ipynb`` made from part 2)
   and it holds no other notebook's cells (the detail says so); otherwise nothing stands in, the
   missing notebook scores 0 and the others are graded (``autograder.grade``). A folder with none
   of the module's notebooks and none standing in, but other notebooks, is an "invalid notebook".
2. A folder per student: ``<student>/<notebook>.ipynb``.
3. A flat folder or LMS download, anywhere in the tree, file names read by nbgrader's own
   ``FileNameCollectorPlugin`` (the one ``nbgrader zip_collect`` uses: a ``named_regexp`` with
   ``student_id``/``file_id``/``timestamp`` groups, ``file_id`` being a notebook of a module, with
   or without ``.ipynb``). An instructor's own ``c.FileNameCollectorPlugin.named_regexp`` in
   ``autograder/nbgrader_config.py`` is tried first; then these, and the first that matches wins:

   - ``<notebook>_<student>_attempt_<timestamp>[_<anything>].ipynb``  (nbgrader's documented
     example, e.g. ``01_ddp_pytorch_ada_attempt_2024-05-01-10-00-00_01_ddp_pytorch.ipynb``)
   - ``<student>_[LATE_]<digits>_<digits>_<notebook>[-N].ipynb``  (Canvas' download naming)
   - ``<notebook>_<student>.ipynb``
   - ``<student>_<notebook>[<-_ ><anything>].ipynb``  (e.g. ``ada_01_ddp_pytorch.ipynb``)

   The longest notebook name that fits is read first: ``ada_05_fsdp2_part2.ipynb`` is part 2 of
   ``05_fsdp2``, not its first notebook with a suffix. A file named exactly after a notebook
   names no student: it counts only in a student's folder (2.). Several files for the same
   (student, notebook): the one with the latest timestamp, else the last by name, is graded (the
   detail names it). Files matching none of these are reported as unmatched and not graded
   (nobody can tell whose they are).

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

from autograder.paths import CONFIG, notebook_of, notebooks

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


def _collectors(names: list[str]) -> list:
    """nbgrader's FileNameCollectorPlugin, once per naming convention (see the module's docstring); ``names``: the
    notebooks' names, which the patterns try longest first."""
    from nbgrader.plugins import FileNameCollectorPlugin

    m = "|".join(re.escape(x) for x in sorted(names, key=len, reverse=True))
    patterns = [p for p in [_instructor_regexp()] if p] + [
        rf"^(?P<file_id>{m})_(?P<student_id>.+?)_attempt_(?P<timestamp>[0-9\-]+)(?:_.*)?\.ipynb$",
        rf"^(?P<student_id>[^_]+)_(?:LATE_)?\d+_\d+_(?P<file_id>{m})(?:-\d+)?\.ipynb$",
        rf"^(?P<file_id>{m})_(?P<student_id>.+)\.ipynb$",
        rf"^(?P<student_id>.+?)_(?P<file_id>{m})(?:[-_ ].*)?\.ipynb$",
    ]
    return [FileNameCollectorPlugin(named_regexp=p, log=_QUIET) for p in patterns]


def _visible(path: Path, base: Path) -> bool:
    return not any(part.startswith(".") or part == "__pycache__" for part in path.relative_to(base).parts)


def _stand_in(module: str, missing: str, others: list[Path]) -> Path | None:
    """The one notebook of ``others`` that holds cells of ``module``'s notebook ``missing`` (by grade_id) and of no
    other of its notebooks; None when there is not exactly one such notebook."""
    import json

    fits = []
    for path in others:
        try:
            cells = json.loads(path.read_text(encoding="utf-8")).get("cells", [])
            gids = {c.get("metadata", {}).get("nbgrader", {}).get("grade_id") for c in cells} - {None}
        except (OSError, ValueError, AttributeError):
            continue
        owners = {notebook_of(module, gid, default=None) for gid in gids} - {None}
        if owners == {missing}:
            fits.append(path)
    return fits[0] if len(fits) == 1 else None


def _normalise(f: Found) -> bool:
    """Give the notebooks of ``f.folder`` (nbgrader's layout) the module's notebooks' names (see the module's
    docstring: a Copy1 or Untitled graded in place of a missing one); False: the folder holds no notebook at all."""
    module, dest = f.module, f.folder
    names = notebooks(module)
    if len(names) == 1:
        target = dest / f"{module}.ipynb"
        if not target.exists():
            others = sorted(p.name for p in dest.glob("*.ipynb"))
            if len(others) == 1:
                (dest / others[0]).rename(target)
                f.detail = f"graded {others[0]} as {module}.ipynb"
            elif others:
                f.invalid = f"no {module}.ipynb and several other notebooks ({', '.join(others)})"
            else:
                return False      # a module folder without any notebook: treated as not submitted
        return True
    others = sorted(p for p in dest.glob("*.ipynb") if p.stem not in names)
    details = []
    for name in names:
        if not (dest / f"{name}.ipynb").exists() and (stand_in := _stand_in(module, name, others)):
            stand_in.rename(dest / f"{name}.ipynb")
            others.remove(stand_in)
            details.append(f"graded {stand_in.name} as {name}.ipynb")
    f.detail = "; ".join(details)
    if not any((dest / f"{name}.ipynb").exists() for name in names):
        if not others:
            return False
        f.invalid = (f"no {' or '.join(f'{n}.ipynb' for n in names)} and other notebooks "
                     f"({', '.join(p.name for p in others)})")
    return True


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
    owner = {name: m for m in modules for name in notebooks(m)}        # notebook -> its module
    collected = out / "collected"
    shutil.rmtree(collected, ignore_errors=True)
    # (student, module) -> notebook -> [(sortkey, path, origin)]
    candidates: dict[tuple[str, str], dict[str, list[tuple[str, Path, str]]]] = {}
    unmatched: list[str] = []
    folders: dict[tuple[str, str], Path] = {}

    # 1. nbgrader layout: <student>/<module>/
    for sdir in sorted(p for p in base.iterdir() if p.is_dir() and not p.name.startswith(".")):
        for mdir in sorted(p for p in sdir.iterdir() if p.is_dir() and p.name in known):
            folders[(sdir.name, mdir.name)] = mdir
    claimed = {p for f in folders.values() for p in f.rglob("*")}

    collectors = _collectors(list(owner))
    for nb in sorted(base.rglob("*.ipynb")):
        if nb in claimed or not _visible(nb, base) or not nb.is_file():
            continue
        rel = nb.relative_to(base)
        if nb.stem in owner:                                              # 2. <student>/<notebook>.ipynb
            if len(rel.parts) == 2:
                candidates.setdefault((rel.parts[0], owner[nb.stem]), {}).setdefault(nb.stem, []).append(
                    ("", nb, str(rel)))
            else:                           # no student in its name (a pattern would read "part2" of "05_fsdp2_part2")
                unmatched.append(str(rel))
            continue
        for collector in collectors:                                      # 3. flat / LMS names
            info = collector.collect(nb.name)
            name = (info or {}).get("file_id", "").removesuffix(".ipynb")
            if name in owner and info.get("student_id"):
                key = (info["student_id"].strip(), owner[name])
                candidates.setdefault(key, {}).setdefault(name, []).append((info.get("timestamp") or "", nb, str(rel)))
                break
        else:
            unmatched.append(str(rel))

    found: list[Found] = []
    for (student, module), mdir in sorted(folders.items()):
        dest = collected / student / module
        shutil.copytree(mdir, dest, ignore=shutil.ignore_patterns(".*", "__pycache__"))
        f = Found(student, module, dest, str(mdir.relative_to(base)))
        if _normalise(f):
            found.append(f)
    have = {(f.student, f.module) for f in found}
    for (student, module), by_name in sorted(candidates.items()):
        if (student, module) in have or "/" in student or not student:
            continue
        dest = collected / student / module
        dest.mkdir(parents=True)
        origins, details = [], []
        for name in [n for n in notebooks(module) if n in by_name]:
            items = sorted(by_name[name], key=lambda t: (t[0], t[1].name))
            _, nb, origin = items[-1]
            shutil.copy(nb, dest / f"{name}.ipynb")
            origins.append(origin)
            if len(items) > 1:
                details.append(f"{len(items)} files; graded {nb.name}")
        found.append(Found(student, module, dest, ", ".join(origins), "; ".join(details)))
    return sorted(found, key=lambda f: (f.student, f.module)), unmatched
