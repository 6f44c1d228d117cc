"""Realistic mistakes in module 04 (grade_id -> what a student might write)."""
WRONG = {
    # saves only the weights and the epoch: the optimizer (Adam's moments) and the RNG restart from zero
    "training_state": (
        "STATE_FILE = 'state.pt'\n"
        "def save_training_state(directory, model, optimizer, epoch):\n"
        "    torch.save({'model': getattr(model, 'module', model).state_dict(), 'epoch': epoch},\n"
        "               os.path.join(directory, STATE_FILE))\n"
        "def load_training_state(directory, model, optimizer):\n"
        "    state = torch.load(os.path.join(directory, STATE_FILE), map_location='cpu', weights_only=True)\n"
        "    getattr(model, 'module', model).load_state_dict(state['model'])\n"
        "    return state['epoch']\n"),
    # resumes AT the saved epoch: the epoch that had finished is trained twice
    "resume": (
        "def resume(model, optimizer):\n"
        "    checkpoint = ray.train.get_checkpoint()\n"
        "    if checkpoint is None:\n"
        "        return 0\n"
        "    with checkpoint.as_directory() as d:\n"
        "        return load_training_state(d, model, optimizer)\n"),
    # keeps the 3 *highest* losses: checkpoint_score_order left at its default, "max"
    "choose_configs": (
        "def choose_configs():\n"
        "    return FailureConfig(max_failures=5), CheckpointConfig(num_to_keep=3, checkpoint_score_attribute='val_loss')\n"),
}
