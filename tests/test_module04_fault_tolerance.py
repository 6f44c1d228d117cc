"""Module 04 outside the notebook.

* The student's copy of ``train_fault_tolerant.py`` (its checkpoint functions are exercise stubs) runs with
  ``--answers``, the file the notebook writes from the exercise cells: a run whose worker is SIGKILLed
  mid-training completes, with no epoch lost or repeated and every rank's share of each checkpoint intact.
* Without answers the student's copy refuses at once, with a message saying what to do.
* The instructor's copy keeps its own complete functions: an interrupted run on 2 nodes x 2 real gloo
  ranks ends with the uninterrupted run's weights.
* In Binder mode (Ray Train's local mode: forked ranks, no Ray) the instructor's script survives a killed rank
  inside the memory limit the notebook test holds module 04 to.
* Bad options get a clear error.
"""
import importlib.util
import io
import json
import logging
import os
import subprocess
import tempfile
from pathlib import Path
from unittest import mock

import pytest
import torch

from binder_mode import run_in_binder_mode
from helpers import PY, REPO

MODULE = "04_fault_tolerance"
SCRIPT_DIR = REPO / "solutions" / MODULE
RELEASED_DIR = REPO / "course" / MODULE


def notebook_answers(tmp_path: Path) -> Path:
    """What the notebook writes for --answers: its checkpoint and run-configuration exercise cells (here the
    reference's)."""
    from autograder.samples import solution_answers

    answers = solution_answers(MODULE)
    path = tmp_path / "my_answers.py"
    path.write_text("\n\n".join(answers[g] for g in ("training_state", "resume", "make_run_config")) + "\n")
    return path


