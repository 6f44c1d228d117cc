"""coursekit.proctree on real processes: a tree's memory, its peak, and killing it to the last grandchild."""
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from coursekit.proctree import PeakSampler, kill_tree, process_kind, tree, tree_pss

# a parent that starts its children and waits: two `sleep`s and a Python child with a `sleep` of its own
PARENT = textwrap.dedent("""
    import subprocess, sys
    kids = [subprocess.Popen(["sleep", "60"]), subprocess.Popen(["sleep", "60"]),
            subprocess.Popen([sys.executable, "-c", "import subprocess; subprocess.run(['sleep', '60'])"])]
    for k in kids:
        k.wait()
""")


def _wait_for_tree(root: subprocess.Popen, size: int, timeout: float = 30) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        procs = tree(root.pid)
        if len(procs) >= size:
            return procs
        time.sleep(0.05)
    raise AssertionError(f"the tree of {root.args} did not reach {size} processes: {tree(root.pid)}")


def _gone(p: psutil.Process) -> bool:
    try:
        return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


@pytest.fixture
def parent():
    proc = subprocess.Popen([sys.executable, "-c", PARENT])
    yield proc
    kill_tree(proc.pid)
    proc.wait()


def test_tree_pss_counts_every_process_of_the_tree(parent):
    procs = _wait_for_tree(parent, 5)   # parent, 2 sleeps, the Python child and its sleep
    by_kind: dict = {}
    total = tree_pss(parent.pid, by_kind)
    root = psutil.Process(parent.pid)
    assert total >= root.memory_full_info().pss * 0.9  # sampled at a slightly different moment
    assert by_kind["sleep"][1] == 3
    assert sum(n for _, n in by_kind.values()) == len(procs) == 5
    assert total == pytest.approx(sum(b for b, _ in by_kind.values()))
    assert total > tree_pss(procs[1])  # more than one sleep's worth
    assert process_kind(procs[1]) == "sleep"


def test_peak_sampler_sees_a_grandchild_allocate(tmp_path):
    ready = tmp_path / "allocated"
    child = (f"import time; b = b'x' * (200 * 2**20); open({str(ready)!r}, 'w').close(); time.sleep(1.0)")
    cmd = [sys.executable, "-c", f"import subprocess, sys; subprocess.run([sys.executable, '-c', {child!r}])"]
    proc = subprocess.Popen(cmd)
    try:
        with PeakSampler(proc.pid, interval_s=0.1) as sampler:
            assert proc.wait(timeout=60) == 0
    finally:
        kill_tree(proc.pid)
    assert ready.exists()
    assert sampler.peak >= 180 * 2**20
    assert sum(n for _, n in sampler.peak_by_kind.values()) == 2   # the parent and the allocating child
    assert sum(b for b, _ in sampler.peak_by_kind.values()) == sampler.peak


def test_peak_sampler_of_a_process_that_is_gone():
    proc = subprocess.Popen(["true"])
    proc.wait()
    with PeakSampler(proc.pid, interval_s=0.05) as sampler:
        time.sleep(0.1)
    assert sampler.peak == 0 and sampler.peak_by_kind == {}


def test_kill_tree_kills_the_grandchildren(parent):
    procs = _wait_for_tree(parent, 5)
    assert kill_tree(parent.pid) == []
    assert all(_gone(p) for p in procs)
    assert parent.wait(timeout=10) == -signal.SIGKILL  # not reaped by kill_tree: Popen still sees how it ended


def test_kill_tree_of_a_process_group_signals_each_process_once():
    # the launcher's case: a root in its own session, a child that stops only at the second SIGTERM
    child = ("import signal, time; n = []; signal.signal(signal.SIGTERM, lambda *a: n.append(1) "
             "if not n else exit(0)); print('ready', flush=True); time.sleep(60)")
    parent = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {child!r}])"
    proc = subprocess.Popen([sys.executable, "-c", parent], start_new_session=True, stdout=subprocess.PIPE, text=True)
    procs = []
    try:
        assert proc.stdout.readline().strip() == "ready"
        procs = _wait_for_tree(proc, 2)
        still = kill_tree(proc.pid, signal.SIGTERM, timeout=1.0, group=True)
        assert [p.pid for p in still] == [procs[1].pid]   # one SIGTERM: the child is still there
    finally:
        kill_tree(proc.pid, known=procs, group=True)
        proc.wait()
        proc.stdout.close()


def test_kill_tree_of_a_gone_process_does_not_raise():
    proc = subprocess.Popen(["true"])
    ps = psutil.Process(proc.pid)
    proc.wait()
    assert kill_tree(proc.pid) == []
    assert kill_tree(ps, signal.SIGTERM, group=True) == []
    assert tree(proc.pid) == [] and tree_pss(proc.pid) == 0


def test_kill_named_kills_only_the_processes_whose_command_line_names_the_fragment(tmp_path):
    from coursekit.proctree import kill_named

    marker = str(tmp_path / "node-temp-dir")
    ours = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", marker], start_new_session=True)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert kill_named([marker]) == 1
        ours.wait(timeout=10)                   # (kill_named reaped it: Popen sees it gone)
        assert not psutil.pid_exists(ours.pid)
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()
        ours.kill()
