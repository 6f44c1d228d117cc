"""The course as students and instructors meet it: JupyterLab in a real browser.

`make lab` (the README's main command, headless) serves a fresh copy of course/; Debian's Chromium,
driven by Playwright for Python, opens module 02, checks that its diagram is drawn, runs its cells up to the ScalingConfig
widget, moves the workers slider and checks that the kernel-side ScalingConfig follows. Then, for modules 03, 04, 06
and 07, it runs the cells each module's widget needs, moves a control, checks what the widget shows and what the
kernel reads. Last it opens nbgrader's Assignment List as a student, who has no instructor tools, and the Formgrader
in `make lab-instructor`. Screenshots go to build/browser/.

`make browser` (run by `make test`) installs what it needs: Playwright from tests/browser/requirements.txt into
the venv and Debian's Chromium with apt-get (when /usr/bin/chromium is missing); `playwright install` (Playwright's
own browser download) is not used. The test installs nothing: it is skipped, saying why, when either is missing.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import time
import urllib.request
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace

import nbformat
import pytest

from coursekit.distributed import free_port
from helpers import REPO, read_pins, stop_process_group, wait_for_server

pytestmark = pytest.mark.slow

CHROMIUM = "/usr/bin/chromium"
REQUIREMENTS = Path(__file__).parent / "browser" / "requirements.txt"
SHOTS = REPO / "build" / "browser"
MODULE = "02_ray_train"
COURSE_ID = "ray-train-course"
WIDGET_ERRORS = re.compile(r"Error displaying widget|model not found", re.I)


# ------------------------------------------------------------------ what `make browser` installed

def missing_tools() -> str | None:
    """Why the browser test cannot run here (Chromium or the pinned Playwright is missing), or None."""
    wanted = read_pins(REQUIREMENTS)["playwright"]
    try:
        have = metadata.version("playwright")
    except metadata.PackageNotFoundError:
        have = None
    if have != wanted:
        return (f"Playwright {wanted} is not installed in this venv ({have or 'none'} is): run `make browser` "
                "(make test does)")
    if not Path(CHROMIUM).exists():
        return (f"{CHROMIUM} is missing: run `make browser` (make test does), which installs Debian's chromium "
                "with apt-get as root or through sudo -n")
    return None


@pytest.fixture(scope="session")
def browser():
    why = missing_tools()
    if why:
        pytest.skip(f"browser test: {why}")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True)
        yield b
        b.close()


# ------------------------------------------------------------------ the course's JupyterLab

def _grading_setup(work: Path, course: Path) -> Path:
    """nbgrader for the instructor: a course root with module 02 in its gradebook (as
    tests/test_grading_release.py builds it), under the lab's root as formgrader requires, and
    module 02 released to an exchange for the Assignment List. Returns the config folder."""
    from autograder.grade import prepare

    prepare(course / "grading", [MODULE])               # course root: course/grading/nbgrader
    shutil.copytree(course / MODULE, work / "exchange" / COURSE_ID / "outbound" / MODULE)
    (work / "nbgrader_cache").mkdir()
    config = work / "jupyter_config"
    config.mkdir()
    (config / "nbgrader_config.py").write_text("\n".join([
        "c = get_config()  # noqa: F821",
        f"load_subconfig({str(course / 'grading' / 'nbgrader' / 'nbgrader_config.py')!r})  # noqa: F821",
        f"c.CourseDirectory.course_id = {COURSE_ID!r}",
        f"c.Exchange.root = {str(work / 'exchange')!r}",
        f"c.Exchange.cache = {str(work / 'nbgrader_cache')!r}",
        ""]))
    return config


def _lab_settings(work: Path) -> Path:
    """Private JupyterLab settings: every notebook cell in the DOM (no windowing), no news prompt."""
    settings = work / "lab_settings"
    for plugin, values in {
            "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"},
            "@jupyterlab/apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
    }.items():
        f = settings / f"{plugin}.jupyterlab-settings"
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(json.dumps(values))
    return settings


def _stop(proc, get) -> None:
    with contextlib.suppress(Exception):         # shut kernels down first: the kernel's atexit stops its Ray
        for kernel in json.loads(get("/api/kernels")):
            get(f"/api/kernels/{kernel['id']}", method="DELETE")
    stop_process_group(proc)


def _serve(work: Path, config: Path, target: str, root: Path):
    """`make TARGET` (lab or lab-instructor) headless in ``work``; yields what the tests need, then stops it."""
    port, token = free_port(), "course-browser-token"
    env = {**os.environ, "COURSE_SIZE": "smoke",
           "LAB_ARGS": f"--no-browser --port={port} --IdentityProvider.token={token} "
                       "--ServerApp.open_browser=False",
           "JUPYTER_CONFIG_PATH": str(config),
           "JUPYTERLAB_SETTINGS_DIR": str(_lab_settings(work)),
           "JUPYTERLAB_WORKSPACES_DIR": str(work / f"workspaces-{target}")}
    log = work / f"{target}.log"
    with log.open("wb") as out:                  # a file, not a pipe: a long session must not block on it
        proc = subprocess.Popen(["make", "-f", str(REPO / "Makefile"), target], cwd=work, env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    proc.stdout = log.open("rb")                 # wait_for_server shows the server's output from here
    base = f"http://127.0.0.1:{port}"

    def get(path, method="GET"):
        req = urllib.request.Request(base + path, method=method, headers={"Authorization": f"token {token}"})
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.read().decode()

    t0 = time.time()
    wait_for_server(get, proc, f"JupyterLab (make {target})", lambda p: _stop(p, get), timeout_s=180)
    print(f"\nmake {target} answered in {time.time() - t0:.0f} s")
    yield SimpleNamespace(base=base, token=token, get=get, course=root / "course", log=log)
    _stop(proc, get)
    proc.stdout.close()


@pytest.fixture(scope="module")
def lab_work(tmp_path_factory):
    """A fresh copy of course/ (running cells must not write into course/), with the instructor's nbgrader set-up."""
    work = tmp_path_factory.mktemp("browser_lab")
    for name in (".venv", "requirements.txt", "pyproject.toml"):    # what `make lab` checks
        (work / name).symlink_to(REPO / name)
    course = work / "course"
    shutil.copytree(REPO / "course", course, ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__"))
    return work, _grading_setup(work, course)


@pytest.fixture(scope="module")
def lab(lab_work):
    """`make lab`: the student's JupyterLab on the copy of course/."""
    work, config = lab_work
    yield from _serve(work, config, "lab", work)


@pytest.fixture(scope="module")
def instructor_lab(lab_work):
    """`make lab-instructor`: the same folder with nbgrader's instructor tools."""
    work, config = lab_work
    yield from _serve(work, config, "lab-instructor", work)


@pytest.fixture(scope="module")
def context(browser, lab):
    ctx = browser.new_context(viewport={"width": 1400, "height": 1000})
    ctx.set_default_timeout(60_000)
    page = ctx.new_page()                         # the token in the URL once; the cookie does the rest
    page.goto(f"{lab.base}/lab?token={lab.token}")
    page.close()
    yield ctx
    ctx.close()


@contextlib.contextmanager
def screenshot_on_failure(page, name: str):
    try:
        yield
    except BaseException:
        SHOTS.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(Exception):
            page.screenshot(path=str(SHOTS / f"FAILED-{name}.png"), full_page=True)
        raise


def shot(target, name: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    target.screenshot(path=str(SHOTS / f"{name}.png"))


def open_lab(context, lab, path: str = ""):
    page = context.new_page()
    page.goto(f"{lab.base}/lab/{path}")
    page.locator("#jp-main-statusbar").wait_for()
    return page


# ------------------------------------------------------------------ a notebook in the lab

def _cell_index(notebook: Path, pattern: str) -> int:
    nb = nbformat.read(notebook, as_version=4)
    hits = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and re.search(pattern, c.source, re.M)]
    assert len(hits) == 1, f"{notebook.name}: {len(hits)} code cells match {pattern!r}"
    return hits[0]


class Notebook:
    """A course notebook open in JupyterLab, its cells run one by one."""

    def __init__(self, context, lab, module: str):
        self.lab, self.path, self.added = lab, lab.course / module / f"{module}.ipynb", []
        # a workspace of its own: only this notebook is open (the lab's default workspace reopens the last ones)
        self.page = open_lab(context, lab, f"workspaces/{module.replace('_', '-')}/tree/{module}/{module}.ipynb")
        self.cells = self.page.locator(".jp-NotebookPanel .jp-Notebook .jp-Cell")
        from playwright.sync_api import expect

        expect(self.cells).to_have_count(len(nbformat.read(self.path, as_version=4).cells), timeout=60_000)
        expect(self.page.locator("#jp-main-statusbar").get_by_text("Idle")).to_be_visible(timeout=120_000)

    def run(self, *patterns: str, timeout_s: float = 240) -> int:
        """Run the cells that match ``patterns``, in order; returns the last one's index."""
        return self.run_cells([_cell_index(self.path, p) for p in patterns], timeout_s)

    def run_cells(self, indices: list[int], timeout_s: float = 240) -> int:
        """Run the cells of these (notebook) indices, in order; returns the last one's index in the page."""
        indices = [self._in_dom(i) for i in indices]
        for i in indices:
            self.cells.nth(i).locator(".jp-InputPrompt").click()
            self.page.keyboard.press("Escape")
            self.page.keyboard.press("Shift+Enter")
        deadline = time.time() + timeout_s
        for i in indices:                              # fail at once on an error, not at the timeout
            while re.search(r"\*", self.cells.nth(i).locator(".jp-InputPrompt").inner_text()):
                self._no_error(i)
                assert time.time() < deadline, f"cell {i} still running after {timeout_s} s"
                self.page.wait_for_timeout(1000)
            self._no_error(i)
        assert not WIDGET_ERRORS.search(self.page.locator("#main").inner_text())
        return indices[-1]

    def _in_dom(self, index: int) -> int:
        """A cell's index in the page: the notebook's, moved down by the cells ``ask`` added above it."""
        for added in sorted(self.added):
            index += added <= index
        return index

    def _no_error(self, i: int) -> None:
        text = "\n".join(self.cells.nth(i).locator(".jp-OutputArea-output").all_inner_texts())
        if "Traceback" in text or re.search(r"^\w*(Error|Exception)\b", text, re.M):
            self.cells.nth(i).scroll_into_view_if_needed()
            pytest.fail(f"cell {i} failed:\n{text}")

    def ask(self, below: int, code: str, expected: str, timeout_ms: int = 60_000) -> None:
        """A new cell under cell ``below`` runs ``code``; its output must contain ``expected``."""
        from playwright.sync_api import expect

        self.cells.nth(below).locator(".jp-InputPrompt").click()
        self.page.keyboard.press("Escape")
        self.page.keyboard.press("b")
        self.page.keyboard.press("Enter")
        self.page.keyboard.type(code)
        self.page.keyboard.press("Shift+Enter")
        self.added.append(below + 1)
        expect(self.cells.nth(below + 1).locator(".jp-OutputArea-output")).to_contain_text(expected,
                                                                                         timeout=timeout_ms)

    def close(self) -> None:
        self.page.close()
        with contextlib.suppress(Exception):            # its kernel (and the kernel's Ray) stop too
            for kernel in json.loads(self.lab.get("/api/kernels")):
                self.lab.get(f"/api/kernels/{kernel['id']}", method="DELETE")


def _slider(widget, name: str):
    slider = widget.locator(".widget-slider", has_text=name)
    return slider, slider.locator(".noUi-handle"), slider.locator(".widget-readout")


# ------------------------------------------------------------------ the tests

def _widget_cell(notebook: Path) -> tuple[int, str]:
    """Index of the cell that creates the ScalingConfigPicker, and the variable it is bound to."""
    nb = nbformat.read(notebook, as_version=4)
    for i, cell in enumerate(nb.cells):
        m = re.search(r"^(\w+)\s*=\s*ScalingConfigPicker\(", cell.source, re.M)
        if cell.cell_type == "code" and m:
            return i, m.group(1)
    raise AssertionError(f"{notebook.name} has no `x = ScalingConfigPicker(...)` cell")


def test_scaling_widget_renders_and_drives_the_kernel_side_config(context, lab):
    from playwright.sync_api import expect

    t0 = time.time()
    nb = Notebook(context, lab, MODULE)
    index, picker = _widget_cell(nb.path)
    with screenshot_on_failure(nb.page, "widget"):
        t_kernel = time.time()
        # Run the code cells from the top to the widget cell, as a student would (Shift+Enter each).
        code = [i for i, c in enumerate(nbformat.read(nb.path, as_version=4).cells[:index + 1]) if c.cell_type == "code"]
        nb.run_cells(code)
        widget = nb.cells.nth(index)
        slider = widget.locator(".widget-slider", has_text="num_workers")
        expect(slider).to_be_visible()
        t_widget = time.time()
        print(f"notebook open and kernel idle: {t_kernel - t0:.0f} s; cells 0-{index} run "
              f"(Ray started by init_ray) and widget shown: {t_widget - t_kernel:.0f} s")
        # the module's diagram (figures/*.svg beside the notebook) is served and drawn
        nb.page.wait_for_function("() => { const i = document.querySelector('img[src*=\"ray_train_architecture.svg\"]');"
                                  " return i !== null && i.complete && i.naturalWidth > 0; }", timeout=30_000)

        readout = slider.locator(".widget-readout")
        handle = slider.locator(".noUi-handle")
        before = int(readout.inner_text())
        top = float(handle.get_attribute("aria-valuemax"))
        key, after = ("ArrowRight", before + 1) if before < top else ("ArrowLeft", before - 1)
        widget.scroll_into_view_if_needed()
        shot(nb.page, "widget-before")

        handle.focus()
        nb.page.keyboard.press(key)
        expect(readout).to_have_text(str(after))
        # the summary line is written by the kernel (the picker observes the slider): it saw the change
        expect(widget.locator(".widget-html", has_text="worker")).to_contain_text(
            re.compile(rf"\b{after} (CPU|GPU) workers?\b"))

        # A new cell below the widget asks the kernel for the choice the notebook will train with.
        nb.ask(index, f"print('kernel-side num_workers:', {picker}.choice()['num_workers'])",
               f"kernel-side num_workers: {after}")
        assert not WIDGET_ERRORS.search(nb.page.locator("#main").inner_text())
        widget.scroll_into_view_if_needed()
        shot(nb.page, "widget-after")
        print(f"slider {before} -> {after} ({key}); kernel-side ScalingConfig.num_workers == {after}; "
              f"whole test {time.time() - t0:.0f} s")
    nb.close()


# ------------------------------------------------------------------ the other modules' widgets
# Each test opens its module in the lab, runs only the cells its widget needs (Shift+Enter on each, as a student
# would), moves one control, checks what the widget shows, and asks the kernel (in a new cell below the widget)
# for the value the code after the widget reads.

def test_module_03_cpu_split_refuses_a_stalling_split_and_the_kernel_plans_the_chosen_one(context, lab):
    from playwright.sync_api import expect

    nb = Notebook(context, lab, "03_ray_data")
    with screenshot_on_failure(nb.page, "widget-03"):
        index = nb.run(r"^import contextlib", r"^WORKERS = worker_resources", r"^split = DataSplitPicker\(")
        widget = nb.cells.nth(index)
        _, handle, readout = _slider(widget, "CPUs per training worker")
        workers = int(_slider(widget, "training workers")[2].inner_text())
        error = widget.locator(".widget-html", has_text="no task can make")
        for _ in range(12):                  # more CPU for training, until nothing is left for Ray Data
            if error.count():
                break
            before = readout.inner_text()
            handle.focus()
            nb.page.keyboard.press("ArrowRight")
            expect(readout).not_to_have_text(before)
            # the bar is redrawn by the kernel: it has seen the new value
            expect(widget).to_contain_text(f"training {workers * float(readout.inner_text()):g} + Ray Data")
        expect(error).to_be_visible()
        refused = float(readout.inner_text())
        shot(nb.page, "widget-03-refused")
        nb.ask(index, "print('kernel-side:', split.cpus_per_worker.value, 'no task can make' in split.problem())",
               f"kernel-side: {refused} True")
        handle.focus()
        nb.page.keyboard.press("ArrowLeft")  # one step back: it fits again
        expect(error).to_have_count(0)
        nb.ask(index + 1, "print('kernel-side plan:', split.plan().cpus_per_worker)",
               f"kernel-side plan: {refused - 0.25}")
        shot(nb.page, "widget-03")
    nb.close()


def test_module_04_fault_controls_predict_the_run_and_feed_its_run_config(context, lab):
    from playwright.sync_api import expect

    nb = Notebook(context, lab, "04_fault_tolerance")
    with screenshot_on_failure(nb.page, "widget-04"):
        index = nb.run(r"^import copy", r"^WORKERS = worker_resources", r"^FAULTS = FaultToleranceControls\(")
        widget = nb.cells.nth(index)
        summary = widget.locator(".widget-html", has_text="The run")
        expect(summary).to_contain_text("finishes")
        _, handle, readout = _slider(widget, "max_failures")
        handle.focus()
        nb.page.keyboard.press("ArrowLeft")       # 2 -> 1: two faults, one allowed
        expect(readout).to_have_text("1")
        expect(summary).to_contain_text("fails at failure 2 of 2")
        widget.locator(".widget-dropdown", has_text="checkpoint score").locator("select").select_option("accuracy")
        expect(summary).to_contain_text("highest accuracy")
        shot(nb.page, "widget-04")
        nb.ask(index, "print('kernel-side:', FAULTS.run_config_args(), FAULTS.expected()['finishes'])",
               "kernel-side: {'max_retries': 1, 'keep': 4, 'metric': 'accuracy', 'mode': 'max'} False")
    nb.close()


def test_module_06_zero_stage_shows_its_memory_and_the_run_config_reads_it(context, lab):
    from playwright.sync_api import expect

    nb = Notebook(context, lab, "06_deepspeed")
    with screenshot_on_failure(nb.page, "widget-06"):
        index = nb.run(r"^import contextlib", r"^WORKERS = worker_resources", r"^from coursekit.distributed import "
                       r"deepspeed_pytorch_ops_only", r"^def build_vit_from", r"^if RUN_TRAINING and not rt.local_mode",
                       r"^zero = ZeroPicker\(", timeout_s=300)
        widget = nb.cells.nth(index)
        summary = widget.locator(".widget-html", has_text="The run trains with")
        expect(summary).to_contain_text("ZeRO-3")
        widget.locator(".widget-toggle-buttons button", has_text=re.compile(r"^2$")).click()
        expect(summary).to_contain_text("ZeRO-2")
        widget.locator(".widget-checkbox", has_text="offload_optimizer").locator("input").check()
        expect(summary).to_contain_text("the optimizer on the host")
        shot(nb.page, "widget-06")
        config_cell = nb.run(r"^choice = picker.choice\(\)")   # the cell that builds the config
        nb.ask(config_cell, "print('kernel-side:', config['stage'], config['offload_optimizer'])",
               "kernel-side: 2 True")
    nb.close()


def test_module_07_planner_draws_bars_beside_the_measurement_and_follows_the_world_size(context, lab):
    from playwright.sync_api import expect

    from coursekit.memory import format_bytes
    from coursekit.planner import predict

    nb = Notebook(context, lab, "07_scaling_up")
    with screenshot_on_failure(nb.page, "widget-07"):
        setup = nb.run(r"^import difflib", r"^WORKERS = worker_resources")
        # the measured runs take minutes: the test gives the planner a measurement of its own (one DDP rank)
        nb.ask(setup, "planner_check = compare([{'strategy': 'ddp', 'world_size': 2, 'params': 4000, 'grads': 4000, "
                      "'optimizer': 8000}], 1000); print('measured:', len(planner_check))", "measured: 1")
        index = nb.run(r"^# the bars on the right|^planner = MemoryPlanner\(")
        widget = nb.cells.nth(index)
        expect(widget).to_contain_text("Measured on this machine")
        expect(widget).to_contain_text("ddp (N=2)")
        chart = widget.locator(".widget-html", has_text="Predicted, per rank")
        expect(chart).to_contain_text("8 ranks")
        _, handle, readout = _slider(widget, "world size")
        handle.focus()
        nb.page.keyboard.press("ArrowRight")
        expect(readout).to_have_text("9")
        zero3 = predict(300e6, 9, "zero3", "mixed")["device"]
        expect(chart).to_contain_text("9 ranks")
        expect(chart).to_contain_text(format_bytes(zero3))
        shot(nb.page, "widget-07")
        nb.ask(index, "print('kernel-side:', planner.world_size.value, round(planner.bars()['zero3']))",
               f"kernel-side: 9 {round(zero3)}")
    nb.close()


def _menu(page, menu: str, item: str) -> None:
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(rf"^{menu}$")).click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile(rf"^{item}$")).click()


