"""The course's performance harness: ``python -m bench`` (``make bench``).

Measures, in one run, the course's performance targets and writes ``results.json`` and ``RESULTS.md``
(machine, versions, date, git commit; each figure next to its target with the ratio):

1. ``notebooks``   every solution notebook in Binder/CPU mode: wall time and peak PSS of the whole tree
2. ``fit_cost``    the fixed cost of one Ray Train ``fit()`` (2 CPU workers) against ``torchrun``
3. ``throughput``  steady-state samples/s of module 02's model, Ray Train DDP against torchrun DDP
4. ``data``        Ray Data against a DataLoader on module 03's preprocessing
5. ``grading``     seconds per submission per module (``autograder.benchmark``)
6. ``memory``      per-rank model-state memory of DDP, FSDP2 and ZeRO 1-3 against ``coursekit.planner.predict``

``--short`` runs the same code paths with the smallest settings (CI): for ``notebooks``, a two-cell
notebook instead of the course's (tests/test_notebooks.py runs those). Every measurement that
starts Ray or torchrun runs in its own subprocess (``python -m bench.jobs SECTION``), so Ray
always stops with it; a failing section is recorded with its error and the run goes on.
"""
