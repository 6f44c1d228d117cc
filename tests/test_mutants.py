"""autograder.mutants: the operators make the mistakes they name, only in the student's part of a cell; the
reviewed file of equivalent mutants names mutants the references still produce, each with a reason; the
summary counts a timeout against the exercise. (The runs themselves: the bench's mutants section, which the
short benchmark runs on one exercise.)"""
import tomllib

import nbformat
import pytest

from autograder import mutants as mt
from autograder.checks import FILES
from autograder.paths import notebooks
from helpers import REPO

CELL = '''def step(model, optimizer, loader, checkpoint):
    """Given by the release: not mutated."""
    seed = 0
    ### BEGIN SOLUTION
    torch.manual_seed(config["seed"])
    rank = dist.get_rank()
    for epoch in range(3):
        total = 0.0
        sampler.set_epoch(epoch)
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp_replicate", "dp_shard"))
    state = get_model_state_dict(model)
    with checkpoint.as_directory() as folder:
        load(folder)
    device = ray.train.torch.get_device()
    ### END SOLUTION
    return rank
'''


@pytest.fixture(scope="module")
def found():
    return mt.mutants(CELL)


def changes(found, operator):
    return [m.diff for m in found if m.operator == operator]


def test_only_the_answer_part_is_mutated(found):
    given = [m for m in found if "Given by the release" not in m.source or "seed = 0" not in m.source
             or not m.source.rstrip().endswith("return rank")]
    assert not given, f"mutants of the release's own lines: {[m.key for m in given]}"
    assert all(m.source != CELL for m in found) and len({m.source for m in found}) == len(found)


def test_domain_operators(found):
    swaps = " ".join(changes(found, "swap-names"))
    for new in ("get_local_rank()", "ReduceOp.AVG", "('dp_shard', 'dp_replicate')"):
        assert new in swaps or new in " ".join(changes(found, "reverse-tuple")), new
    assert any("+ dist.all_reduce(total)" in c for c in changes(found, "keyword"))
    assert any("op=None" in c for c in changes(found, "keyword"))
    assert any(c.startswith("- sampler.set_epoch(epoch)") for c in changes(found, "remove-call"))
    assert any("total = 0.0 <out of> for epoch in range(3):" == c for c in changes(found, "hoist-accumulator"))
    assert any("(4, 2)" in c for c in changes(found, "reverse-tuple"))
    assert any("nullcontext(checkpoint.path)" in c for c in changes(found, "as-directory-to-path"))
    assert any("full_state_dict=True" in c for c in changes(found, "full-state-dict"))
    assert any("device('cpu')" in c for c in changes(found, "driver-device"))
    assert any("<before>" in c for c in changes(found, "swap-statements"))
    assert any("manual_seed(config['seed'] + 1)" in c for c in changes(found, "change-seed"))


def test_cosmic_ray_operators(found):
    assert any("range(4)" in c or "range( 4)" in c for c in changes(found, "NumberReplacer"))
    assert any("for epoch in []" in c for c in changes(found, "ZeroIterationForLoop"))


def test_every_mutant_compiles(found):
    for m in found:
        compile(m.source, m.key, "exec")


def test_summary_counts_a_timeout_against_the_exercise():
    rows = [{"verdict": v} for v in ("killed", "killed", "equivalent", "timeout", "survived")]
    assert mt.summary(rows) == {"generated": 5, "killed": 2, "survived": 1, "equivalent": 1, "timeout": 1,
                                "score": 0.5}


def test_equivalents_are_reviewed_mutants_of_the_references():
    """Every entry of the reviewed files (one per module): an exercise that exists, a mutant the reference answer
    still produces (a stale entry would excuse nothing, or something else), and a reason."""
    files = sorted(mt.EQUIVALENT.glob("*.toml"))
    assert files, "no reviewed file of equivalent mutants"
    for path in files:
        module = path.stem
        assert module in FILES, f"{path.name}: not a module"
        nbs = {name: nbformat.read(REPO / "solutions" / module / f"{name}.ipynb", as_version=4)
               for name in notebooks(module)}
        ex = {e.name: (e, nb) for nb in nbs.values() for e in mt.exercises(module, nb)}
        made: dict[str, set[str]] = {}
        for row in tomllib.loads(path.read_text()).get("equivalent", []):
            assert set(row) == {"exercise", "mutant", "reason"}, row
            assert row["exercise"] in ex, f"{path.name}: no exercise {row['exercise']!r}"
            if row["exercise"] not in made:
                e, nb = ex[row["exercise"]]
                made[row["exercise"]] = {m.key for m in mt.mutants(nb.cells[e.answer].source)}
            assert row["mutant"] in made[row["exercise"]], (
                f"{path.name}: the reference of {row['exercise']} no longer makes the mutant {row['mutant']!r}")
            assert len(row["reason"].split()) >= 8, f"{path.name}: say why {row['mutant']!r} computes the same thing"


def test_running_a_mutant_leaves_the_reference_in_the_notebook(tmp_path):
    """nbclient stores each executed cell in its notebook: a mutant (or a housekeeping cell) run there must not
    replace the reference answer that later exercises replay and the next mutants are made from."""
    kernel = mt.Kernel("01_ddp_pytorch", tmp_path)
    index = next(i for i, c in enumerate(kernel.nb.cells) if c.cell_type == "code")
    before = [(c.cell_type, c.source) for c in kernel.nb.cells]
    kernel.start()
    try:
        cell, error = kernel.run(index, "mutated = 1")
        assert error is None and cell.source == "mutated = 1"
        assert kernel.code("assert mutated == 1") is None           # it ran in the kernel ...
    finally:
        kernel.stop()
    assert [(c.cell_type, c.source) for c in kernel.nb.cells] == before   # ... and the notebook is the reference's
