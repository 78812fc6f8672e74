"""The model runtime: the model over its paged KV cache, the weights that build it, and the kernels
it runs on. Given token ids and attention metadata, it returns logits; the step loop, the
tokenizer and sampling belong to servelab.engine, which this package never imports.

- `model.py`: the Llama-family model; `ops.py`, `linear.py`, `quantization.py`, `block_quant.py`,
  `decode_stack.py`: the kernels it calls, chosen once per host; `native.py` builds them from `csrc/`.
- `loader.py`, `weight_layout.py`, `weights.py`: from a GGUF file or an HF directory to a model.
- `kv_cache.py`: the paged KV cache. `host_probe.py`: this host measured as the cost model sees an
  accelerator (memory, bandwidth, matmul rates).
- `parallel/`: tensor parallelism (Megatron sharding over torch.distributed).
"""
