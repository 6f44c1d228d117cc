"""coursekit: the plumbing of the course (runtime, data, models, widgets, Ray set-up).

Teaching code (process groups, training loops, Ray Train calls) lives in the
notebooks and scripts; this package only holds what every module needs and
nobody should have to read twice."""
from coursekit.runtime import Runtime, detect

__all__ = ["Runtime", "detect"]
