"""Every solution notebook runs end to end with papermill (CPU, smoke size) and shows learning."""
import pytest

from coursekit.notebooks import execute, find_notebooks
from conftest import REPO

NOTEBOOKS = find_notebooks(REPO / "solutions")


@pytest.mark.slow
@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.parent.name)
def test_solution_notebook_runs_and_learns(notebook, tmp_path):
    result = execute(notebook, tmp_path / notebook.name, env={"COURSE_SIZE": "smoke"})
    print(f"{notebook.name}: {result['wall_s']} s, peak {result['peak_pss_mib']} MiB PSS")
    assert result["returncode"] == 0, result["log_tail"]
    record = result["record"]
    losses = record["losses"]
    assert len(losses) >= 2 and losses[-1] < 0.8 * losses[0], f"the loss must fall: {losses}"
    assert record["test_accuracy"] > 0.5, f"accuracy {record['test_accuracy']} is not clearly above chance (0.1)"
    # where a notebook compares a distributed run with its single-process reference, it must agree
    if "oracle_max_difference" in record:
        assert record["oracle_max_difference"] < 1e-5
    # where a notebook streams data through Ray Data (module 03), it streamed >= 4x the object store,
    # and the store never filled up
    if "stream_data_mib" in record:
        capacity = record["stream_object_store_capacity_mib"]
        assert capacity > 0 and record["stream_data_mib"] >= 4 * capacity, record
        assert record["stream_object_store_peak_mib"] <= capacity, record
