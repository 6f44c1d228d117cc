"""train_ray_ddp.py: a real 2-worker Ray Train run with --smoke-test, and a clear error for impossible scale."""
import json
import subprocess

import pytest

from helpers import PY, REPO

SCRIPT_DIR = REPO / "solutions" / "02_ray_train"


@pytest.mark.slow
def test_smoke_run_learns_and_checkpoints(tmp_path):
    out = tmp_path / "metrics.json"
    proc = subprocess.run([PY, "train_ray_ddp.py", "--smoke-test", "--num-workers", "2",
                           "--metrics-out", str(out)], cwd=SCRIPT_DIR, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    m = json.loads(out.read_text())
    assert m["num_workers"] == 2 and len(m["losses"]) == 2
    assert m["losses"][-1] < m["losses"][0] and m["test_accuracy"] > 0.5
    # Ray's internal status lines are filtered from what the user sees
    assert "Failed to query Ray Train Controller" not in proc.stdout + proc.stderr
    assert "Reporting training result" not in proc.stdout + proc.stderr


@pytest.mark.parametrize("args, message", [
    (["--num-workers", "16"], "16 workers x 1 CPU each = 16 CPUs, but this cluster has"),
    (["--use-gpu"], "no GPUs"),
])
def test_impossible_scaling_is_refused_with_a_clear_message(args, message):
    proc = subprocess.run([PY, "train_ray_ddp.py", "--smoke-test", *args], cwd=SCRIPT_DIR,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]
