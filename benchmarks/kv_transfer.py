"""KV transfer between two processes on this host (gloo over loopback TCP): layer-by-layer
against block-by-block sends of one request's KV, for the bundled model's cache shape.

    PYTHONPATH=. python benchmarks/kv_transfer.py [--tokens 128,512,2048] [--repeats 7] [--quick]

Rank 0 sends (cluster/kv_transfer.send_blocks), rank 1 receives into its own paged cache; the
two granularities alternate within one run, and each figure is the median over the repeats of
the receiver's time (receives posted to the last piece written), after a barrier.
docs/disaggregation.md quotes the output.
"""

from __future__ import annotations

import argparse
import statistics
import time
from datetime import timedelta


def _run(rank: int, port: int, tokens: list[int], repeats: int, dtypes: list[str], results) -> None:
    import torch
    import torch.distributed as dist

    from servelab.cluster.kv_transfer import pair_groups, recv_blocks, send_blocks
    from servelab.runtime.kv_cache import PagedKVCache
    from servelab.spec.model import ModelSpec

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=120))  # fmt: skip
    group = pair_groups([0], [1], 120.0)[1 - rank]
    # SmolLM2-135M: 30 layers, 3 KV heads of 64
    spec = ModelSpec("smollm2-135m", num_layers=30, hidden_size=576, num_heads=9, num_kv_heads=3, head_dim=64,
                     ffn_size=1536, vocab_size=49152, tie_embeddings=True, max_context=8192, rope_theta=1e5)  # fmt: skip
    block_size = 16
    rows = []
    tag = 16
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        kv = PagedKVCache(spec, max(tokens) // block_size + 8, block_size, dtype=dtype, prefault=True)
        for n in tokens:
            blocks = list(range(1, n // block_size + 1))
            times: dict[str, list[float]] = {"layer": [], "block": []}
            for _ in range(repeats):
                for granularity in ("layer", "block"):
                    dist.barrier(group=group)
                    t0 = time.perf_counter()
                    if rank == 0:
                        num_bytes = send_blocks(kv, blocks, 1, tag=tag, granularity=granularity, group=group)
                    else:
                        num_bytes = recv_blocks(kv, blocks, 0, tag=tag, granularity=granularity, group=group)
                    times[granularity].append(time.perf_counter() - t0)
                    tag += 1
            if rank == 1:
                layer, block = statistics.median(times["layer"]), statistics.median(times["block"])
                rows.append((dtype_name, n, num_bytes, layer, block))
    if rank == 1:
        results.put(rows)
    dist.barrier(group=group)


def main(argv: list[str] | None = None) -> None:
    import torch.multiprocessing as mp

    from servelab.runtime.parallel.group import free_port

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="128,512,2048")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dtypes", default="float32,float16")
    parser.add_argument("--quick", action="store_true", help="128 fp32 tokens, once (a smoke test)")
    args = parser.parse_args(argv)
    if args.quick:
        args.tokens, args.repeats, args.dtypes = "128", 1, "float32"
    tokens = [int(t) for t in args.tokens.split(",")]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_run, args=(r, port, tokens, args.repeats, args.dtypes.split(","), results))
             for r in range(2)]  # fmt: skip
    for p in procs:
        p.start()
    rows = results.get(timeout=600)
    for p in procs:
        p.join()
    print(
        f"{'kv dtype':>9} {'tokens':>7} {'MiB':>7} {'layer ms':>9} {'block ms':>9} {'block/layer':>11} {'layer GB/s':>10}"
    )
    for dtype, n, num_bytes, layer, block in rows:
        print(f"{dtype:>9} {n:>7} {num_bytes / 2**20:>7.1f} {layer * 1e3:>9.1f} {block * 1e3:>9.1f} "
              f"{block / layer:>11.2f} {num_bytes / layer / 1e9:>10.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
