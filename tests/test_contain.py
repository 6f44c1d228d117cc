"""The grader's limits on one submission (autograder/contain.py): memory held by a cgroup where the machine
has one, by the RSS watchdog elsewhere; both stop a memory hog and let a normal job finish. The jail
(bubblewrap): a process in it reaches no network, not even a server on this machine's loopback, reads no
hidden folder, writes only its working folder, and sees no other process; a kernel started from the
grading kernelspec answers over its unix sockets."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

import autograder.contain as contain
from autograder.paths import REPO, SOLUTIONS

HOG = "x = bytearray(600 * 2**20); import time; time.sleep(1); print('survived')"
FINE = "x = bytearray(100 * 2**20); print('finished')"
LIMIT = 300 * 2**20


def _run(code, tmp_path, name):
    return contain.run_limited([sys.executable, "-c", code], tmp_path, {}, timeout=60, memory=LIMIT,
                               log=tmp_path / f"{name}.log")


def test_a_memory_cgroup_holds_a_job_to_its_limit_exactly(tmp_path):
    if not contain.memory_cgroup_available():
        pytest.skip("no memory cgroup the grader may create here (the RSS watchdog applies instead)")
    parent, _ = contain._cgroup_parent()
    others = set(parent.glob("course-grading-*"))       # another grader's jobs on this machine, if any
    hog = _run(HOG, tmp_path, "hog")
    assert hog.killed == "memory" and "survived" not in hog.output, hog
    # the kernel never let it hold more than the limit (the watchdog could overshoot by 0.2 s of allocation); the
    # cgroup's own peak, not the RSS sum, which counts library pages charged to whoever loaded them first
    assert hog.extra["cgroup_peak"] <= LIMIT, hog.extra
    fine = _run(FINE, tmp_path, "fine")
    assert fine.returncode == 0 and not fine.killed and "finished" in fine.output, fine
    assert not set(parent.glob("course-grading-*")) - others, "every job's cgroup is removed after it"


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


jail = pytest.mark.skipif(not contain.jail_available(),
                          reason=f"no jail here: {contain.jail_missing_reason()} (make test installs bubblewrap)")

PROBE = """
import json, os, socket, sys
port, secret, work = int(sys.argv[1]), sys.argv[2], sys.argv[3]
seen = {}
s = socket.socket(); s.settimeout(3)
seen["loopback_server"] = s.connect_ex(("127.0.0.1", port)) == 0
try:
    socket.create_connection(("pypi.org", 443), timeout=3).close(); seen["internet"] = True
except OSError:
    seen["internet"] = False
seen["solutions"] = os.listdir(sys.argv[4])
seen["secret"] = os.path.exists(secret)
seen["tmp"] = sorted(os.listdir("/tmp"))
seen["pids"] = len([p for p in os.listdir("/proc") if p.isdigit()])
for name, path in {"repo": sys.argv[5], "secret_dir": os.path.dirname(secret)}.items():
    try:
        open(path, "w").close(); seen["wrote_" + name] = True
    except OSError:
        seen["wrote_" + name] = False
open(os.path.join(work, "result.txt"), "w").write("kept")
seen["cwd"] = os.getcwd()
print(json.dumps(seen))
"""


@pytest.fixture
def server():
    """A TCP server on this machine's loopback (what a submission must not reach)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@jail
