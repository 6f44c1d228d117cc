"""The data files that released checks read instead of code (autograder/fixtures.py): what they hold is what the
reference computes today, and the release ships them whole."""
import torch

from autograder import fixtures
from autograder.checks import fsdp05
from coursekit.exercise_checks.fsdp import max_difference
from helpers import REPO


def test_module_05_checkpoints_hold_what_the_reference_save_makes_today(tmp_path):
    fresh = fixtures.make(tmp_path)
    assert [d.name for d in fresh] == [fixtures.checkpoint_name(*case) for case in fixtures.checkpoint_cases()]
    ref_weights, ref_buffers = fsdp05.stepped_reference()       # one process, one SGD step: what every case saved
    for directory in fresh:
        shipped = fixtures.FIXTURES / directory.name
        assert sorted(p.name for p in shipped.iterdir()) == sorted(p.name for p in directory.iterdir())
        assert fixtures.METADATA in {p.name for p in shipped.iterdir()}
        saved = torch.load(fixtures.FIXTURES / f"{directory.name}.state.pt", weights_only=True)
        again = torch.load(tmp_path / f"{directory.name}.state.pt", weights_only=True)
        for part, ref in (("weights", ref_weights), ("optimizer", ref_buffers)):
            assert set(saved[part]) == set(ref) == set(again[part])
            assert max_difference(saved[part], again[part]) < 1e-6, (directory.name, part)
            assert max_difference(saved[part], ref) < fsdp05.TOLERANCE, (directory.name, part)


def test_the_release_ships_the_checkpoints_with_their_metadata():
    for case in fixtures.checkpoint_cases():
        name = fixtures.checkpoint_name(*case)
        released = REPO / "course" / "05_fsdp2" / "fixtures"
        assert sorted(p.name for p in (released / name).iterdir()) == \
            sorted(p.name for p in (fixtures.FIXTURES / name).iterdir())
        assert (released / f"{name}.state.pt").read_bytes() == (fixtures.FIXTURES / f"{name}.state.pt").read_bytes()
