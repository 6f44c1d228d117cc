"""Module 04 outside the notebook: a run whose worker is SIGKILLed mid-training completes, with no
epoch lost or repeated and the checkpoint files intact; bad options get a clear error."""
import json
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import PY, REPO

SCRIPT_DIR = REPO / "solutions" / "04_fault_tolerance"


@pytest.mark.slow
def test_killed_worker_run_completes_without_losing_or_repeating_an_epoch(tmp_path):
    out = tmp_path / "metrics.json"
    proc = subprocess.run([PY, "train_fault_tolerant.py", "--smoke-test", "--num-workers", "2",
                           "--name", "killed-worker", "--kill-at-epoch", "2", "--max-failures", "1",
                           "--metrics-out", str(out)], cwd=SCRIPT_DIR, capture_output=True, text=True,
                          timeout=600)
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
    for e, ckpt in enumerate(checkpoints):  # every checkpoint is complete and loadable
        state = torch.load(ckpt / "state.pt", map_location="cpu", weights_only=True)
        assert set(state) == {"model", "optimizer", "epoch", "rng"} and state["epoch"] == e
        assert state["optimizer"]["state"], "the optimizer state is saved"
    assert (run / "fault_markers" / "kill.done").exists()


@pytest.mark.parametrize("args, message", [
    (["--kill-at-epoch", "9"], "--kill-at-epoch 9 is not one of the run's epochs 0..3"),
    (["--num-workers", "16"], "16 workers x 1 CPU each = 16 CPUs, but this cluster has"),
])
def test_bad_options_are_refused_with_a_clear_message(args, message):
    proc = subprocess.run([PY, "train_fault_tolerant.py", "--smoke-test", *args], cwd=SCRIPT_DIR,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]
