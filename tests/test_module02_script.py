"""train_ray_ddp.py: a real 2-worker Ray Train run with --smoke-test, the same run in Binder mode (Ray Train's local
mode) inside Binder's memory limit, and a clear error for impossible scale."""
import json
import subprocess

import pytest

from binder_mode import run_in_binder_mode
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


@pytest.mark.slow
def test_smoke_run_in_binder_mode_fits_binders_memory(tmp_path):
    """On Binder the script runs Ray Train's local mode (2 ranks forked from the driver, no Ray), inside the memory
    limit the notebook test holds module 02 to (one process imports torch: the ranks are its forks)."""
    out = tmp_path / "metrics.json"
    run = run_in_binder_mode("train_ray_ddp.py", ["--metrics-out", str(out)], SCRIPT_DIR, tmp_path / "storage")
    assert "Ray Train local mode: 2 forked rank(s)" in run.output and "Started a local Ray" not in run.output
    m = json.loads(out.read_text())
    assert m["num_workers"] == 2 and len(m["losses"]) == 2 and len(m["worker_node_ids"]) == 2
    assert m["losses"][-1] < m["losses"][0] and m["test_accuracy"] > 0.5


@pytest.mark.parametrize("args, message", [
    (["--num-workers", "16"], "16 workers x 1 CPU each = 16 CPUs, but this cluster has"),
    (["--use-gpu"], "no GPUs"),
])
def test_impossible_scaling_is_refused_with_a_clear_message(args, message, script, capsys):
    # the script's main() in this process: it refuses before it starts Ray (a new python would import torch and Ray)
    assert script.main(["--smoke-test", *args]) == 2
    err = capsys.readouterr().err
    assert message in err, err[-2000:]


EXERCISES = ("train_func", "scaling_config_for", "build_trainer", "load_model")


def test_the_released_script_stubs_every_exercise_of_the_notebook():
    """course/'s copy of the script raises NotImplementedError in each function the notebook asks for (a student
    copies the answers in), and the notebook's exercises are exactly those functions."""
    import ast

    import nbformat

    module = "02_ray_train"
    nb = nbformat.read(REPO / "solutions" / module / f"{module}.ipynb", as_version=4)
    exercises = {c.metadata["nbgrader"]["grade_id"] for c in nb.cells
                 if c.metadata.get("nbgrader", {}).get("solution") and "CONCEPT_" not in c.source}
    assert exercises == set(EXERCISES), exercises
    released = ast.parse((REPO / "course" / module / "train_ray_ddp.py").read_text())
    functions = {f.name: f for f in released.body if isinstance(f, ast.FunctionDef)}
    for name in EXERCISES:
        last = functions[name].body[-1]
        assert isinstance(last, ast.Raise) and "NotImplementedError" in ast.unparse(last), (
            f"course/{module}/train_ray_ddp.py: {name} should end with raise NotImplementedError(), not "
            f"{ast.unparse(last)!r}")


