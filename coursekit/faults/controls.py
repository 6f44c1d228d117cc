"""Module 04's widget: the faults of the live run, and the configuration that must survive them."""
from __future__ import annotations

from coursekit.widgets import STYLE, Controls, layout, warning


class FaultToleranceControls(Controls):
    """Module 04's live run, chosen with controls: which faults to inject, and the ``FailureConfig`` /
    ``CheckpointConfig`` values (``max_failures``, ``num_to_keep``, the score metric) the run gets.

    >>> controls = FaultToleranceControls(epochs=4, num_workers=2)
    >>> controls                 # the controls, and what the run will do with them
    >>> controls.faults()        # the fault plan for inject_faults
    >>> controls.run_config_args()   # max_retries, keep, metric, mode: the arguments of make_run_config
    """

    # the score metrics the live run reports, and which end of each is best (None: no score, the most recent)
    MODES = {"loss": "min", "accuracy": "max", None: "max"}

    def __init__(self, epochs: int, num_workers: int, kill_epoch: int | None = 1, raise_epoch: int | None = 2,
                 max_failures: int | None = 2, keep: int | None = None, metric: str | None = "loss"):
        import ipywidgets as w

        self.epochs, self.num_workers = int(epochs), int(num_workers)
        when = [("never", None)] + [(f"epoch {e}", e) for e in range(self.epochs)]
        self.kill_epoch = w.Dropdown(options=when, value=kill_epoch, description="SIGKILL rank "
                                     f"{self.kill_rank} at", style=STYLE, layout=layout())
        self.raise_epoch = w.Dropdown(options=when, value=raise_epoch, description="exception on rank 0 at",
                                      style=STYLE, layout=layout())
        self.max_failures = w.IntSlider(value=2 if max_failures is None else int(max_failures), min=0, max=5,
                                        description="max_failures", style=STYLE, layout=layout())
        self.unlimited = w.Checkbox(value=max_failures is None, description="no limit (max_failures=-1)",
                                    style=STYLE, layout=layout())
        self.keep = w.IntSlider(value=self.epochs if keep is None else int(keep), min=1, max=self.epochs,
                                description="num_to_keep", style=STYLE, layout=layout())
        self.metric = w.Dropdown(options=[("loss", "loss"), ("accuracy", "accuracy"), ("none: the most recent", None)],
                                 value=metric, description="checkpoint score", style=STYLE, layout=layout())
        self.summary, self.error = w.HTML(), w.HTML()
        self._watch(self.kill_epoch, self.raise_epoch, self.max_failures, self.unlimited, self.keep, self.metric)
        self.widget = w.VBox([w.HTML(f"<b>Fault tolerance</b> &nbsp; {self.epochs} epochs on "
                                     f"{self.num_workers} workers"), self.kill_epoch, self.raise_epoch,
                              self.max_failures, self.unlimited, self.keep, self.metric, self.summary, self.error])
        self._refresh()

    @property
    def kill_rank(self) -> int:
        return min(1, self.num_workers - 1)

    def problem(self) -> str | None:
        k, r = self.kill_epoch.value, self.raise_epoch.value
        if k is not None and k == r:
            return (f"Both faults at epoch {k}: the two ranks would fail together, which is one failure of the "
                    "worker group, not two. Pick different epochs.")
        return None

    def faults(self) -> dict:
        """The fault plan (for :func:`inject_faults`); raises ValueError when the choice cannot be run."""
        why = self.problem()
        if why:
            raise ValueError(why)
        plan = {}
        if self.kill_epoch.value is not None:
            plan["kill"] = {"epoch": self.kill_epoch.value, "rank": self.kill_rank}
        if self.raise_epoch.value is not None:
            plan["raise"] = {"epoch": self.raise_epoch.value, "rank": 0}
        return plan

    def run_config_args(self) -> dict:
        """``max_retries`` (None: no limit), ``keep``, ``metric`` (None: no score) and ``mode`` (which end of the
        metric is best): what ``make_run_config`` takes."""
        return {"max_retries": None if self.unlimited.value else self.max_failures.value,
                "keep": self.keep.value, "metric": self.metric.value, "mode": self.MODES[self.metric.value]}

    def in_storage(self) -> tuple[int, int]:
        """How many checkpoint folders storage holds when the run ends: (at least, at most).

        Ray Train 2.60 (``CheckpointManager._save_state_and_delete_old_checkpoints``) keeps the ``num_to_keep``
        best by the score, or the most recent without one, and never deletes the **latest** checkpoint, the one a
        restart resumes from. With a score the latest may rank below the K best: then it is kept as well, K + 1
        in all. Without a score the latest is one of the K most recent."""
        k = min(self.keep.value, self.epochs)
        extra = 1 if self.metric.value is not None and self.keep.value < self.epochs else 0
        return k, k + extra

    def expected(self) -> dict:
        """What the run should do: how many failures, whether it finishes, the epochs each worker group starts at
        (a restart resumes from the checkpoint of the epoch before the fault), and ``kept``: the checkpoints the
        ``Result`` lists (``best_checkpoints``, one ``metrics_dataframe`` row each), the K best or most recent;
        storage may hold one more (:meth:`in_storage`)."""
        failures = sorted(e for e in (self.kill_epoch.value, self.raise_epoch.value) if e is not None)
        limit = self.run_config_args()["max_retries"]
        finishes = limit is None or len(failures) <= limit
        starts = [0] + (failures if finishes else failures[:limit])
        return {"failures": len(failures), "finishes": finishes, "group_starts": starts,
                "kept": min(self.keep.value, self.epochs)}

    def _refresh(self, _change=None) -> None:
        self.max_failures.disabled = self.unlimited.value
        why = self.problem()
        self.error.value = warning(why)
        if why:
            self.summary.value = ""
            return
        e, args = self.expected(), self.run_config_args()
        limit = "no limit" if args["max_retries"] is None else f"max_failures={args['max_retries']}"
        if e["finishes"]:
            outcome = (f"<span style='color:#1b7a1b'>finishes</span>: {e['failures']} failure(s), {limit}; worker "
                       f"groups start at epochs {e['group_starts']}")
        else:
            outcome = (f"<span style='color:#b00020'>fails</span> at failure {args['max_retries'] + 1} of "
                       f"{e['failures']} ({limit}): <code>result.error</code> says why")
        low, high = self.in_storage()
        if args["metric"] is None:
            which = f"the {e['kept']} most recent (the latest among them)"
        else:
            order = "lowest" if args["mode"] == "min" else "highest"
            which = f"the {e['kept']} with the {order} <code>{args['metric']}</code>"
            if high > low:
                which += (", and the latest too when it is not one of them (a restart resumes from it): "
                          f"{low} or {high} in storage")
        self.summary.value = (f"The run {outcome}.<br>Kept checkpoints: {which}; <code>metrics_dataframe</code> has "
                              f"{e['kept']} row(s), one per checkpoint the <code>Result</code> lists.")

    def __repr__(self) -> str:
        return (f"FaultToleranceControls(faults={self.faults() if not self.problem() else '?'}, "
                f"{self.run_config_args()})")