def test_the_jail_cuts_the_network_hides_folders_and_keeps_only_the_workdir_writable(tmp_path, server):
    work, hidden = tmp_path / "work", tmp_path / "grading-out"
    work.mkdir()
    hidden.mkdir()
    (hidden / "gradebook.db").write_text("grades")
    # outside the jail, the same probe does reach the server and see everything
    argv = [sys.executable, "-c", PROBE, str(server), str(hidden / "gradebook.db"), str(work), str(SOLUTIONS),
            str(REPO / "PWNED.txt")]
    free = json.loads(subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=work).stdout)
    assert free["loopback_server"] and free["secret"] and free["solutions"], free
    (REPO / "PWNED.txt").unlink()
    r = subprocess.run([*contain.jail_argv(work, [SOLUTIONS, hidden], REPO), *argv],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    seen = json.loads(r.stdout)
    assert not seen["loopback_server"] and not seen["internet"], seen
    assert seen["solutions"] == [] and not seen["secret"], seen
    assert not seen["wrote_repo"] and not seen["wrote_secret_dir"], seen
    assert not (REPO / "PWNED.txt").exists()
    assert seen["cwd"] == str(work.resolve()) and (work / "result.txt").read_text() == "kept"
    assert seen["pids"] <= 3, "the jail has its own process namespace"
    # its /tmp is new and empty but for what is bound back into it: the working folder (tmp_path lives under
    # /tmp) and, where they live under /tmp (a CI clone), the repository and this Python
    bound = [work.resolve(), *contain._visible_under_tmp([REPO, Path(sys.prefix), Path(sys.base_prefix)])]
    assert set(seen["tmp"]) <= {"home", *(p.parts[2] for p in bound)}, seen["tmp"]


@jail
def test_a_kernel_from_the_grading_kernelspec_runs_in_the_jail_over_unix_sockets(tmp_path, server, monkeypatch):
    from jupyter_client import KernelManager

    job, work, runtime = tmp_path / "job", tmp_path / "job" / "work", tmp_path / "job" / "runtime"
    job.mkdir()
    monkeypatch.setenv("JUPYTER_PATH", str(contain.write_kernelspec(job, work, [SOLUTIONS], REPO, [runtime])))
    km = KernelManager(kernel_name=contain.KERNEL, transport="ipc", connection_file=str(runtime / "kernel-1.json"))
    km.start_kernel(env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        kc = km.client()
        kc.start_channels()
        kc.wait_for_ready(timeout=120)
        out = []
        code = (f"import os, socket; s = socket.socket(); s.settimeout(3); "
                f"print(s.connect_ex(('127.0.0.1', {server})) == 0, os.listdir({str(SOLUTIONS)!r}), os.getcwd())")
        reply = kc.execute_interactive(code, timeout=60, output_hook=lambda m: out.append(m["content"].get("text", "")))
        assert reply["content"]["status"] == "ok", reply["content"]
        assert "".join(out).split() == ["False", "[]", str(work.resolve())], out
        kc.stop_channels()
    finally:
        km.shutdown_kernel(now=True)


# ---------------------------------------------------------------- jobs forked by a warm worker

def _warm(code, tmp_path, name, timeout=60):
    """``code`` run by a job that a warm worker forked (as every grading job is), in a child process of it."""
    return contain.run_limited(None, tmp_path, {}, timeout=timeout, memory=LIMIT, log=tmp_path / f"{name}.log",
                               worker_argv=[sys.executable, "-c", code], worker_call="subprocess:call")


def test_a_warm_worker_forks_each_job_in_its_own_session_and_is_reused(tmp_path):
    code = "import os; print('session', os.getsid(0))"
    first = _warm(code, tmp_path, "one")
    warm = list(contain.WarmWorker._idle)
    second = _warm(code, tmp_path, "two")
    assert first.returncode == 0 and second.returncode == 0, (first, second)
    s1, s2 = (int(out.output.split()[1]) for out in (first, second))
    assert s1 != s2 and os.getsid(0) not in (s1, s2), "each job leads a session of its own, not the grader's"
    # the pool neither grew nor changed: the second job was forked by a warm worker that already existed
    assert warm and contain.WarmWorker._idle == warm, "the second job reused an idle warm worker"
    assert all(w.proc.poll() is None for w in warm)


def test_a_forked_job_past_its_time_is_killed_with_its_children(tmp_path):
    code = "import subprocess, time; subprocess.Popen(['sleep', '317']); time.sleep(300)"
    out = _warm(code, tmp_path, "slow", timeout=2)
    assert out.killed == "timeout" and out.seconds < 30, out
    assert not [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == ["sleep", "317"]]
    fine = _warm("print('next job')", tmp_path, "next")
    assert fine.returncode == 0 and "next job" in fine.output, "the warm worker still serves after a kill"


def test_a_forked_job_is_held_to_its_memory_limit(tmp_path, monkeypatch):
    hog = _warm(HOG, tmp_path, "hog")
    assert hog.killed == "memory" and "survived" not in hog.output, hog
    monkeypatch.setattr(contain, "_cgroup_parent", lambda: None)     # the watchdog, where there is no cgroup
    hog = _warm(HOG, tmp_path, "hog2")
    assert hog.killed == "memory" and "survived" not in hog.output, hog