def test_students_get_the_assignment_list_and_no_instructor_tools(context, lab):
    from playwright.sync_api import expect

    page = open_lab(context, lab)
    with screenshot_on_failure(page, "nbgrader-student"):
        page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Nbgrader$")).click()
        items = page.locator(".lm-Menu-itemLabel")
        expect(items.filter(has_text=re.compile(r"^Assignment List$"))).to_have_count(1)
        for tool in ("Formgrader", "Course List", "Create assignment"):
            expect(items.filter(has_text=re.compile(rf"^{tool}$"))).to_have_count(0)
        items.filter(has_text=re.compile(r"^Assignment List$")).click()
        panel = page.locator("#nbgrader-assignment-list")
        expect(panel.locator("#released_assignments_list")).to_contain_text(MODULE, timeout=60_000)
        expect(panel.locator("#released_assignments_list_error")).to_be_hidden()
        expect(panel.locator("#fetched_assignments_list_error")).to_be_hidden()
        expect(panel.locator("#submitted_assignments_list_error")).to_be_hidden()
        # no Create Assignment sidebar, no news prompt
        expect(page.locator("#nbgrader-create_assignemnt")).to_have_count(0)
        expect(page.get_by_text("official Jupyter news")).to_have_count(0)
        shot(page, "assignment-list")
    page.close()


def test_formgrader_loads_for_the_instructor(browser, instructor_lab):
    from playwright.sync_api import expect

    ctx = browser.new_context(viewport={"width": 1400, "height": 1000})
    ctx.set_default_timeout(60_000)
    page = ctx.new_page()
    page.goto(f"{instructor_lab.base}/lab?token={instructor_lab.token}")
    page.locator("#jp-main-statusbar").wait_for()
    with screenshot_on_failure(page, "nbgrader-instructor"):
        expect(page.locator("#nbgrader-create_assignemnt")).to_have_count(1)   # the Create Assignment sidebar
        _menu(page, "Nbgrader", "Formgrader")
        frame = page.frame_locator("#formgrader-iframe iframe")
        expect(frame.locator("body")).to_contain_text("Manage Assignments", timeout=60_000)
        row = frame.locator("tr", has_text=MODULE)                 # the course's assignment, from its gradebook
        expect(row.first).to_be_visible(timeout=60_000)
        # formgrader's error page (e.g. a course root outside the lab's root) says "encountered an error"
        expect(frame.locator("body")).not_to_contain_text("encountered an error", use_inner_text=True)
        shot(page, "formgrader")
    ctx.close()
