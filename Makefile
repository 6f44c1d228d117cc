# The course's commands. Each one bootstraps .venv from requirements.txt when it
# is missing or older than requirements.txt / pyproject.toml.
#
#   make lab          JupyterLab on course/ (students)
#   make test         the whole test suite (CI runs this)
#   make course       execute every solution notebook (CPU) into build/course, with timings
#   make assignments  regenerate course/ from solutions/ with nbgrader (MODULE=03_ray_data: one module)
#   make grade SUBMISSIONS=dir   autograde a folder (or LMS .zip) of submissions (instructors);
#                GRADE_ARGS="--jobs 2 --timeout 300 --students roster.txt" passes options
#   make release      the student-only copy in build/student-release, checked for answers and hidden tests
#   make bench        the performance harness -> bench/results.json, bench/RESULTS.md (about 40 min, quiet machine)

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.course-installed
KERNEL := ray-train-course
SUBMISSIONS ?= submissions
LAB_ARGS ?=
# JupyterLab refuses to run as root unless told; containers and CI machines often are root.
ROOT_ARGS := $(if $(filter 0,$(shell id -u)),--allow-root)

.PHONY: lab test course assignments grade release bench venv clean

venv: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	@# jsonschema's optional URI-syntax checker (rfc3987-syntax, pulled in by jupyter-events) compiles a grammar
	@# when imported: 1.5 s in every process that imports Ray (each Ray Train worker, controller and helper
	@# actor, every kernel). Nothing in the course validates URIs; without it jsonschema skips that format.
	$(PY) -m pip uninstall --quiet --yes rfc3987-syntax
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	@# the course kernel and the settings of nbgrader's Validate button
	$(PY) -m coursekit.jupyter_setup --sys-prefix
	@touch $(STAMP)

lab: $(STAMP)
	$(VENV)/bin/jupyter lab --notebook-dir=course $(ROOT_ARGS) $(LAB_ARGS)

test: $(STAMP)
	$(PY) -m pytest tests --durations=25

course: $(STAMP)
	$(PY) -m coursekit.notebooks solutions --out build/course

assignments: $(STAMP)
	$(PY) -m autograder.release $(if $(MODULE),--module $(MODULE))

grade: $(STAMP)
	$(PY) -m autograder.grade $(SUBMISSIONS) --out build/grading $(GRADE_ARGS)

release: $(STAMP)
	$(PY) -m autograder.student_release --into build/student-release

bench: $(STAMP)
	$(PY) -m bench

clean:
	rm -rf build
