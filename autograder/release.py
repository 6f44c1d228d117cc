"""Generate the student release (course/) from the instructor source (solutions/) with nbgrader.

    python -m autograder.release            # regenerate course/ in place (make assignments)
    python -m autograder.release --into DIR # generate into DIR instead (the tests compare it)
    python -m autograder.release --module 03_ray_data   # regenerate one module's folder only

nbgrader replaces everything between ``### BEGIN SOLUTION`` and ``### END SOLUTION``
with a stub, removes hidden tests, clears outputs and records checksums of the
read-only cells. The module's scripts are copied with the same treatment for their
solution regions (``### BEGIN SOLUTION`` / ``### END SOLUTION`` lines in a ``.py`` file):
each becomes a stub that raises ``NotImplementedError``, so a script never hands out
an exercise's answer.
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from autograder.paths import CONFIG, REPO, SOLUTIONS, modules, tool_env  # noqa: F401  (re-exported)


def nbgrader(*args: str, cwd: Path, root: Path, extra: tuple[str, ...] = ()) -> None:
    """Run an nbgrader command with the course config and a given course root."""
    cmd = [str(Path(sys.executable).parent / "nbgrader"), *args,
           f"--CourseDirectory.root={root}", *extra]
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=tool_env())
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}")


SCRIPT_STUB = "# YOUR CODE HERE (the notebook's exercise: finish it there, then copy it here)"


def strip_script(text: str) -> str:
    """A script's text with each solution region replaced by a stub at the region's indentation."""
    out, inside = [], False
    for line in text.splitlines(keepends=True):
        mark = line.strip()
        if mark == "### BEGIN SOLUTION":
            if inside:
                raise ValueError("nested ### BEGIN SOLUTION")
            inside, indent = True, line[: len(line) - len(line.lstrip())]
            out += [f"{indent}{SCRIPT_STUB}\n", f"{indent}raise NotImplementedError()\n"]
        elif mark == "### END SOLUTION":
            if not inside:
                raise ValueError("### END SOLUTION without a BEGIN")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError("### BEGIN SOLUTION without an END")
    return "".join(out)


def strip_scripts(folder: Path) -> None:
    """Apply :func:`strip_script` to every Python script under ``folder`` (in place)."""
    for path in sorted(Path(folder).rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        if "### BEGIN SOLUTION" in text:
            path.write_text(strip_script(text), encoding="utf-8")


def generate(into: Path, only: list[str] | None = None) -> None:
    """Write the release of every module into ``into`` (which is replaced).

    With ``only``, just those modules' folders inside ``into`` are replaced.
    """
    unknown = set(only or ()) - set(modules())
    if unknown:
        raise SystemExit(f"no such module under solutions/: {', '.join(sorted(unknown))}")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        shutil.copytree(SOLUTIONS, root / "solutions",
                        ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__"))
        shutil.copy(CONFIG, root / "nbgrader_config.py")
        for m in only or modules():
            nbgrader("generate_assignment", m, "--force", cwd=root, root=root,
                     extra=(f"--CourseDirectory.db_url=sqlite:///{root / 'gradebook.db'}",))
            strip_scripts(root / "course" / m)
        if only:
            for m in only:
                shutil.rmtree(into / m, ignore_errors=True)
                shutil.copytree(root / "course" / m, into / m)
            return
        if into.exists():
            shutil.rmtree(into)
        shutil.copytree(root / "course", into)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--into", type=Path, default=REPO / "course")
    p.add_argument("--module", action="append", help="release only this module (repeatable)")
    args = p.parse_args(argv)
    generate(args.into, args.module)
    print(f"released {', '.join(args.module or modules())} into {args.into}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
