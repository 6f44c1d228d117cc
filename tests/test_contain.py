"""The grader's limits on one submission (autograder/contain.py): memory held by a cgroup where the machine
has one, by the RSS watchdog elsewhere; both stop a memory hog and let a normal job finish."""
import subprocess
import sys

import psutil
import pytest

import autograder.contain as contain

HOG = "x = bytearray(600 * 2**20); import time; time.sleep(1); print('survived')"
FINE = "x = bytearray(100 * 2**20); print('finished')"
LIMIT = 300 * 2**20


def _run(code, tmp_path, name):
    return contain.run_limited([sys.executable, "-c", code], tmp_path, {}, timeout=60, memory=LIMIT,
                               log=tmp_path / f"{name}.log")


def test_a_memory_cgroup_holds_a_job_to_its_limit_exactly(tmp_path):
    if not contain.memory_cgroup_available():
        pytest.skip("no memory cgroup the grader may create here (the RSS watchdog applies instead)")
    hog = _run(HOG, tmp_path, "hog")
    assert hog.killed == "memory" and "survived" not in hog.output, hog
    # the kernel never let it hold more than the limit (the watchdog could overshoot by 0.2 s of allocation)
    assert hog.peak_rss <= LIMIT, hog.peak_rss
    fine = _run(FINE, tmp_path, "fine")
    assert fine.returncode == 0 and not fine.killed and "finished" in fine.output, fine
    parent, _ = contain._cgroup_parent()
    assert not list(parent.glob("course-grading-*")), "every job's cgroup is removed after it"


def test_removing_a_cgroup_kills_what_escaped_the_jobs_process_tree(tmp_path):
    """A job that leaves a daemon behind (its own session, reparented to init: outside the tree the grader
    kills) does not keep its cgroup, or the daemon, alive."""
    group = contain.memory_cgroup(LIMIT)
    if group is None:
        pytest.skip("no memory cgroup the grader may create here")
    pid_file = tmp_path / "daemon.pid"
    code = ("import subprocess, sys; p = subprocess.Popen(['sleep', '300'], start_new_session=True); "
            f"open({str(pid_file)!r}, 'w').write(str(p.pid))")
    subprocess.run(group.enter_argv([sys.executable, "-c", code]), check=True, timeout=60)
    daemon = psutil.Process(int(pid_file.read_text()))
    assert daemon.is_running() and str(daemon.pid) in (group.path / "cgroup.procs").read_text().split()
    group.remove()
    assert not group.path.exists()
    daemon.wait(timeout=10)   # killed with the group


def test_without_a_cgroup_the_watchdog_kills_a_hog_and_spares_a_normal_job(tmp_path, monkeypatch):
    monkeypatch.setattr(contain, "_cgroup_parent", lambda: None)
    hog = _run(HOG, tmp_path, "hog")
    assert hog.killed == "memory" and "survived" not in hog.output, hog
    fine = _run(FINE, tmp_path, "fine")
    assert fine.returncode == 0 and not fine.killed and "finished" in fine.output, fine


def test_a_job_past_its_time_is_killed_with_its_children(tmp_path):
    code = "import subprocess, time; subprocess.Popen(['sleep', '300']); time.sleep(300)"
    out = contain.run_limited([sys.executable, "-c", code], tmp_path, {}, timeout=2, memory=LIMIT,
                              log=tmp_path / "slow.log")
    assert out.killed == "timeout" and out.seconds < 30, out
