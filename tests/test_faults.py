"""coursekit.faults: fault plans fire once, markers record the time, simulated restarts see a checkpoint."""
import json
import os
import subprocess
import sys
import tempfile
import time

import pytest

from coursekit.faults import (InjectedFailure, check_plan, fired, inject_faults, registered_epochs,
                              seconds_since, simulated_restart)


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
