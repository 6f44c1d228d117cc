"""Every private piece of Ray the course uses, in one place, checked against the Ray it was written for.

Ray's public API does not cover everything the course does: Binder's Ray Train local mode on forked ranks
(``coursekit.localmode``) is built from Ray Train's own storage, checkpoint manager and local controller; the
exercise tests stand in for a Ray Train worker (``coursekit.testing``); the elastic demonstration drains a node
as a preemption (``coursekit.elastic``); ``deploy/up.py`` checks a cluster config as ``ray up`` does. Those
pieces are private: a Ray release may move, rename or change them without notice.

So no other file imports them: it asks this module (``from coursekit.ray_internals import StorageContext``),
which first checks that the installed Ray is :data:`RAY_VERSION`, the one the course was written and tested
against, and raises :class:`RayVersionError` saying what to do when it is not. ``tests/test_ray_internals.py``
imports every name of :data:`SYMBOLS` and checks every member of :data:`MEMBERS` (the private methods the
course overrides or calls and the attributes it sets): after a Ray upgrade that test fails first, in one place,
naming what moved, before any notebook runs. The private attributes that notebooks' hidden tests read on
Ray's objects (a Tuner's scheduler, ASHA's rungs, a DataConfig's options) are listed there too.

The names are looked up when first used (importing Ray Train's internals takes seconds), so importing this
module costs only the version check.
"""
from __future__ import annotations

import importlib
from typing import Any

RAY_VERSION = "2.60.0"   # the Ray the course's internals were written against (requirements.txt pins it)

# name here -> "module" (the module itself) or "module:attribute"
SYMBOLS: dict[str, str] = {
    # Ray Train V2's run storage, checkpoint bookkeeping and local mode (coursekit.localmode, coursekit.faults)
    "StorageContext": "ray.train.v2._internal.execution.storage:StorageContext",
    "CheckpointManager": "ray.train.v2._internal.execution.checkpoint.checkpoint_manager:CheckpointManager",
    "TrainingReport": "ray.train.v2._internal.execution.training_report:_TrainingReport",
    "LocalTorchController": "ray.train.v2._internal.execution.local_mode.torch:LocalTorchController",
    "LocalTrainFnUtils": "ray.train.v2._internal.execution.train_fn_utils:LocalTrainFnUtils",
    "TrainFnUtils": "ray.train.v2._internal.execution.train_fn_utils:TrainFnUtils",
    "get_train_fn_utils": "ray.train.v2._internal.execution.train_fn_utils:get_train_fn_utils",
    "set_train_fn_utils": "ray.train.v2._internal.execution.train_fn_utils:set_train_fn_utils",
    # what ray.train.report checks in its metrics (coursekit.testing's simulated worker does the same)
    "contains_tensor": "ray.air._internal.torch_utils:contains_tensor",
    # modules whose attributes the simulated worker replaces (coursekit.testing)
    "train_loop_utils": "ray.train.v2.torch.train_loop_utils",
    "ray_worker": "ray._private.worker",
    "internal_kv": "ray.experimental.internal_kv",
    # the driver's printer of the workers' log lines (coursekit.raysetup)
    "print_to_stdstream": "ray._private.worker:print_to_stdstream",
    "should_ignore_worker_log_prefix": "ray._private.worker:_should_ignore_worker_log_prefix",
    # joining a cluster started with `ray start` and a token (coursekit.raysetup)
    "maybe_enable_token_auth_if_token_available":
        "ray._private.authentication.authentication_token_setup:maybe_enable_token_auth_if_token_available",
    # the autoscaler's limits (coursekit.scaling)
    "cluster_state": "ray._private.state:state",
    # nodes that come and go on one machine (coursekit.elastic)
    "Cluster": "ray.cluster_utils:Cluster",
    "services": "ray._private.services",
    "InnerGcsClient": "ray._raylet:InnerGcsClient",
    "autoscaler_pb2": "ray.core.generated.autoscaler_pb2",
    # public classes whose private members the course overrides or calls (MEMBERS)
    "Result": "ray.train:Result",
    "TorchTrainer": "ray.train.torch:TorchTrainer",
    # public classes whose private members notebooks' hidden tests read (MEMBERS, INSTANCE_ATTRIBUTES)
    "DataConfig": "ray.train:DataConfig",
    "Tuner": "ray.tune:Tuner",
    "ASHAScheduler": "ray.tune.schedulers:ASHAScheduler",
    # what `ray up` checks a cluster config with (deploy/up.py)
    "prepare_config": "ray.autoscaler._private.util:prepare_config",
    "validate_config": "ray.autoscaler._private.util:validate_config",
    # Ray Train's names for the settings coursekit.raysetup hands it through the environment (ENV_SETTINGS)
    "train_constants": "ray.train.v2._internal.constants",
}

