"""Test support: pretend to be one Ray Train worker, without starting Ray.

One job per file; every name is importable from ``coursekit.testing`` as before:

* ``simulated_worker``: a simulated Ray Train worker (``simulated_worker``, ``simulated_restart``,
  ``SimulatedReport``, ``RankReport``): ``ray.train.get_context()``, ``report()``, ``get_checkpoint()`` and
  ``ray.train.torch.get_device()`` answer as worker ``rank`` of ``world_size`` would, and every report is kept;
* ``concepts``: ``record_answer`` (a concept answer's form, then handed to the grader), ``answer_problem``,
  ``check_concept`` (the grader's check of the letters);
* ``memory_shards``: ``split_rows``, ``InMemoryShard``, ``simulated_dataset_shard``: a rank's part of
  in-memory columns behind ``ray.train.get_dataset_shard``;
* ``devices`` (imported from ``coursekit.testing.devices``): ``DeviceTracker``, ``tracking_devices``: where each tensor would live on a GPU worker, followed
  on a CPU (what would fail there: a collective on a CPU tensor, an operation mixing devices);
* ``shard_server``: ``ShardServer``, ``served_dataset_shards``: real Ray Data shards served over a local
  socket to ranks that run in other processes.
"""
from coursekit.testing.concepts import answer_problem, check_concept, record_answer
from coursekit.testing.memory_shards import InMemoryShard, simulated_dataset_shard, split_rows
from coursekit.testing.shard_server import NO_RAY_HERE, ShardServer, _NoRay, served_dataset_shards
from coursekit.testing.simulated_worker import RankReport, SimulatedReport, simulated_restart, simulated_worker

__all__ = ["NO_RAY_HERE", "InMemoryShard", "RankReport", "ShardServer", "SimulatedReport", "_NoRay",
           "answer_problem", "check_concept", "record_answer", "served_dataset_shards", "simulated_dataset_shard", "simulated_restart",
           "simulated_worker", "split_rows"]
