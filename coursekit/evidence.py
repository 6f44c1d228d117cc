"""What a graded test cell hands to the grader: plain data, judged outside your kernel.

The course's grader never trusts what a kernel says about itself (an error or its absence, a printed
"Success"): code that ran in a kernel can change what that kernel reports. A test cell therefore ends by
handing in the values it measured (``hand_in``): JSON data, shown as an output of a MIME type of its own that
JupyterLab does not draw. The grader reads that output from the graded notebook, in a process where no
notebook code ever ran, and applies the checks there (the visible ones you see in the notebook and the hidden
ones). Outside grading (``coursekit.runtime``'s ``grading``: nbgrader's autograde and Validate, ``COURSE_GRADING=1``)
nothing is handed in.
"""
from __future__ import annotations

import json
import math

from coursekit.runtime import is_grading

MIME = "application/vnd.ray-train-course.evidence+json"


def plain(value):
    """``value`` as JSON data: str, bool, int, float (finite, or the strings "nan"/"inf"/"-inf"), None, and lists
    and string-keyed dicts of them; sets become sorted lists, tuples lists, and anything else its ``repr``."""
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((plain(v) for v in value), key=repr)
    return repr(value)


def hand_in(grade_id: str, **data) -> None:
    """Hand this test cell's evidence (``data``, made plain) to the grader, when grading."""
    if not is_grading():
        return
    from IPython.display import display

    payload = json.loads(json.dumps({"grade_id": grade_id, "data": plain(data)}))
    display({MIME: payload, "text/plain": f"handed in to the grader: {grade_id}"}, raw=True)
