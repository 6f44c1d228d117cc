"""While a deliberate failure runs: the fault, Ray Train's retry decisions and the workers' progress, not
the walls of tracebacks."""
from __future__ import annotations

import re
from contextlib import contextmanager

from coursekit.runtime import settings

# What a student needs to see while a run fails and recovers; the rest is Ray's internals
# (actor ids, worker metadata, tracebacks of the *other* ranks' broken connections).
_FAILURE_KEEP = re.compile(
    r"\[fault\]|\[driver\]|\[FailurePolicy\]|Error count:|Source: |Rank \d+ Error Snippet"
    r"|InjectedFailure:|health check failed|resuming from|epoch \d+ loss")


@contextmanager
def quiet_failure_logs():
    """While a deliberate failure runs, show the fault, Ray Train's retry decisions and the
    workers' own progress lines, not the walls of tracebacks. COURSE_RAY_VERBOSE=1 shows all."""
    if settings().ray_verbose:
        yield
        return
    from coursekit.raysetup import restore_log_printer, set_log_printer

    try:
        previous = set_log_printer(lambda data: [ln for ln in data.get("lines", []) if _FAILURE_KEEP.search(ln)])
    except Exception:  # another Ray: show everything rather than fail
        yield
        return
    try:
        yield
    finally:
        restore_log_printer(previous)
