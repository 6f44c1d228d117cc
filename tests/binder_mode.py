"""Running a module's script as a student on Binder would: Ray Train's local mode, inside Binder's memory limit.

The script runs in Binder mode (``COURSE_PLATFORM=binder``: CPU, local mode, small sizes) with ``--smoke-test``,
inside a memory cgroup of the limit tests/test_notebooks.py holds the module's notebook to (2 GiB plus the CUDA
build's extra per process that imports torch). An OOM kill fails the test; the PSS peak of its processes, the
cgroup's own peak (which counts the page cache too) and the peak of its anonymous + shared memory (what the limit
cannot reclaim) with its share of the limit are reported. Where no memory cgroup can be made, the PSS peak
must stay below the limit instead.
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from autograder.contain import memory_cgroup
from coursekit.proctree import PeakSampler, kill_tree
from helpers import PY
from test_notebooks import BINDER_MIB, CUDA_BUILD_EXTRA_MIB, ResidentPeak


@dataclass
class BinderRun:
    returncode: int | None
    output: str
    seconds: float
    limit_mib: int
    peak_pss_mib: int
    cgroup_peak_mib: int | None
    oom_kills: int | None
    peak_anon_shmem_mib: int | None = None     # the cgroup's anonymous + shared memory at its peak
    peak_anon_shmem_by_process_mib: dict | None = None

    def check(self) -> None:
        """The script finished inside the limit: not OOM-killed in the cgroup (or, with none, its PSS below it)."""
        print(f"Binder mode: {self.seconds:.0f} s, peak {self.peak_pss_mib} MiB PSS, cgroup peak "
              f"{self.cgroup_peak_mib} MiB (page cache included), limit {self.limit_mib} MiB")
        if self.peak_anon_shmem_mib is not None:
            print(f"Binder mode: peak anonymous + shared memory {self.peak_anon_shmem_mib} MiB, "
                  f"{100 * self.peak_anon_shmem_mib / self.limit_mib:.1f}% of the limit: "
                  f"{self.peak_anon_shmem_by_process_mib}")
        assert not self.oom_kills, f"OOM-killed at Binder's limit ({self.limit_mib} MiB)\n{self.output[-3000:]}"
        assert self.returncode == 0, f"exit {self.returncode}\n{self.output[-3000:]}"
        if self.oom_kills is None:   # no cgroup here
            assert self.peak_pss_mib <= self.limit_mib, f"{self.peak_pss_mib} MiB PSS is over {self.limit_mib} MiB"


def run_in_binder_mode(script: str, args: list[str], cwd: Path, storage: Path, torch_processes: int = 1,
                       timeout_s: float = 300) -> BinderRun:
    """``python script --smoke-test *args`` in ``cwd`` as on Binder, with its runs stored under ``storage``.
    ``torch_processes``: the processes that import torch themselves (forked ranks share their parent's)."""
    limit_mib = BINDER_MIB + CUDA_BUILD_EXTRA_MIB * torch_processes
    env = {**os.environ, "COURSE_PLATFORM": "binder", "COURSE_SIZE": "smoke", "COURSE_LOCAL_MODE": "1",
           "COURSE_STORAGE": str(storage)}
    cmd = [PY, script, "--smoke-test", *args]
    group = memory_cgroup(limit_mib * 2**20)
    start = time.perf_counter()
    try:
        proc = subprocess.Popen(group.enter_argv(cmd) if group else cmd, cwd=cwd, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            with PeakSampler(proc.pid, interval_s=0.5) as sampler, \
                    ResidentPeak(group) if group else contextlib.nullcontext() as resident:
                output, _ = proc.communicate(timeout=timeout_s)
        finally:
            if proc.poll() is None:
                kill_tree(proc.pid, group=True)
                proc.wait()
        run = BinderRun(proc.returncode, output, time.perf_counter() - start, limit_mib, round(sampler.peak / 2**20),
                        round(group.peak() / 2**20) if group else None, group.oom_kills() if group else None,
                        round(resident.peak / 2**20) if group else None, resident.mib_by_kind() if group else None)
    finally:
        if group:
            group.remove()
    run.check()
    return run
