"""Realistic mistakes in module 03 (grade_id -> what a student might write), and right answers written differently."""

# -- the train function: the reference with one line changed per mistake ---------------------------------------

_TRAIN_HEAD = (
    "def train_func(config):\n"
    "    torch.manual_seed(config['seed'])\n"
    "    model = ray.train.torch.prepare_model(build_model(config['model']))\n"
    "    optimizer = (torch.optim.SGD if config['optimizer'] == 'sgd' else torch.optim.Adam)(\n"
    "        model.parameters(), lr=config['lr'])\n"
    "    criterion = torch.nn.CrossEntropyLoss()\n"
    "    ctx = ray.train.get_context()\n"
)
_TRAIN_LOOP = (
    "    for epoch in range(config['epochs']):\n"
    "        total = torch.zeros(2)\n"
    "        for batch in shard.iter_torch_batches(batch_size=batch_size):\n"
    "            loss = criterion(model(batch['image']), batch['label'])\n"
    "            optimizer.zero_grad()\n"
    "            loss.backward()\n"
    "            optimizer.step()\n"
    "            total += torch.tensor([loss.item() * len(batch['label']), len(batch['label'])])\n"
    "        if dist.is_available() and dist.is_initialized():\n"
    "            dist.all_reduce(total)\n"
    "        save_checkpoint_and_report(model, {'epoch': epoch, 'loss': (total[0] / total[1]).item()})\n"
)


def _train(batch_size_line: str, shard_line: str = "    shard = ray.train.get_dataset_shard('train')\n",
           loop: str = _TRAIN_LOOP, before: str = "") -> str:
    return before + _TRAIN_HEAD + batch_size_line + shard_line + loop


# Pipelines whose rows are right and whose plan is wrong keep the rows check's point and lose the plan's.
ROWS_RIGHT = ("test_build_train_dataset_rows",)

WRONG = {
    # scales the pixels to [0, 1] but forgets the normalisation with mean/std 0.5
    "preprocess": (
        "def preprocess(batch):\n"
        "    out = dict(batch)\n"
        "    out['image'] = (np.asarray(batch['image'], dtype=np.float32) / 255.0)[:, None, :, :]\n"
        "    out['label'] = np.asarray(batch['label'], dtype=np.int64)\n"
        "    return out\n"),
    # map_batches without the stated resources: every task reserves 1 CPU, as many as the cluster allows
    "build_train_dataset": (
        "def build_train_dataset(parquet_dir, num_cpus, concurrency, batch_size):\n"
        "    ds = ray.data.read_parquet(parquet_dir)\n"
        "    return ds.map_batches(preprocess, batch_format='numpy', batch_size=batch_size)\n",
        ROWS_RIGHT),
    # hands the Dataset to the workers through train_loop_config instead of datasets=
    "make_trainer": (
        "def make_trainer(train_func, train_ds, train_loop_config, scaling_config, run_config, data_cpus):\n"
        "    return TorchTrainer(train_func, train_loop_config={**train_loop_config, 'train_ds': train_ds},\n"
        "                        scaling_config=scaling_config, run_config=run_config,\n"
        "                        dataset_config=DataConfig(execution_options=ExecutionOptions(\n"
        "                            resource_limits=ExecutionResources(cpu=data_cpus))))\n"),
    # passes the global batch to iter_torch_batches as if it were the per-worker batch
    "train_func": _train("    batch_size = config['global_batch_size']\n"),
}

