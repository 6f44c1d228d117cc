"""Module 04's references, computed by the grader in its own process: the notebook's own ``train_func`` and test
helpers (its locked cells, read from the course's notebook, never from a submission) with the reference
checkpoint functions below, trained 3 epochs straight through on 4 ranks (2 nodes x 2) of a gloo group, as the
test cells train it. Never released, and never sent to a kernel: ``REFERENCE`` is the answer to Exercises 1 and 2.
"""
from __future__ import annotations

import contextlib
import io

REFERENCE = '''
def save_training_state(directory, model, optimizer, epoch):
    rank = ray.train.get_context().get_world_rank()
    if rank == 0:
        torch.save({"model": getattr(model, "module", model).state_dict(), "optimizer": optimizer.state_dict(),
                    "epoch": epoch}, os.path.join(directory, "state.pt"))
    torch.save(torch.get_rng_state(), os.path.join(directory, f"rng_rank_{rank}.pt"))


def load_training_state(directory, model, optimizer):
    rank = ray.train.get_context().get_world_rank()
    state = torch.load(os.path.join(directory, "state.pt"), map_location="cpu", weights_only=True)
    getattr(model, "module", model).load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(torch.load(os.path.join(directory, f"rng_rank_{rank}.pt"), map_location="cpu",
                                   weights_only=True))
    return state["epoch"]


def resume(model, optimizer):
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return 0
    with checkpoint.as_directory() as d:
        return load_training_state(d, model, optimizer) + 1
'''

MODULE = "04_fault_tolerance"
# the notebook's locked cells the reference runs: its imports, train_func and the test helpers
CELLS = ("code_27bd9b50", "code_97043aeb", "code_743b5f85")
# what code_97043aeb's CONFIG reads from the parameters cell (CHECK_CONFIG replaces every one of them), and the
# file name the helpers read (the answer cell defines it)
PARAMETERS = dict(EPOCHS=4, LR=2e-3, GLOBAL_BATCH_SIZE=32, TRAIN_SAMPLES=128, TEST_SAMPLES=32, STATE_FILE="state.pt")

_namespace: dict | None = None
_uninterrupted: list | None = None


def namespace() -> dict:
    """The notebook's helpers (cells ``CELLS`` of the course's notebook) with the reference functions, once."""
    global _namespace
    if _namespace is None:
        import nbformat

        from autograder.paths import SOLUTIONS

        nb = nbformat.read(SOLUTIONS / MODULE / f"{MODULE}.ipynb", as_version=4)
        source = {c.metadata.get("nbgrader", {}).get("grade_id"): c.source for c in nb.cells}
        ns: dict = {"__name__": "ft04_reference", **PARAMETERS}
        with contextlib.redirect_stdout(io.StringIO()):
            for gid in CELLS:
                exec(compile(source[gid], f"<{MODULE} {gid}>", "exec"), ns)   # the course's own cells
            exec(compile(REFERENCE, "<ft04 reference>", "exec"), ns)
        _namespace = ns
    return _namespace


def uninterrupted() -> list:
    """The reference run: per rank, one RankReport (epoch, files, rng) per epoch of CHECK_CONFIG (3 epochs)."""
    global _uninterrupted
    if _uninterrupted is None:
        ns = namespace()
        _uninterrupted = ns["run_distributed"](ns["run_ranks"], 4, ns["CHECK_CONFIG"], None, None,
                                               local_world_size=2, timeout_s=120)
    return _uninterrupted


def saved_files(epoch: int) -> dict:
    """The reference checkpoint of ``epoch``: every rank's files ({name: bytes}), merged as Ray Train merges them."""
    return {name: content for reports in uninterrupted() for name, content in (reports[epoch].files or {}).items()}


def saved_state(epoch: int) -> dict:
    """The reference checkpoint of ``epoch``: rank 0's state.pt (model, optimizer, epoch) as tensors."""
    import torch

    return torch.load(io.BytesIO(saved_files(epoch)["state.pt"]), map_location="cpu", weights_only=True)


def saved_rng(epoch: int, rank: int):
    """Rank ``rank``'s generator state in the reference checkpoint of ``epoch`` (its rng file)."""
    import torch

    return torch.load(io.BytesIO(saved_files(epoch)[f"rng_rank_{rank}.pt"]), map_location="cpu", weights_only=True)


def reported_rng(epoch: int, rank: int):
    """Rank ``rank``'s generator state when it reported the checkpoint of ``epoch``."""
    return uninterrupted()[rank][epoch].rng


def final_weights() -> dict:
    return saved_state(len(uninterrupted()[0]) - 1)["model"]
