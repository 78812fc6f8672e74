"""Engine workers in separate processes (or hosts) behind one API front end.

- `channel.py`: the rendezvous (torch.distributed, gloo) and one `Link` per front-end/worker
  pair carrying pickled control messages, with timeouts on every send and receive.
- `messages.py`: what travels on a link (requests, aborts, outputs, stats, heartbeats).
- `worker.py`: what a worker process runs: an LLMEngine and its step loop, fed by its link.
- `front_end.py`: `ClusterEngine`, the server's engine driver (AsyncEngine's interface) that
  routes each request to a worker with servelab.sim.router and streams the outputs back.
- `launch.py`: starts local workers (or waits for external ones), hands them the engine
  configuration and builds the front end.

docs/multi-worker.md describes the design, the flags and the failure behaviour.
"""
