"""The grading loop end to end: nbgrader autogrades real submissions of every module.

One class is graded in one run (as an instructor would): per module, a student
who submitted the reference solution (full marks), one who submitted the
untouched notebook (zero, and grading completes), and one with realistic
mistakes (partial credit). A fourth student submitted nothing for one module.
"""
import csv

import pytest

from autograder.grade import grade
from autograder.release import modules
from autograder.samples import solution_answers, write_submission

# Realistic mistakes, per module: grade_id -> what a student might write.
WRONG = {
    "01_ddp_pytorch": {
        # forgets set_epoch: every epoch repeats the same order
        "rank_indices": (
            "def rank_indices(dataset_len, rank, world_size, epoch, seed=0):\n"
            "    sampler = DistributedSampler(range(dataset_len), num_replicas=world_size, rank=rank,\n"
            "                                 shuffle=True, seed=seed)\n"
            "    return [int(i) for i in sampler]\n"),
        # sums the loss instead of averaging it: steps no longer equal the full-batch step
        "ddp_train_step": (
            "def ddp_train_step(rank, world_size, state_dict, images, labels, lr):\n"
            "    model = build_small_cnn()\n"
            "    model.load_state_dict(state_dict)\n"
            "    ddp_model = DDP(model)\n"
            "    shard = len(labels) // world_size\n"
            "    x, y = images[rank * shard:(rank + 1) * shard], labels[rank * shard:(rank + 1) * shard]\n"
            "    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=lr)\n"
            "    optimizer.zero_grad()\n"
            "    F.cross_entropy(ddp_model(x), y, reduction='sum').backward()\n"
            "    optimizer.step()\n"
            "    return {k: v.detach().clone() for k, v in ddp_model.module.state_dict().items()}, len(y)\n"),
    },
    "02_ray_train": {
        # passes the global batch as the per-worker batch
        "worker_batch_size": "def worker_batch_size(global_batch_size):\n    return global_batch_size\n",
        # checkpoints on every rank
        "save_checkpoint_and_report": (
            "def save_checkpoint_and_report(model, metrics):\n"
            "    with tempfile.TemporaryDirectory() as tmp:\n"
            "        torch.save(getattr(model, 'module', model).state_dict(), os.path.join(tmp, 'model.pt'))\n"
            "        ray.train.report(metrics, checkpoint=Checkpoint.from_directory(tmp))\n"),
    },
}


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    subs = tmp_path_factory.mktemp("submissions")
    for module in modules():
        reference = solution_answers(module)
        write_submission(subs, "ada", module, reference)                     # the reference solution
        write_submission(subs, "blank", module, {})                          # untouched notebook
        write_submission(subs, "partial", module, {**reference, **WRONG.get(module, {})})
    write_submission(subs, "late", modules()[0], solution_answers(modules()[0]))  # only the first module
    out = tmp_path_factory.mktemp("grading")
    rows = grade(subs, out, quiet=True)
    return out, {(r["student"], r["module"]): r for r in rows}


@pytest.mark.slow
def test_reference_solution_gets_full_marks(graded):
    _, rows = graded
    for m in modules():
        r = rows[("ada", m)]
        assert r["status"] == "graded" and r["max_score"] > 0
        assert r["score"] == r["max_score"], f"{m}: the reference solution scored {r['score']}/{r['max_score']}"


@pytest.mark.slow
def test_untouched_notebook_gets_zero_and_grading_completes(graded):
    _, rows = graded
    for m in modules():
        assert rows[("blank", m)]["status"] == "graded" and rows[("blank", m)]["score"] == 0


@pytest.mark.slow
def test_realistic_mistakes_get_partial_credit(graded):
    _, rows = graded
    for m in modules():
        r = rows[("partial", m)]
        assert r["status"] == "graded"
        assert 0 < r["score"] < r["max_score"], f"{m}: mistakes scored {r['score']}/{r['max_score']}"


@pytest.mark.slow
def test_csv_and_feedback_cover_every_student_and_module(graded):
    out, rows = graded
    with open(out / "grades.csv") as f:
        table = list(csv.DictReader(f))
    students = {"ada", "blank", "partial", "late"}
    assert {(r["student"], r["module"]) for r in table} == {(s, m) for s in students for m in modules()}
    assert rows[("late", modules()[1])]["status"] == "missing"
    for s in ("ada", "blank", "partial"):
        for m in modules():
            html = out / "feedback" / s / m / f"{m}.html"
            assert html.exists(), html
            assert "Score:" in html.read_text() or "score" in html.read_text().lower()