# Environment variables coursekit.raysetup sets for Ray Train (its RAY_ENV), each with the attribute of
# train_constants that holds its name. Ray reads a variable it no longer knows as unset, silently; the test checks
# that each is still Ray Train's name, and that fit() still hands it on to its controller and workers.
ENV_SETTINGS: dict[str, str] = {
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "HEALTH_CHECK_INTERVAL_S_ENV_VAR",
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "ENABLE_PREEMPTION_WATCHER_ENV_VAR",
    "RAY_TRAIN_ENABLE_PRINT_PATCH": "ENABLE_PRINT_PATCH_ENV_VAR",
    "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "WORKER_GROUP_START_TIMEOUT_S_ENV_VAR",
}

# (name in SYMBOLS, dotted attribute, who uses it): private members the course overrides, calls or sets. A subclass that
# overrides a method Ray renamed would silently stop being called; the test checks each one still exists.
MEMBERS: list[tuple[str, str, str]] = [
    ("TorchTrainer", "_get_local_controller", "overridden by coursekit.localmode (its own controller)"),
    ("Result", "_from_checkpoint_manager", "called by coursekit.localmode (result_from_checkpoint_manager)"),
    ("LocalTorchController", "_set_train_fn_utils", "overridden by coursekit.localmode (reports persisted)"),
    ("LocalTrainFnUtils", "report", "overridden by coursekit.localmode"),
    ("TrainFnUtils", "report", "wrapped by coursekit.elastic.reporting_world_size"),
    ("StorageContext", "persist_current_checkpoint", "called by coursekit.localmode and coursekit.faults"),
    ("StorageContext", "build_checkpoint_path_from_name", "called by coursekit.localmode"),
    ("StorageContext", "make_default_checkpoint_dir_name", "called by coursekit.localmode"),
    ("StorageContext", "experiment_fs_path", "read by coursekit.faults"),
    ("CheckpointManager", "register_checkpoint", "called by coursekit.localmode and coursekit.faults"),
    ("CheckpointManager", "latest_checkpoint_result", "read by coursekit.localmode and coursekit.faults"),
    ("CheckpointManager", "best_checkpoint_results", "read by coursekit.faults"),
    ("CheckpointManager", "_save_state_and_delete_old_checkpoints",
     "what module 04 teaches about num_to_keep (coursekit.faults.controls)"),
    ("train_loop_utils", "record_extra_usage_tag", "replaced by coursekit.testing's simulated worker"),
    ("ray_worker", "global_worker.check_connected", "replaced by coursekit.testing.served_dataset_shards"),
    ("ray_worker", "global_worker_stdstream_dispatcher.add_handler", "used by coursekit.raysetup"),
    ("ray_worker", "global_worker_stdstream_dispatcher.remove_handler", "used by coursekit.raysetup"),
    ("internal_kv", "global_gcs_client", "replaced by coursekit.testing.served_dataset_shards"),
    ("internal_kv", "_internal_kv_reset", "called by coursekit.elastic"),
    ("services", "wait_for_node", "called by coursekit.elastic"),
    ("services", "find_gcs_addresses.cache_clear", "called by coursekit.elastic"),
    ("InnerGcsClient", "drain_node", "called by coursekit.elastic (through the driver's gcs_client)"),
    ("cluster_state", "get_max_resources_from_cluster_config", "called by coursekit.scaling"),
    ("DataConfig", "_get_user_execution_options", "called by module 03's hidden tests"),
]

# (name in SYMBOLS, keyword arguments that make an instance, dotted attribute (a number: an item of a list), who
# uses it): attributes that only an instance has, which the course sets or reads.
_ASHA = {"metric": "loss", "mode": "min", "max_t": 4, "grace_period": 1}
INSTANCE_ATTRIBUTES: list[tuple[str, dict, str, str]] = [
    ("LocalTrainFnUtils", {"experiment_name": "ray-internals-check"}, "_last_checkpoint",
     "set by coursekit.localmode: what ray.train.get_checkpoint() returns"),
    ("Tuner", {"trainable": lambda config: None}, "_local_tuner._tune_config.scheduler",
     "read by module 04's hidden tests"),
    ("ASHAScheduler", _ASHA, "_brackets.0._rungs", "read by module 04's hidden tests"),
    ("ASHAScheduler", _ASHA, "_max_t", "read by module 04's hidden tests"),
    ("ASHAScheduler", _ASHA, "_reduction_factor", "read by module 04's hidden tests"),
    ("ASHAScheduler", _ASHA, "_time_attr", "read by module 04's hidden tests"),
]


