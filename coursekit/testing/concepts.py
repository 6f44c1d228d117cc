"""Concept questions: a student's answer (letters) checked against the expected one, with the reason."""
from __future__ import annotations


def check_concept(answer, expected, why: str) -> None:
    """Grade a concept question: ``answer`` (a letter, or a set/list of letters) against ``expected``.

    A wrong answer fails with the expected answer's explanation; a right one prints it (stdout
    only: nbgrader scores a test cell that writes to stderr as failed)."""
    def norm(a):
        if isinstance(a, str):
            return frozenset(x for x in a.replace(",", " ").lower().split())
        if isinstance(a, (set, frozenset, list, tuple)):
            return frozenset(str(x).strip().lower() for x in a)
        return frozenset({str(a).strip().lower()})

    if norm(answer) != norm(expected):
        raise AssertionError(f"not quite ({answer!r}). Why: {why}")
    print(f"Right. {why}")
