"""coursekit.faults: fault plans fire once, markers record the time, simulated restarts see a checkpoint."""
import ast
import json
import os
import subprocess
import sys
import tempfile
import time

import pytest

from coursekit.faults import InjectedFailure, check_plan, fired, inject_faults, registered_epochs, seconds_since
from coursekit.paths import REPO
from coursekit.testing import simulated_restart


def test_the_names_notebooks_and_scripts_import_from_coursekit_faults_are_there():
    """coursekit.faults is a package of one-job files; its old import path still gives every public name."""
    import coursekit.faults as faults

    for name in ("FaultToleranceControls", "RankReport", "bucket_checkpoint", "checkpoints_ray_keeps", "fired",
                 "inject_faults", "quiet_failure_logs", "registered_epochs", "InjectedFailure", "check_plan",
                 "seconds_since", "wait_until_registered", "marker", "KINDS"):
        assert hasattr(faults, name), name
    assert set(faults.__all__) <= set(dir(faults))


def test_the_course_code_patches_nothing_outside_its_test_support():
    """unittest.mock replaces a function for everyone in the process: only coursekit.testing's stand-ins (the
    simulated worker and shards, which exist to stand in) and the exercises' check runs
    (coursekit/exercise_checks/*_runs.py, which run a student's function under those stand-ins, in forked ranks)
    may use it."""
    users = []
    for path in sorted((REPO / "coursekit").rglob("*.py")):
        if path.is_relative_to(REPO / "coursekit" / "testing"):
            continue
        if path.parent == REPO / "coursekit" / "exercise_checks" and path.stem.endswith("_runs"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n == "unittest" or n.startswith("unittest.") for n in names):
                users.append(str(path.relative_to(REPO)))
    assert not users, f"production code that imports unittest(.mock): {users}"


def test_plans_are_validated_with_clear_messages():
    assert check_plan(None) == {}
    with pytest.raises(ValueError, match="unknown fault 'explode'"):
        check_plan({"explode": {"epoch": 1, "rank": 0}})
    with pytest.raises(ValueError, match="needs an epoch and a rank"):
        check_plan({"kill": {"epoch": 1}})
    with pytest.raises(ValueError, match="marker_dir"):
        inject_faults({"raise": {"epoch": 0, "rank": 0}}, 0, 0, None)


def test_raise_fires_once_and_only_where_planned(tmp_path):
    plan = {"raise": {"epoch": 0, "rank": 1}}
    markers = tmp_path / "run" / "fault_markers"
    inject_faults(plan, 0, 0, markers)        # another rank: nothing
    inject_faults(plan, 1, 1, markers)        # another epoch: nothing
    assert fired(markers) == {}
    with pytest.raises(InjectedFailure, match="epoch 0 on rank 1"):
        inject_faults(plan, 0, 1, markers)
    assert set(fired(markers)) == {"raise"} and 0 <= seconds_since(markers, "raise") < 5
    inject_faults(plan, 0, 1, markers)        # the restarted group trains on


def test_kill_is_a_real_sigkill_and_fires_once(tmp_path):
    markers = tmp_path / "run" / "fault_markers"
    code = ("import sys; from coursekit.faults import inject_faults; "
            f"inject_faults({{'kill': {{'epoch': 0, 'rank': 0}}}}, 0, 0, {str(markers)!r}); print('survived')")
    first = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert first.returncode == -9 and "survived" not in first.stdout
    second = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert second.returncode == 0 and "survived" in second.stdout


