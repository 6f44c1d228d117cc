"""Submissions that attack the grading from inside the kernel, each beside the same honest wrong answers.

Every tamper is code a student could put at the top of an answer cell (it then runs before every test cell):
the kinds that gained points when every verdict came from the kernel (see autograder/checks/__init__.py). The
honest student answers every concept question wrongly and every exercise with a realistic mistake
(tests/mistakes/01_ddp_pytorch.py's WRONG); each tamper student does the same plus the tamper. Graded outside the
kernel, no tamper may score more than the honest student.
"""
from __future__ import annotations

TAMPERS = {
    # rewriting later cells before they run: every test cell becomes `pass`, or has its statements wrapped
    "input_transformer": '''
ip = get_ipython()
_marks = ("record_answer(", "hand_in", "checks.", "assert ")   # the test cells, then and now
ip.input_transformers_post.append(lambda lines: ["pass\\n"] if any(m in l for l in lines for m in _marks) else lines)
''',
    "ast_transformer": '''
import ast as _ast
class _Swallow(_ast.NodeTransformer):
    def visit_Module(self, node):
        node.body = [_ast.Try(body=[s], handlers=[_ast.ExceptHandler(type=None, name=None, body=[_ast.Pass()])],
                              orelse=[], finalbody=[]) for s in node.body]
        return _ast.fix_missing_locations(node)
get_ipython().ast_transformers.append(_Swallow())
''',
    # forging the result: the cell's error cleared before the reply is built; error messages dropped
    "post_run_cell": '''
def _clear(result):
    result.error_in_exec = None
    result.error_before_exec = None
get_ipython().events.register("post_run_cell", _clear)
''',
    "session_send": '''
from ipykernel.kernelbase import Kernel as _K
_kernel = get_ipython().kernel
_send = _kernel.session.send
def _forged(stream, msg_or_type, content=None, *args, **kwargs):
    if msg_or_type == "error":
        return None
    if isinstance(content, dict) and content.get("status") == "error":
        content = {"status": "ok", "execution_count": content.get("execution_count"), "user_expressions": {},
                   "payload": []}
    return _send(stream, msg_or_type, content, *args, **kwargs)
_kernel.session.send = _forged
''',
    # replacing what the checks call: the helpers rebound, their code replaced
    "rebind_helpers": '''
import coursekit.testing, coursekit.testing.concepts
_ok = lambda *args, **kwargs: print("answer recorded")
coursekit.testing.record_answer = coursekit.testing.concepts.record_answer = _ok
coursekit.testing.check_concept = coursekit.testing.concepts.check_concept = _ok
record_answer = check_concept = _ok
''',
    "replace_code": '''
import coursekit.testing.concepts as _c
_c.answer_problem.__code__ = (lambda answer, several: None).__code__
_c.check_concept.__code__ = (lambda answer, expected, why: None).__code__
_c.letters.__code__ = (lambda answer: frozenset("a")).__code__
''',
    # forging the evidence: every cell's data handed in from the answer cell, with every letter
    "forge_evidence": '''
import coursekit.evidence as _e
for _gid in ("test_concept_ddp_start", "test_concept_sampler_seed", "test_concept_equal_shards",
             "test_concept_rank0_save"):
    _e.hand_in(_gid, answer="a b c d")
_e.hand_in.__code__ = (lambda grade_id, **data: None).__code__
''',
    # the visible checks of the exercises made no-ops (in this kernel, and in every rank forked from it)
    "replace_checks": '''
import coursekit.exercise_checks.ddp as _checks, types as _types
for _name, _f in list(vars(_checks).items()):
    if isinstance(_f, _types.FunctionType) and _name.startswith("check_"):
        _f.__code__ = (lambda *args, **kwargs: None).__code__
''',
    # the hidden inputs the grader asks for never run: only the notebook's own cases are handed in
    "skip_hidden": '''
import coursekit.evidence as _e
_e.asked.__code__ = (lambda grade_id: []).__code__
''',
    # knowing it is graded, and looking for the keys where the grader keeps them
    "find_the_keys": '''
import os as _os, re as _re
_keys = {}
if _os.environ.get("COURSE_GRADING"):
    for _root in (_os.getcwd(), _os.environ.get("PYTHONPATH", "/")):
        for _dir, _subdirs, _files in _os.walk(_root):
            if "concepts.py" in _files and "checks" in _dir:
                _text = open(_os.path.join(_dir, "concepts.py")).read()
                _keys.update(_re.findall(r"'(test_concept_\\w+)': \\('([a-d ,]+)'", _text))
            if _dir.count(_os.sep) > 6:
                _subdirs[:] = []
''',
}

# the tampers whose answers read what they found: (concept answer cell -> expression over the tamper's names)
READS_KEYS = {"find_the_keys"}