MORE_WRONG = [
    {
        # normalises with MNIST's own mean and std instead of the course's 0.5 / 0.5
        "preprocess": (
            "def preprocess(batch):\n"
            "    out = dict(batch)\n"
            "    x = np.asarray(batch['image'], dtype=np.float32) / 255.0\n"
            "    out['image'] = ((x - 0.1307) / 0.3081)[:, None, :, :].astype(np.float32)\n"
            "    out['label'] = np.asarray(batch['label']).astype(np.int64)\n"
            "    return out\n"),
        # takes the resources from the notebook's plan instead of the arguments
        "build_train_dataset": (
            "def build_train_dataset(parquet_dir, num_cpus, concurrency, batch_size):\n"
            "    ds = ray.data.read_parquet(parquet_dir)\n"
            "    return ds.map_batches(preprocess, batch_format='numpy', batch_size=batch_size,\n"
            "                          num_cpus=plan.map_num_cpus,\n"
            "                          compute=ray.data.TaskPoolStrategy(size=plan.map_concurrency))\n",
            ROWS_RIGHT),
        # names the dataset after the variable: the workers' get_dataset_shard('train') finds nothing
        "make_trainer": (
            "def make_trainer(train_func, train_ds, train_loop_config, scaling_config, run_config, data_cpus):\n"
            "    limits = ExecutionOptions(resource_limits=ExecutionResources(cpu=data_cpus))\n"
            "    return TorchTrainer(train_func, train_loop_config=train_loop_config, scaling_config=scaling_config,\n"
            "                        run_config=run_config, datasets={'train_ds': train_ds},\n"
            "                        dataset_config=DataConfig(execution_options=limits))\n"),
        # divides the global batch by the workers of ONE node (local world size), not of the whole job
        "train_func": _train("    batch_size = config['global_batch_size'] // ctx.get_local_world_size()\n"),
    },
    {
        # keeps the 28x28 shape: no channel dimension for the CNN
        "preprocess": (
            "def preprocess(batch):\n"
            "    out = dict(batch)\n"
            "    out['image'] = ((np.asarray(batch['image'], dtype=np.float32) / 255.0 - 0.5) / 0.5)\n"
            "    out['label'] = np.asarray(batch['label']).astype(np.int64)\n"
            "    return out\n"),
        # materializes the data set: the whole data set is read and held before training starts
        "build_train_dataset": (
            "def build_train_dataset(parquet_dir, num_cpus, concurrency, batch_size):\n"
            "    ds = ray.data.read_parquet(parquet_dir)\n"
            "    ds = ds.map_batches(preprocess, batch_format='numpy', batch_size=batch_size, num_cpus=num_cpus,\n"
            "                        compute=ray.data.TaskPoolStrategy(size=concurrency))\n"
            "    return ds.materialize()\n",
            ROWS_RIGHT),
        # forgets the data config: Ray Data is not limited to the CPUs left by the training workers
        "make_trainer": (
            "def make_trainer(train_func, train_ds, train_loop_config, scaling_config, run_config, data_cpus):\n"
            "    return TorchTrainer(train_func, train_loop_config=train_loop_config, scaling_config=scaling_config,\n"
            "                        run_config=run_config, datasets={'train': train_ds})\n"),
        # every worker reads the WHOLE preprocessed data set (a global Dataset) instead of its shard
        "train_func": _train(
            "    batch_size = config['global_batch_size'] // ctx.get_world_size()\n",
            shard_line="    shard = full_train_ds\n",
            before="full_train_ds = ray.data.read_parquet(parquet_dir).map_batches(preprocess, batch_format='numpy')\n\n\n"),
    },
    {
        # the CPUs stated on the read instead of on the preprocessing step
        "build_train_dataset": (
            "def build_train_dataset(parquet_dir, num_cpus, concurrency, batch_size):\n"
            "    ds = ray.data.read_parquet(parquet_dir, num_cpus=num_cpus)\n"
            "    return ds.map_batches(preprocess, batch_format='numpy', batch_size=batch_size,\n"
            "                          compute=ray.data.TaskPoolStrategy(size=concurrency))\n",
            ROWS_RIGHT),
        # the notebook's own plan instead of data_cpus: right here, wrong for any other cluster
        "make_trainer": (
            "def make_trainer(train_func, train_ds, train_loop_config, scaling_config, run_config, data_cpus):\n"
            "    return TorchTrainer(train_func, train_loop_config=train_loop_config, scaling_config=scaling_config,\n"
            "                        run_config=run_config, datasets={'train': train_ds},\n"
            "                        dataset_config=plan.data_config())\n"),
        # the loss of this worker only (no all_reduce): each rank reports a different number
        # (the data and the model are right: it keeps the shard check's points)
        "train_func": (_train(
            "    batch_size = config['global_batch_size'] // ctx.get_world_size()\n",
            loop=_TRAIN_LOOP.replace("        if dist.is_available() and dist.is_initialized():\n"
                                     "            dist.all_reduce(total)\n", "")),
            ("test_train_func_shard",)),
    },
    {
        # preprocesses the (already preprocessed) batches again on the training workers
        "train_func": _train(
            "    batch_size = config['global_batch_size'] // ctx.get_world_size()\n",
            loop=_TRAIN_LOOP.replace("model(batch['image'])", "model((batch['image'] - 0.5) / 0.5)")),
        # preprocess applied twice (once in a read-time map, once more in map_batches)
        "build_train_dataset": (
            "def build_train_dataset(parquet_dir, num_cpus, concurrency, batch_size):\n"
            "    ds = ray.data.read_parquet(parquet_dir).map_batches(preprocess)\n"
            "    return ds.map_batches(preprocess, batch_format='numpy', batch_size=batch_size, num_cpus=num_cpus,\n"
            "                          compute=ray.data.TaskPoolStrategy(size=concurrency))\n"),
    },
    {
        # reads only the first Parquet file of the folder (one file in the notebook's small runs, several in real ones)
        "build_train_dataset": (
            "def build_train_dataset(parquet_dir, num_cpus, concurrency, batch_size):\n"
            "    first = sorted(Path(parquet_dir).glob('*.parquet'))[0]\n"
            "    return ray.data.read_parquet(str(first)).map_batches(\n"
            "        preprocess, batch_format='numpy', batch_size=batch_size, num_cpus=num_cpus,\n"
            "        compute=ray.data.TaskPoolStrategy(size=concurrency))\n",
            ROWS_RIGHT),
        # drops the last, smaller batch of every epoch
        # (the losses it reports are right for the batches it used: it keeps the report check's point)
        "train_func": (_train(
            "    batch_size = config['global_batch_size'] // ctx.get_world_size()\n",
            loop=_TRAIN_LOOP.replace("iter_torch_batches(batch_size=batch_size)",
                                     "iter_torch_batches(batch_size=batch_size, drop_last=True)")),
            ("test_train_func_report",)),
    },
]

