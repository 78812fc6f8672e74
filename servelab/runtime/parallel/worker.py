"""What tensor-parallel ranks 1..N-1 run: load this rank's shard, build its KV cache for its
heads, then run every forward rank 0 broadcasts until it broadcasts None. A second thread
serves rank 0's KV exports and imports (kv_shards.py) meanwhile."""

from __future__ import annotations

import os
import threading
import time
import traceback
from typing import Any

import torch

from servelab.runtime.kv_cache import PagedKVCache
from servelab.runtime.loader import ModelOptions, load_model
from servelab.runtime.parallel.group import client_store, join_groups, receive_object
from servelab.runtime.parallel.kv_shards import serve_kv
from servelab.runtime.parallel.layers import parallelize
from servelab.runtime.parallel.sharding import Shard


def _exit_when_orphaned(parent: int) -> None:
    # a rank 0 killed outright cannot stop its workers; they must not linger in a collective
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def worker_main(
    rank: int,
    size: int,
    port: int,
    threads: int,
    path: str,
    dtype: Any,
    device: str,
    options: ModelOptions,
    parent: int,
) -> None:
    """`port`: rank 0's store (group.host_store)."""
    threading.Thread(target=_exit_when_orphaned, args=(parent,), daemon=True).start()
    torch.set_num_threads(threads)
    groups = join_groups(rank, size, client_store(port))
    kv_holder: list[Any] = []  # the cache, once built; rank 0 sends no KV command before that
    kv_built = threading.Event()
    kv_thread = threading.Thread(target=_serve_kv, args=(groups, kv_holder, kv_built), name="servelab-tp-kv",
                                 daemon=True)  # fmt: skip
    kv_thread.start()
    loaded = load_model(path, dtype=dtype, device=device, tp_rank=rank, tp_size=size)
    model = loaded.model
    options.apply(model)
    parallelize(model, Shard(loaded.spec, rank, size), groups.compute)

    message = receive_object(groups.control)
    if message is not None:
        num_blocks, block_size, kv_dtype, prefault = message
        kv = PagedKVCache(model.config, num_blocks, block_size, dtype=kv_dtype, device=device,
                          prefault=prefault)  # fmt: skip
        kv_holder.append(kv)
        kv_built.set()
        while (message := receive_object(groups.control)) is not None:
            ids, meta = message
            model.forward(ids, meta, kv.k_layers, kv.v_layers)
    kv_thread.join(timeout=5.0)  # rank 0 ended it first


def _serve_kv(groups: Any, kv_holder: list[Any], kv_built: threading.Event) -> None:
    try:
        first = receive_object(groups.kv_control)  # None (stop) or a command, which needs the cache
        if first is not None:
            kv_built.wait()
            serve_kv(groups, kv_holder[0], first)
    except Exception:  # rank 0 must not wait on this thread: the rank dies, and rank 0 says so (RankFailed)
        traceback.print_exc()
        os._exit(1)
