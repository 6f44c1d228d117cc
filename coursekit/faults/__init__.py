"""Failures on purpose, and what module 04 shows about surviving them. One job per file; every name is
importable from ``coursekit.faults`` as before:

* ``injection``: fault plans (``inject_faults``, ``check_plan``, ``fired``, ``seconds_since``, ``InjectedFailure``)
  and the controller's registered checkpoints (``registered_epochs``, ``wait_until_registered``);
* ``checkpoints``: ``bucket_checkpoint`` (a checkpoint on storage that is not a local folder),
  ``checkpoints_ray_keeps`` (what a ``CheckpointConfig`` keeps, decided by Ray Train itself) and
  ``shipped_checkpoint`` (a DCP checkpoint a module ships as data, unpacked);
* ``quiet_logs``: ``quiet_failure_logs``, the log filter while a failure runs;
* ``controls``: ``FaultToleranceControls``, the widget of the live run.

A simulated restarted worker (``simulated_restart``) and the record of a simulated rank's report
(``RankReport``) are test support: ``coursekit.testing`` (``RankReport`` is importable from here too).
"""
from coursekit.faults.checkpoints import bucket_checkpoint, checkpoints_ray_keeps, shipped_checkpoint
from coursekit.faults.controls import FaultToleranceControls
from coursekit.faults.injection import (KINDS, InjectedFailure, check_plan, fired, inject_faults, marker,
                                        registered_epochs, seconds_since, wait_until_registered)
from coursekit.faults.quiet_logs import quiet_failure_logs
from coursekit.testing.simulated_worker import RankReport

__all__ = ["KINDS", "FaultToleranceControls", "InjectedFailure", "RankReport", "bucket_checkpoint", "check_plan",
           "checkpoints_ray_keeps", "fired", "inject_faults", "marker", "quiet_failure_logs", "registered_epochs",
           "seconds_since", "shipped_checkpoint", "wait_until_registered"]
