"""Realistic mistakes in module 07 (grade_id -> what a student might write)."""
WRONG = {
    # counts blank and comment-only lines as changes (no filtering before the diff)
    "count_changed_lines": (
        "def count_changed_lines(before, after):\n"
        "    marks = [line[:2] for line in difflib.ndiff(before.splitlines(), after.splitlines())]\n"
        "    return {'added': marks.count('+ '), 'removed': marks.count('- ')}\n"),
    # forgets to divide the speedup by the number of workers: "efficiency" is the speedup
    "scaling_report": (
        "def scaling_report(step_ms, per_worker_batch, world_size, single_step_ms, single_batch):\n"
        "    samples_per_s = per_worker_batch * world_size / (step_ms / 1000)\n"
        "    speedup = samples_per_s / (single_batch / (single_step_ms / 1000))\n"
        "    return {'samples_per_s': samples_per_s, 'speedup': speedup, 'efficiency': speedup}\n"),
    # ignores the precision it is given (always plans for fp32)
    "cheapest_strategy": (
        "def cheapest_strategy(num_params, world_size, budget_bytes, precision='fp32'):\n"
        "    for strategy in PREFERENCE:\n"
        "        if predict(num_params, world_size, strategy)['device'] <= budget_bytes:\n"
        "            return strategy\n"
        "    raise ValueError('nothing fits: add ranks or offload')\n"),
}
