"""Engine workers in separate processes (or hosts) behind one API front end.

- `channel.py`: the rendezvous (torch.distributed, gloo) and one `Link` per front-end/worker
  pair carrying pickled control messages, with timeouts on every send and receive.
- `messages.py`: what travels on a link (requests, aborts, outputs, stats, heartbeats).
- `worker.py`: what a worker process runs: an LLMEngine and its step loop (`worker_loop.py`),
  fed by its link.
- `front_end.py`: `ClusterEngine`, the server's engine driver (AsyncEngine's interface) that
  routes each request to a worker with servelab.core.router and streams the outputs back.
- `launch.py`: starts local workers (or waits for external ones), hands them the engine
  configuration and builds the front end.
- Disaggregated prefill/decode (`serve --disagg P:D`): `disagg_config.py` (the pools, torch-free),
  `disagg_worker.py` (the prefill and decode roles of worker_loop.py's loop, and what they tell each
  other), `kv_transfer.py` (a request's KV blocks point-to-point, with a deadline).

docs/multi-worker.md describes the design, the flags and the failure behaviour;
docs/disaggregation.md the prefill/decode split.
"""
