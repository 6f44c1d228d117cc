"""The exercises' visible checks, written once: the notebooks call them in your kernel (what Validate shows), and
the grader calls the same functions in its own process on the data your test cells handed in
(``coursekit.evidence``), together with its hidden checks. Every function here takes plain data (lists, numbers,
strings, tensors) and raises ``AssertionError`` with what was expected.

* ``ddp``: module 01 (``sharded_epochs``, ``train_step``, ``save_checkpoint``).
"""
