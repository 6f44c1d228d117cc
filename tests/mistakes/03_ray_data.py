"""Realistic mistakes in module 03 (grade_id -> what a student might write)."""
WRONG = {
    # forgets that shards split the data: every worker "sees" the whole data set
    "epoch_plan": (
        "def epoch_plan(num_rows, world_size, global_batch_size):\n"
        "    batch = global_batch_size // world_size\n"
        "    return {'rows_per_worker': num_rows, 'batch_per_worker': batch,\n"
        "            'steps_per_epoch': math.ceil(num_rows / batch)}\n"),
    # passes the global batch to iter_torch_batches as if it were the per-worker batch
    "train_func": (
        "def train_func(config):\n"
        "    torch.manual_seed(config['seed'])\n"
        "    model = ray.train.torch.prepare_model(build_model(config['model']))\n"
        "    optimizer = (torch.optim.SGD if config['optimizer'] == 'sgd' else torch.optim.Adam)(\n"
        "        model.parameters(), lr=config['lr'])\n"
        "    criterion = torch.nn.CrossEntropyLoss()\n"
        "    shard = ray.train.get_dataset_shard('train')\n"
        "    for epoch in range(config['epochs']):\n"
        "        total = torch.zeros(2)\n"
        "        for batch in shard.iter_torch_batches(batch_size=config['global_batch_size']):\n"
        "            loss = criterion(model(batch['image']), batch['label'])\n"
        "            optimizer.zero_grad()\n"
        "            loss.backward()\n"
        "            optimizer.step()\n"
        "            total += torch.tensor([loss.item() * len(batch['label']), len(batch['label'])])\n"
        "        if dist.is_available() and dist.is_initialized():\n"
        "            dist.all_reduce(total)\n"
        "        save_checkpoint_and_report(model, {'epoch': epoch, 'loss': (total[0] / total[1]).item()})\n"),
}
