"""Python objects between the processes of a disaggregated cluster, over torch.distributed.

A message is pickled and sent as two tensors (its length, then its bytes) on the control
group, whose timeout is long because a receiver idles on it. One thread per peer receives
from that peer only (gloo notices a closed connection on a receive from a named peer, not on one
from any source) and puts `(src, message)` into the owner's inbox; a peer whose connection
broke arrives as `(src, PeerLost(why))`. Only the owner's main thread sends.
"""

from __future__ import annotations

import pickle
import queue
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

_LENGTH_TAG = 1
_BODY_TAG = 2
SEND_TIMEOUT_S = 60.0  # a peer that takes no message for this long is lost
IDLE_TIMEOUT = timedelta(days=30)  # the control group: a receiver waits this long for the next message


@dataclass(frozen=True, slots=True)
class PeerLost:
    why: str


class Channel:
    def __init__(self, peers: list[int], group: Any):
        self.group = group
        self.inbox: queue.Queue[tuple[int, Any]] = queue.Queue()
        self.closing = False
        for peer in peers:
            threading.Thread(target=self._receive_from, args=(peer,), name=f"servelab-recv-{peer}", daemon=True).start()

    def send(self, dst: int, message: Any) -> None:
        """Raises RuntimeError when `dst` cannot take it (dead, or stuck past SEND_TIMEOUT_S)."""
        body = torch.frombuffer(bytearray(pickle.dumps(message)), dtype=torch.uint8)
        length = torch.tensor([body.numel()], dtype=torch.int64)
        works = [dist.isend(length, dst, group=self.group, tag=_LENGTH_TAG),
                 dist.isend(body, dst, group=self.group, tag=_BODY_TAG)]  # fmt: skip
        for work in works:
            work.wait(timedelta(seconds=SEND_TIMEOUT_S))

    def _receive_from(self, src: int) -> None:
        while True:
            try:
                length = torch.zeros(1, dtype=torch.int64)
                dist.irecv(length, src, group=self.group, tag=_LENGTH_TAG).wait()
                body = torch.empty(int(length.item()), dtype=torch.uint8)
                dist.irecv(body, src, group=self.group, tag=_BODY_TAG).wait(timedelta(seconds=SEND_TIMEOUT_S))
                message = pickle.loads(body.numpy().tobytes())
            except Exception as exc:  # the connection broke, or the group was destroyed on close
                if not self.closing:
                    self.inbox.put((src, PeerLost(f"rank {src}: {exc}")))
                return
            self.inbox.put((src, message))
