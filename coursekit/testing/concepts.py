"""Concept questions: the form of an answer (checked in the notebook and again by the grader) and the check of
the letters against the expected ones, with the reason (the grader's; the expected letters are not in the course)."""
from __future__ import annotations

from coursekit.evidence import hand_in

LETTERS = "abcd"


def letters(answer) -> frozenset:
    """The letters of an answer: a string ("a c", "a, c") or a set/list of letters, lower case."""
    if isinstance(answer, str):
        return frozenset(answer.replace(",", " ").lower().split())
    if isinstance(answer, (set, frozenset, list, tuple)):
        return frozenset(str(x).strip().lower() for x in answer)
    return frozenset({str(answer).strip().lower()})


def answer_problem(answer, several: bool) -> str | None:
    """What is wrong with the form of ``answer`` (None if nothing): a string of letters from a to d (or a list or
    set of them), exactly one unless ``several``. The notebook's visible check and the grader both call this."""
    example = 'e.g. "b" or "a d"' if several else 'e.g. "b"'
    want = "letters from a to d, separated by spaces" if several else "one letter: a, b, c or d"
    listed = isinstance(answer, (list, tuple, set, frozenset)) and all(isinstance(x, str) for x in answer)
    if not (isinstance(answer, str) or listed) or not letters(answer):
        return f"answer with {want}, in a string ({example}); got {answer!r}"
    given = letters(answer)
    if not given <= set(LETTERS) or (not several and len(given) != 1):
        return f"answer with {want} ({example}); got {answer!r}"
    return None


def record_answer(grade_id: str, answer, several: bool = False) -> None:
    """The visible check of a concept question: the answer's form; then the answer is handed to the grader,
    which checks the letters."""
    problem = answer_problem(answer, several)
    assert problem is None, problem
    print(f"answer recorded: {answer!r} (the grader checks it)")
    hand_in(grade_id, answer=answer)


def check_concept(answer, expected, why: str) -> None:
    """Grade a concept question: ``answer`` (a letter, or a set/list of letters) against ``expected``.

    A wrong answer fails with the expected answer's explanation; a right one prints it."""
    if letters(answer) != letters(expected):
        raise AssertionError(f"not quite ({answer!r}). Why: {why}")
    print(f"Right. {why}")
