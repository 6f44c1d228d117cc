"""Where the course's folders are: the one definition of the repository's root.

``REPO`` is the folder that holds ``coursekit/`` (this repository, or a student's copy of the release:
``course/``, ``coursekit/``, ``deploy/``, ...). The autograder, the bench, ``deploy/up.py`` and the tests use
this one (``autograder.paths.REPO`` is the same object); none computes it from its own ``__file__``.
"""
from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
