"""Regenerate tune_fixture/: a small, real Ray Tune experiment folder for the graded ResultGrid exercise.

    python make_tune_fixture.py

Four trials report fixed per-epoch numbers (no training), shaped like a real search: one
learns slowly, one learns well (best final accuracy), one peaks early and then diverges
(best accuracy at *some* epoch, worst at the end), and one that an early-stopping scheduler
stopped after one epoch. The test loads it with
``ResultGrid(ExperimentAnalysis("tune_fixture"))``, without starting Ray.
"""
import shutil
from pathlib import Path

import ray
from ray import tune

CURVES = {  # lr -> accuracy per epoch
    0.001: [0.30, 0.45, 0.55],
    0.01: [0.60, 0.80, 0.86],
    0.1: [0.88, 0.70, 0.40],
    0.003: [0.50],
}
BATCH = {0.001: 32, 0.01: 64, 0.1: 32, 0.003: 64}


def trainable(config):
    for epoch, acc in enumerate(CURVES[config["lr"]]):
        tune.report({"epoch": epoch, "accuracy": acc, "loss": round(2.3 * (1 - acc), 4),
                     "checkpoint_path": f"train-run-lr={config['lr']}/epoch_{epoch:04d}"})


if __name__ == "__main__":
    here = Path(__file__).resolve().parent
    tmp = here / "_tune_tmp"
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
    tune.Tuner(trainable, param_space={"lr": tune.grid_search(list(CURVES)),
                                       "global_batch_size": tune.sample_from(lambda s: BATCH[s.config.lr])},
               run_config=tune.RunConfig(storage_path=str(tmp), name="exp", verbose=0)).fit()
    out = here / "tune_fixture"
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(tmp / "exp", out, ignore=shutil.ignore_patterns("events.out.*", "tuner.pkl", "params.pkl",
                                                                     ".validate_storage_marker", "basic-variant-state*"))
    shutil.rmtree(tmp)
    print("wrote", out)