def test_fault_waits_for_the_previous_checkpoint_to_be_registered(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    snap = run / "checkpoint_manager_snapshot.json"
    snap.write_text(json.dumps({"checkpoint_results": [{"metrics": {"epoch": 0}}]}))
    assert registered_epochs(run) == [0]
    start = time.monotonic()
    with pytest.raises(InjectedFailure):
        inject_faults({"raise": {"epoch": 1, "rank": 0}}, 1, 0, run / "fault_markers")
    assert time.monotonic() - start < 5


def test_simulated_restart_hands_out_the_checkpoint():
    import ray.train
    from ray.train import Checkpoint

    with tempfile.TemporaryDirectory() as d:
        ckpt = Checkpoint.from_directory(d)
        with simulated_restart(rank=1, world_size=2, checkpoint=ckpt) as reports:
            assert ray.train.get_checkpoint() is ckpt
            assert ray.train.get_context().get_world_rank() == 1
            ray.train.report({"epoch": 3})
        assert reports[0].metrics == {"epoch": 3}
    with simulated_restart(checkpoint=None):
        assert ray.train.get_checkpoint() is None


def test_a_bucket_checkpoint_is_read_through_as_directory_only():
    """coursekit.faults.bucket_checkpoint: a checkpoint on storage that is not a local folder. Its path names no local
    file (code that opens checkpoint.path fails, as on S3); as_directory() downloads it and cleans up after."""
    from coursekit.faults import bucket_checkpoint

    ckpt = bucket_checkpoint({"state.pt": b"weights", "shards/rng_rank_1.pt": b"rng"}, name="run/epoch_0003")
    assert ckpt.path == "course-bucket/run/epoch_0003" and not os.path.exists(ckpt.path)
    with pytest.raises(FileNotFoundError):
        open(os.path.join(ckpt.path, "state.pt"), "rb")
    with ckpt.as_directory() as d:
        assert open(os.path.join(d, "state.pt"), "rb").read() == b"weights"
        assert open(os.path.join(d, "shards", "rng_rank_1.pt"), "rb").read() == b"rng"
    assert not os.path.exists(d), "the downloaded copy is gone once the with block ends"


@pytest.mark.parametrize("metric, values", [
    ("loss", [0.9, 0.7, 0.5, 0.4, 0.3]),          # the latest is the best: the 2 best are all storage holds
    ("loss", [0.9, 0.5, 0.4, 0.6, 0.8]),          # the latest is worse than the 2 best: it is kept as well
    ("accuracy", [0.5, 0.8, 0.9, 0.7, 0.6]),      # the same with a higher-is-better score
    (None, [0.9, 0.5, 0.4, 0.6, 0.8]),            # no score: the 2 most recent, the latest among them
])
def test_the_fault_controls_say_what_ray_trains_checkpoint_manager_keeps(tmp_path, metric, values):
    """What the controls announce (the Result's rows, the folders left in storage) is what Ray Train 2.60's own
    CheckpointManager does with the same CheckpointConfig: the K best (or most recent), and the latest besides."""
    from ray.train import CheckpointConfig

    from coursekit.faults import FaultToleranceControls, checkpoints_ray_keeps

    controls = FaultToleranceControls(epochs=len(values), num_workers=2, keep=2, metric=metric)
    args = controls.run_config_args()
    config = CheckpointConfig(num_to_keep=args["keep"], checkpoint_score_attribute=args["metric"],
                              checkpoint_score_order=args["mode"])
    reports = [{"epoch": e, "loss": v, "accuracy": v} for e, v in enumerate(values)]
    ray = checkpoints_ray_keeps(reports, config, tmp_path, name=f"keep-{metric}")
    latest = len(values) - 1
    assert ray["latest"] == latest, f"a restart resumes from the latest checkpoint: {ray}"
    assert latest in ray["in_storage"], f"the latest checkpoint is never deleted: {ray}"
    assert len(ray["rows"]) == controls.expected()["kept"], (ray, controls.expected())
    low, high = controls.in_storage()
    assert low <= len(ray["in_storage"]) <= high, (ray, controls.in_storage())
    if metric is None:
        assert ray["in_storage"] == [latest - 1, latest] == ray["rows"]
    else:
        sign = 1 if args["mode"] == "max" else -1
        best = sorted(range(len(values)), key=lambda e: sign * values[e])[-2:]
        assert sorted(ray["rows"]) == sorted(best), f"the Result lists the 2 best by {metric}: {ray}"
        assert ray["in_storage"] == sorted(set(best) | {latest}), f"storage: the 2 best and the latest: {ray}"
