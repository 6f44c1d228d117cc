"""Realistic mistakes in module 02 (grade_id -> what a student might write)."""
WRONG = {
    # passes the global batch as the per-worker batch
    "worker_batch_size": "def worker_batch_size(global_batch_size):\n    return global_batch_size\n",
    # checkpoints on every rank
    "save_checkpoint_and_report": (
        "def save_checkpoint_and_report(model, metrics):\n"
        "    with tempfile.TemporaryDirectory() as tmp:\n"
        "        torch.save(getattr(model, 'module', model).state_dict(), os.path.join(tmp, 'model.pt'))\n"
        "        ray.train.report(metrics, checkpoint=Checkpoint.from_directory(tmp))\n"),
}