RIGHT = {
    # the idiomatic Ray Data style: replace the batch's entries and return it; x / 127.5 - 1 == (x / 255 - 0.5) / 0.5
    "preprocess": (
        "def preprocess(batch):\n"
        "    batch['image'] = (batch['image'][:, np.newaxis, :, :].astype(np.float32) / 127.5 - 1.0).astype('float32')\n"
        "    batch['label'] = batch['label'].astype('int64')\n"
        "    return batch\n"),
    # a list of files, the older `concurrency=` spelling, a wrapper function and the default batch format
    "build_train_dataset": (
        "import glob\n\n"
        "def build_train_dataset(parquet_dir, num_cpus, concurrency, batch_size):\n"
        "    files = sorted(glob.glob(os.path.join(parquet_dir, '*.parquet')))\n"
        "    def prep(batch):\n"
        "        return preprocess(batch)\n"
        "    return ray.data.read_parquet(files).map_batches(\n"
        "        prep, batch_size=batch_size, concurrency=concurrency, num_cpus=num_cpus)\n"),
    # keyword arguments in another order, a per-dataset execution options dict, ExecutionResources.for_limits
    "make_trainer": (
        "def make_trainer(train_func, train_ds, train_loop_config, scaling_config, run_config, data_cpus):\n"
        "    options = ExecutionOptions(resource_limits=ExecutionResources.for_limits(cpu=data_cpus))\n"
        "    cfg = ray.train.DataConfig(datasets_to_split='all', execution_options={'train': options})\n"
        "    return ray.train.torch.TorchTrainer(\n"
        "        train_loop_per_worker=train_func, datasets=dict(train=train_ds), dataset_config=cfg,\n"
        "        run_config=run_config, scaling_config=scaling_config, train_loop_config=train_loop_config)\n"),
    # the shard fetched every epoch, dtypes and device stated, the world size from torch.distributed
    "train_func": (
        "def train_func(config):\n"
        "    torch.manual_seed(config['seed'])\n"
        "    net = build_model(config['model'])\n"
        "    net = ray.train.torch.prepare_model(net)\n"
        "    opt = {'sgd': torch.optim.SGD, 'adam': torch.optim.Adam}[config['optimizer']](net.parameters(), lr=config['lr'])\n"
        "    loss_fn = torch.nn.CrossEntropyLoss()\n"
        "    world = dist.get_world_size() if dist.is_initialized() else 1\n"
        "    device = ray.train.torch.get_device()\n"
        "    for epoch in range(config['epochs']):\n"
        "        net.train()\n"
        "        loss_sum, seen = 0.0, 0\n"
        "        shard = ray.train.get_dataset_shard('train')\n"
        "        batches = shard.iter_torch_batches(batch_size=config['global_batch_size'] // world,\n"
        "                                           dtypes={'image': torch.float32, 'label': torch.int64, 'id': torch.int64},\n"
        "                                           device=device)\n"
        "        for batch in batches:\n"
        "            x, y = batch['image'], batch['label']\n"
        "            out = net(x)\n"
        "            loss = loss_fn(out, y)\n"
        "            opt.zero_grad()\n"
        "            loss.backward()\n"
        "            opt.step()\n"
        "            loss_sum += float(loss) * y.shape[0]\n"
        "            seen += y.shape[0]\n"
        "        stats = torch.tensor([loss_sum, float(seen)], dtype=torch.float64, device=device)\n"
        "        if dist.is_initialized():\n"
        "            dist.all_reduce(stats, op=dist.ReduceOp.SUM)\n"
        "        save_checkpoint_and_report(net, {'epoch': epoch, 'loss': float(stats[0] / stats[1])})\n"),
}