@pytest.fixture(scope="module")
def script():
    """The reference script (solutions/), imported as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_ray_ddp_reference", SCRIPT_DIR / "train_ray_ddp.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_load_model_reads_a_checkpoint_in_storage_that_is_not_a_local_folder(script, tmp_path, monkeypatch):
    """The script's load_model on what a cluster gives it: a checkpoint in a bucket-like filesystem (a pyarrow
    SubTreeFileSystem and an fsspec in-memory one, where ``checkpoint.path`` is no local folder) and a model.pt
    written on a GPU worker (tensors marked cuda:0), on a machine without a GPU."""
    import io
    import uuid
    from unittest import mock

    import pyarrow.fs
    import torch
    from fsspec.implementations.memory import MemoryFileSystem
    from ray.train import Checkpoint

    from coursekit.models import build_model

    torch.manual_seed(0)
    state = build_model("small_cnn").state_dict()
    buffer = io.BytesIO()
    with mock.patch("torch.serialization.location_tag", lambda storage: "cuda:0"):   # as a GPU worker saves it
        torch.save(state, buffer)
    monkeypatch.chdir(tmp_path)   # a relative checkpoint.path must not exist here by chance
    in_memory = pyarrow.fs.PyFileSystem(pyarrow.fs.FSSpecHandler(MemoryFileSystem()))
    for filesystem, folder in [(pyarrow.fs.SubTreeFileSystem(str(tmp_path / "bucket"), pyarrow.fs.LocalFileSystem()),
                                "runs/nightly/checkpoint_000001"),
                               (in_memory, f"/runs/{uuid.uuid4().hex}/checkpoint_000002")]:
        filesystem.create_dir(folder)
        with filesystem.open_output_stream(f"{folder}/model.pt") as f:
            f.write(buffer.getvalue())
        with mock.patch("torch.cuda.is_available", lambda: False):
            model = script.load_model(Checkpoint(path=folder, filesystem=filesystem), "small_cnn")
        assert type(model) is torch.nn.Sequential and not model.training
        assert all(torch.equal(model.state_dict()[k], v) and model.state_dict()[k].device.type == "cpu"
                   for k, v in state.items())


def test_build_trainer_hands_a_storage_uri_on_as_it_is(script):
    """s3:// and gs:// storage reaches RunConfig unchanged (pathlib or abspath would make it a local folder)."""
    from ray.train import ScalingConfig

    for uri in ("s3://course-bucket/runs", "gs://course-bucket/ray-train-course"):
        trainer = script.build_trainer(lambda config: None, ScalingConfig(num_workers=2), uri, "run", {},
                                       num_to_keep=1, score_attribute="loss", score_order="min")
        assert (trainer.run_config.storage_path, trainer.run_config.name) == (uri, "run")


_METRICS_ROWS_RUN = r'''
import json, sys, tempfile
import ray
from ray.train import Checkpoint, CheckpointConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

VAL_LOSS = {4: 0.50, 9: 0.30, 14: 0.35, 19: 0.40}   # question 4's checkpoints


def train_func(config):
    import os
    import ray.train

    for epoch in range(20):
        metrics = {"epoch": epoch, "val_loss": VAL_LOSS.get(epoch, 1.0)}
        if epoch in VAL_LOSS:
            with tempfile.TemporaryDirectory() as d:
                open(os.path.join(d, "x"), "w").write(str(epoch))
                ray.train.report(metrics, checkpoint=Checkpoint.from_directory(d))
        else:
            ray.train.report(metrics)


ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
result = TorchTrainer(train_func, scaling_config=ScalingConfig(num_workers=1),
                      run_config=RunConfig(storage_path=sys.argv[1], name="rows",
                                           checkpoint_config=CheckpointConfig(
                                               num_to_keep=2, checkpoint_score_attribute="val_loss",
                                               checkpoint_score_order="min"))).fit()
print("ROWS", json.dumps(sorted(int(e) for e in result.metrics_dataframe["epoch"])))
'''


def test_question_4s_key_is_the_rows_a_real_ray_train_run_leaves_in_metrics_dataframe(tmp_path):
    """02 question 4: a real TorchTrainer run with the question's checkpoints and CheckpointConfig; the key's option
    must name exactly the epochs of ``result.metrics_dataframe``'s rows (Ray 2.60: the num_to_keep best only)."""
    import re

    import nbformat

    from autograder.checks.concepts import KEYS

    import os

    from coursekit.raysetup import RAY_ENV   # the course's Ray settings: a 0.1 s health check ends fit() sooner

    proc = subprocess.run([PY, "-c", _METRICS_ROWS_RUN, str(tmp_path)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **RAY_ENV})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = json.loads(proc.stdout.split("ROWS", 1)[1].strip().splitlines()[0])
    letter = KEYS["02_ray_train"]["test_concept_metrics_rows"][0]
    nb = nbformat.read(SCRIPT_DIR / "02_ray_train.ipynb", as_version=4)
    text = next(c.source for c in nb.cells if c.cell_type == "markdown" and "CONCEPT_METRICS_ROWS" in c.source)
    option = re.search(rf"^- \*\*{letter}\*\* (.*)$", text, re.M).group(1)
    named = sorted(int(n) for n in re.findall(r"\d+", option.split(":")[0]))
    assert named == rows, f"the key's option {letter} ({option!r}) names epochs {named}; Ray Train's rows: {rows}"