@pytest.mark.slow
def test_released_script_with_the_notebook_answers_survives_a_killed_worker(tmp_path):
    out = tmp_path / "metrics.json"
    proc = subprocess.run([PY, "train_fault_tolerant.py", "--smoke-test", "--num-workers", "2",
                           "--name", "killed-worker", "--kill-at-epoch", "2", "--max-failures", "1",
                           "--answers", str(notebook_answers(tmp_path)), "--metrics-out", str(out)],
                          cwd=RELEASED_DIR, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    m = json.loads(out.read_text())
    assert "SIGKILL to my own process" in proc.stdout + proc.stderr   # the kill really happened
    assert m["epochs"] == [0, 1, 2, 3], "every epoch exactly once in the final metrics"
    assert m["started_at_epoch"] == [0, 0, 2, 2], "the new worker group started after the last checkpoint"
    assert m["recovery_s"][2] > 0
    assert m["losses"][-1] < m["losses"][0] and m["test_accuracy"] > 0.5
    run = Path(m["path"])
    checkpoints = sorted(p for p in run.iterdir() if p.name.startswith("epoch_"))
    assert [p.name for p in checkpoints] == [f"epoch_{e:04d}" for e in range(4)]
    for e, ckpt in enumerate(checkpoints):  # every checkpoint is complete: rank 0's state and both RNGs
        assert sorted(p.name for p in ckpt.iterdir()) == ["rng_rank_0.pt", "rng_rank_1.pt", "state.pt"]
        state = torch.load(ckpt / "state.pt", map_location="cpu", weights_only=True)
        assert set(state) == {"model", "optimizer", "epoch"} and state["epoch"] == e
        assert state["optimizer"]["state"], "the optimizer state is saved"
        rngs = [torch.load(ckpt / f"rng_rank_{r}.pt", weights_only=True) for r in (0, 1)]
        assert not torch.equal(*rngs), "each rank saved its own random stream"
    assert (run / "fault_markers" / "kill.done").exists()


@pytest.mark.slow
def test_instructor_script_in_binder_mode_survives_a_killed_rank_within_binders_memory(tmp_path):
    """On Binder the script runs Ray Train's local mode: 2 ranks forked from the driver, no Ray. A rank SIGKILLed at
    epoch 2 costs one of FailureConfig's failures; the ranks start again from epoch 1's checkpoint. All of it inside
    the memory limit the notebook test holds module 04 to (one process imports torch: the ranks are its forks)."""
    out = tmp_path / "metrics.json"
    run = run_in_binder_mode("train_fault_tolerant.py", ["--name", "binder", "--kill-at-epoch", "2",
                                                         "--max-failures", "1", "--metrics-out", str(out)],
                             SCRIPT_DIR, tmp_path / "storage")
    assert "Ray Train local mode: 2 forked rank(s)" in run.output and "Started a local Ray" not in run.output
    assert "SIGKILL to my own process" in run.output and "failure 1 of 1 allowed" in run.output
    m = json.loads(out.read_text())
    assert m["epochs"] == [0, 1, 2, 3] and m["started_at_epoch"] == [0, 0, 2, 2], m
    assert m["losses"][-1] < m["losses"][0] and m["test_accuracy"] > 0.5


def test_released_script_without_answers_says_what_to_do(capsys):
    assert "raise NotImplementedError()" in (RELEASED_DIR / "train_fault_tolerant.py").read_text()
    # its main() in this process: it refuses before it starts anything (a new python would import torch and Ray)
    spec = importlib.util.spec_from_file_location("train_fault_tolerant_released",
                                                  RELEASED_DIR / "train_fault_tolerant.py")
    released = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(released)
    assert released.main(["--smoke-test"]) == 2
    err = capsys.readouterr().err
    assert "is still an exercise: pass --answers FILE" in err, err[-2000:]


_SCRIPT = []   # the instructor's script, imported once before the ranks fork


def _script():
    if _SCRIPT:
        return _SCRIPT[0]
    spec = importlib.util.spec_from_file_location("train_fault_tolerant", SCRIPT_DIR / "train_fault_tolerant.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    _SCRIPT.append(mod)
    return mod


def _ranks(rank, world_size, config, checkpoint_files):
    """The script's train_func as one rank of 2 nodes x 2 workers; a restart gets ``checkpoint_files``."""
    import ray.train
    from ray.train import Checkpoint

    from coursekit.testing import simulated_worker

    logging.getLogger("ray.train").setLevel(logging.WARNING)
    script = _script()
    with tempfile.TemporaryDirectory() as d:
        checkpoint = None
        if checkpoint_files:
            for name, content in checkpoint_files.items():
                Path(d, name).write_bytes(content)
            checkpoint = Checkpoint.from_directory(d)
        with simulated_worker(rank, world_size, int(os.environ["LOCAL_WORLD_SIZE"])) as reports, \
                mock.patch.object(ray.train, "get_checkpoint", lambda: checkpoint):
            script.train_func(config)
    return [(r.metrics["epoch"], r.files) for r in reports]


def test_instructor_script_resumes_to_the_uninterrupted_weights_on_two_nodes():
    from coursekit.distributed import run_distributed

    _script()
    config = dict(epochs=3, lr=5e-3, global_batch_size=32, train_samples=128, test_samples=32, seed=0)
    straight = run_distributed(_ranks, 4, config, None, local_world_size=2)
    first = run_distributed(_ranks, 4, dict(config, epochs=1), None, local_world_size=2)
    merged = {}
    for reports in first:
        merged.update(reports[-1][1] or {})
    assert sorted(merged) == ["rng_rank_0.pt", "rng_rank_1.pt", "rng_rank_2.pt", "rng_rank_3.pt", "state.pt"]
    rest = run_distributed(_ranks, 4, config, merged, local_world_size=2)
    assert [e for e, _ in rest[0]] == [1, 2]

    def weights(reports):
        return torch.load(io.BytesIO(reports[0][-1][1]["state.pt"]), weights_only=True)["model"]

    a, b = weights(straight), weights(rest)
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5


@pytest.mark.parametrize("args, message", [
    (["--kill-at-epoch", "9"], "--kill-at-epoch 9 is not one of the run's epochs 0..3"),
    (["--num-workers", "16"], "16 workers x 1 CPU each = 16 CPUs, but this cluster has"),
])
def test_bad_options_are_refused_with_a_clear_message(args, message, capsys):
    # the script's main() in this process: it refuses before it starts Ray (a new python would import torch and Ray)
    assert _script().main(["--smoke-test", *args]) == 2
    err = capsys.readouterr().err
    assert message in err, err[-2000:]
