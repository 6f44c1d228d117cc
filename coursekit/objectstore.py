"""Object-store and memory measurements of this node's Ray (``ObjectStoreMonitor``)."""
from __future__ import annotations

import threading
from pathlib import Path

from coursekit.proctree import tree, tree_pss


def _find_raylet():
    """The raylet (which hosts the object store) of this node: an ancestor of a Ray worker,
    or a child of a driver that started Ray. None where it cannot be seen (a remote cluster)."""
    import psutil

    me = psutil.Process()
    for p in [me, *me.parents()]:
        if p.name() == "raylet":
            return p
    for p in tree(me)[1:]:
        if p.name() == "raylet":
            return p
    return None


def _plasma_file(raylet) -> str | None:
    fd_dir = Path(f"/proc/{raylet.pid}/fd")
    for fd in fd_dir.iterdir():
        try:
            target = Path(fd).readlink().as_posix()
        except OSError:
            continue
        if "/plasma" in target:
            return str(fd)
    return None


def _spill_dirs(raylet) -> list[Path]:
    for arg in raylet.cmdline():
        if arg.startswith("--session_dir="):
            return [p for p in Path(arg.split("=", 1)[1]).glob("*spill*") if p.is_dir()]
    return []


def _dir_bytes(dirs: list[Path]) -> int:
    return sum(f.stat().st_size for d in dirs for f in d.rglob("*") if f.is_file())


class ObjectStoreMonitor:
    """Watch this node's object store and Ray processes while a block of code runs.

    * ``peak``: bytes of the object store's shared memory that are in use (pages touched;
      a high-water mark: the store keeps pages it has used) at the end;
    * ``capacity``: the store's size;
    * ``peak_pss``: the most memory (PSS) the raylet and every Ray worker on this node used
      together, object store included;
    * ``spilled``: bytes Ray wrote to disk because the store was full;
    * ``pss``: that memory at the latest sample (read it while the block runs to trace memory over time).

    Local to one node (the one this process runs on); ``available`` is False elsewhere.

    >>> with ObjectStoreMonitor() as mon:
    ...     consume(dataset)
    >>> mon.peak, mon.capacity, mon.peak_pss
    """

    def __init__(self, interval_s: float = 0.5):
        self.interval_s = interval_s
        self.peak = self.capacity = self.peak_pss = self.spilled = 0
        self.pss = 0                  # the Ray processes' PSS at the last sample
        self._raylet = _find_raylet()
        self._plasma = _plasma_file(self._raylet) if self._raylet else None
        self._spill = _spill_dirs(self._raylet) if self._raylet else []
        self._spill0 = _dir_bytes(self._spill)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def available(self) -> bool:
        return self._plasma is not None

    def sample(self) -> None:
        if not self.available:
            return
        st = Path(self._plasma).stat()
        self.peak = max(self.peak, st.st_blocks * 512)
        self.capacity = st.st_size
        self.pss = tree_pss(self._raylet)
        self.peak_pss = max(self.peak_pss, self.pss)
        self.spilled = _dir_bytes(self._spill) - self._spill0

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sample()
            except Exception:  # a process that ends while we look is not an error
                pass
            self._stop.wait(self.interval_s)

    def __enter__(self) -> "ObjectStoreMonitor":
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            self.sample()
        except Exception:
            pass

    def as_dict(self) -> dict:
        return {"object_store_peak": self.peak, "object_store_capacity": self.capacity,
                "ray_peak_pss": self.peak_pss, "spilled": self.spilled}
