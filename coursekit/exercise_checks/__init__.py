"""The exercises' visible checks, written once: the notebooks call them in your kernel (what Validate shows), and
the grader calls the same functions in its own process on the data your test cells handed in
(``coursekit.evidence``), together with its hidden checks. Every function here takes plain data (lists, numbers,
strings, tensors) and raises ``AssertionError`` with what was expected.

* ``ddp``: module 01 (``sharded_epochs``, ``train_step``, ``save_checkpoint``);
* ``ray_train``: module 02 (``scaling_config_for``, ``train_func``, ``build_trainer``, ``load_model``);
* ``ray_data``: module 03 (``preprocess``, ``build_train_dataset``, ``make_trainer``, ``train_func``);
* ``fault_tolerance``: module 04 (the training state saved and loaded, ``resume``, ``make_run_config``,
  ``build_tuner``);
* ``fsdp``: module 05 (``setup_fsdp``, the sharded save, restore and export, ``build_on_meta``, ``shard_hybrid``);
* ``deepspeed``: module 06 (``build_engine``, ``train_micro_batches``, the checkpoint saved and restored);
  ``deepspeed_runs``: the runs its test cells hand in (your functions on forked ranks, beside DDP's);
* ``capstone``: module 07 (the capstone's ``train_func``).
"""
