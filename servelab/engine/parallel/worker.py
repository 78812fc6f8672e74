"""What tensor-parallel ranks 1..N-1 run: load this rank's shard, build its KV cache for its
heads, then run every forward rank 0 broadcasts until it broadcasts None."""

from __future__ import annotations

import os
import threading
import time
from typing import Any


def _exit_when_orphaned(parent: int) -> None:
    # a rank 0 killed outright cannot stop its workers; they must not linger in a collective
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def worker_main(
    rank: int, size: int, port: int, threads: int, path: str, dtype: Any, engine_args: Any, parent: int
) -> None:
    """`port`: rank 0's store (group.host_store)."""
    import torch

    from servelab.engine.kv_cache import PagedKVCache
    from servelab.engine.llm_engine import apply_model_options
    from servelab.engine.loader import load_model
    from servelab.engine.parallel.group import client_store, join_groups, receive_object
    from servelab.engine.parallel.layers import parallelize
    from servelab.engine.parallel.sharding import Shard

    threading.Thread(target=_exit_when_orphaned, args=(parent,), daemon=True).start()
    torch.set_num_threads(threads)
    groups = join_groups(rank, size, client_store(port))
    loaded = load_model(path, dtype=dtype, device=engine_args.device, tp_rank=rank, tp_size=size)
    model = loaded.model
    apply_model_options(model, engine_args)
    parallelize(model, Shard(loaded.spec, rank, size), groups.compute)

    message = receive_object(groups.control)
    if message is None:
        return
    num_blocks, block_size, kv_dtype, prefault = message
    kv = PagedKVCache(model.config, num_blocks, block_size, dtype=kv_dtype, device=engine_args.device, prefault=prefault)
    while (message := receive_object(groups.control)) is not None:
        ids, meta = message
        model.forward(ids, meta, kv.k_layers, kv.v_layers)