class RayVersionError(ImportError):
    """The installed Ray is not the one the course's use of Ray internals was written for."""


def installed_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ray")
    except PackageNotFoundError:
        return "not installed"


def version_problem(installed: str | None = None) -> str | None:
    """None when the installed Ray is :data:`RAY_VERSION`, else what is wrong and what to do."""
    installed = installed_version() if installed is None else installed
    if installed == RAY_VERSION:
        return None
    import sys

    return (f"coursekit uses private parts of Ray (coursekit/ray_internals.py) written for Ray {RAY_VERSION}, "
            f"and this Python ({sys.executable}) has Ray {installed}. To run the course, install the pinned "
            f"version into it: `{sys.executable} -m pip install -r requirements.txt` (ray=={RAY_VERSION}). To move "
            f"the course to Ray {installed}: set RAY_VERSION in coursekit/ray_internals.py and the pin in "
            "requirements.txt, then run `pytest tests/test_ray_internals.py`, which names every private piece "
            "that moved.")


def check_version() -> None:
    """Raise :class:`RayVersionError` unless the installed Ray is :data:`RAY_VERSION`."""
    problem = version_problem()
    if problem:
        raise RayVersionError(problem)


def resolve(name: str) -> Any:
    """The object :data:`SYMBOLS` names ``name`` (imported now)."""
    module_name, _, attribute = SYMBOLS[name].partition(":")
    module = importlib.import_module(module_name)
    return getattr(module, attribute) if attribute else module


def member(name: str, path: str) -> Any:
    """``SYMBOLS[name]`` followed by the dotted attribute ``path``: AttributeError when Ray has no such member."""
    obj = resolve(name)
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def missing() -> list[str]:
    """Every name of :data:`SYMBOLS`, member of :data:`MEMBERS` and attribute of :data:`INSTANCE_ATTRIBUTES` that
    this Ray does not have, each with who uses it; [] when all are there. (Imports Ray Train: seconds.)"""
    problems = []
    for name, spec in SYMBOLS.items():
        try:
            resolve(name)
        except Exception as e:  # noqa: BLE001  reported, with the reason
            problems.append(f"{name} = {spec}: {type(e).__name__}: {e}")
    for name, path, who in MEMBERS:
        try:
            member(name, path)
        except Exception as e:  # noqa: BLE001
            problems.append(f"{name}.{path} ({who}): {type(e).__name__}: {e}")
    for name, kwargs, path, who in INSTANCE_ATTRIBUTES:
        try:
            obj = resolve(name)(**kwargs)
            for part in path.split("."):
                obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
        except Exception as e:  # noqa: BLE001
            problems.append(f"{name}(...).{path} ({who}): {type(e).__name__}: {e}")
    return problems


def __getattr__(name: str) -> Any:   # `from coursekit.ray_internals import StorageContext`
    if name in SYMBOLS:
        value = resolve(name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# -- private calls, wrapped where the course makes them ---------------------------------------------------

def result_from_checkpoint_manager(manager, storage):
    """The ``ray.train.Result`` of a run, built as Ray Train's controller builds it."""
    from ray.train import Result

    return Result._from_checkpoint_manager(checkpoint_manager=manager, storage_context=storage)


def drain_node_as_preemption(node_id: str, message: str, deadline_ms: int) -> tuple[bool, str]:
    """Ask the GCS to drain a node as a preemption (``ray drain-node --reason=DRAIN_NODE_REASON_PREEMPTION``).
    Returns (accepted, why not)."""
    reason = resolve("autoscaler_pb2").DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION")
    gcs = resolve("ray_worker").global_worker.gcs_client
    return gcs.drain_node(node_id, reason, message, deadline_ms)


def forget_cluster() -> None:
    """Forget the cluster this process was connected to (its GCS client and cached address), so that a later
    ``ray.init()`` starts or finds a new one."""
    resolve("internal_kv")._internal_kv_reset()
    resolve("services").find_gcs_addresses.cache_clear()


check_version()

if __name__ == "__main__":   # python -m coursekit.ray_internals: is every private piece still there?
    import sys

    gone = missing()
    print("\n".join(gone) if gone else f"Ray {RAY_VERSION}: all {len(SYMBOLS)} names and "
          f"{len(MEMBERS) + len(INSTANCE_ATTRIBUTES)} members the course uses are there")
    sys.exit(1 if gone else 0)
