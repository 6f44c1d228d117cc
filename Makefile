# The course's commands. Each one bootstraps .venv when it is missing or older than its
# requirements: `make lab` installs the course set (requirements.txt); the test, grading and
# instructor commands add the test and lint tools (requirements-dev.txt) on top.
#
#   make lab          JupyterLab on course/, as students see it (Validate and the Assignment List; no instructor tools)
#   make lab-instructor  JupyterLab on the repository root with nbgrader's instructor tools (Formgrader, Create
#                     Assignment, Course List), which see the course through ./nbgrader_config.py
#   make test         the linter and the whole test suite (CI runs this)
#   make test-fast    the linter and the tests not marked slow: the development loop (no notebooks, Ray runs,
#                     grading runs or servers; a few minutes)
#   make lint         ruff, with the rules in pyproject.toml
#   make course       execute every solution notebook (CPU) into build/course, with timings
#   make assignments  regenerate course/ from solutions/ with nbgrader (MODULE=03_ray_data: one module)
#   make grade SUBMISSIONS=dir   autograde a folder (or LMS .zip) of submissions (instructors);
#                GRADE_ARGS="--jobs 2 --timeout 300 --students roster.txt" passes options;
#                RAY_ADDRESS=auto (or HOST:PORT) grades on that Ray cluster, one task per submission
#   make release      the student-only copy in build/student-release, checked for answers and hidden tests
#                     (THROUGH=03_ray_data: modules 01-03 only, for a class that opens one module at a time)
#   make bench        the performance harness -> bench/results.json, bench/RESULTS.md (long: run it alone on a quiet machine)
#   make gpu-check    on a GPU machine: every notebook at the gpu size (short schedule), 07's FSDP2/ZeRO-3 scripts
#                     in bf16, NCCL on a CUDA mesh and grading of the reference, within 8 minutes; the report into
#                     build/gpu_check and the bench's gpu section (exit 2 without CUDA; GPU_CHECK_ARGS=--dry-run: the plan)
#   make mutants      mutation testing of the grader's checks (MODULE=05_fsdp2: one module; default all, hours):
#                     per exercise, the share of its reference answer's mutants caught -> the bench's mutants section

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.course-installed
DEV_STAMP := $(VENV)/.dev-installed
BROWSER_STAMP := $(VENV)/.browser-installed
KERNEL := ray-train-course
SUBMISSIONS ?= submissions
LAB_ARGS ?=
# JupyterLab refuses to run as root unless told; containers and CI machines often are root.
ROOT_ARGS := $(if $(filter 0,$(shell id -u)),--allow-root)
# the student's view (coursekit/student_view/README.md): put first on Jupyter's config path, before any the caller set
HERE := $(dir $(abspath $(lastword $(MAKEFILE_LIST))))
STUDENT_VIEW := JUPYTER_CONFIG_PATH=$(HERE)coursekit/student_view$(if $(JUPYTER_CONFIG_PATH),:$(JUPYTER_CONFIG_PATH))

.PHONY: jail browser lint lab lab-instructor gpu-check test test-fast course assignments grade release bench mutants venv clean

venv: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	@# jsonschema's optional URI-syntax checker (rfc3987-syntax, pulled in by jupyter-events) compiles a grammar
	@# when imported, a start-up delay paid by every process that imports Ray (each Ray Train worker, controller
	@# and helper actor, every kernel). Nothing in the course validates URIs; without it jsonschema skips that format.
	$(PY) -m pip uninstall --quiet --yes rfc3987-syntax
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	@# the course kernel and the settings of nbgrader's Validate button
	$(PY) -m coursekit.jupyter_setup --sys-prefix
	@touch $(STAMP)

# instructors and CI: the course set plus pytest, ruff, hadolint, papermill (requirements-dev.txt)
$(DEV_STAMP): requirements-dev.txt $(STAMP)
	$(PY) -m pip install --quiet -r requirements-dev.txt
	@# checking requirements.txt's dependencies again puts rfc3987-syntax back (see above)
	$(PY) -m pip uninstall --quiet --yes rfc3987-syntax
	@touch $(DEV_STAMP)

# bubblewrap, the jail of a submission's kernel while grading (autograder/contain.py): Debian's package, installed
# with apt-get when missing (as root or through sudo -n); without it grading still runs, unjailed, and says so.
jail: $(DEV_STAMP)
	@$(PY) -m autograder.paths --apt bubblewrap /usr/bin/bwrap

# the browser test's tools (tests/test_browser.py drives JupyterLab in Chromium): Playwright for Python, pinned in
# tests/browser/requirements.txt, into the venv once; Debian's Chromium with apt-get when missing (as root or through
# sudo -n; not `playwright install`, Playwright's own browser download). Without Chromium that test is skipped.
browser: $(BROWSER_STAMP)
	@$(PY) -m autograder.paths --apt chromium /usr/bin/chromium

$(BROWSER_STAMP): tests/browser/requirements.txt $(DEV_STAMP)
	$(PY) -m pip install --quiet -r tests/browser/requirements.txt
	@touch $(BROWSER_STAMP)

lint: $(DEV_STAMP)
	$(PY) -m ruff check --quiet .

lab: $(STAMP)
	$(STUDENT_VIEW) $(VENV)/bin/jupyter lab --notebook-dir=course $(ROOT_ARGS) $(LAB_ARGS)

lab-instructor: $(STAMP)
	$(VENV)/bin/jupyter lab --notebook-dir=. $(ROOT_ARGS) $(LAB_ARGS)

test: jail browser lint
	$(PY) -m pytest tests --durations=25

test-fast: jail lint
	$(PY) -m pytest tests -m "not slow"

course: $(DEV_STAMP)
	$(PY) -m coursekit.notebooks solutions --out build/course

assignments: $(DEV_STAMP)
	$(PY) -m autograder.release $(if $(MODULE),--module $(MODULE))

grade: jail
	$(PY) -m autograder.grade $(SUBMISSIONS) --out build/grading $(if $(RAY_ADDRESS),--address $(RAY_ADDRESS)) $(GRADE_ARGS)

release: $(DEV_STAMP)
	$(PY) -m autograder.student_release --into build/student-release $(if $(THROUGH),--through $(THROUGH))

bench: jail
	$(PY) -m bench

gpu-check: jail
	$(PY) -m bench.gpu_check $(GPU_CHECK_ARGS)

mutants: jail
	$(PY) -m bench --only mutants $(if $(MODULE),--modules $(MODULE))

clean:
	rm -rf build
