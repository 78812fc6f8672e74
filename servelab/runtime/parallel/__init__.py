"""Tensor parallelism (Megatron sharding) over torch.distributed.

- `sharding.py`: which slice of each weight a rank holds, and the rank's own shape (its heads,
  its slice of the MLP and of the vocabulary). Torch-free.
- `layers.py`: the layers that communicate (row-parallel linears, the vocab-parallel embedding
  and LM head), wrapped around the model's own linears after load.
- `group.py`: the process group and the worker processes' life cycle on rank 0; `worker.py`:
  what ranks 1..N-1 run.
- `kv_shards.py`: the group's KV cache as one whole, for a disaggregated KV transfer.

TP=1 imports none of this: the engine never touches torch.distributed then.
"""
