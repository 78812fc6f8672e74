"""A tiny OpenAI-compatible streaming server with a known, controlled schedule, for testing the
load generator. Run as a separate process (so its event loop does not share a GIL with the
client under test): `python mock_openai_server.py --ttft-ms 50 --tpot-ms 20`; it prints
`PORT <n>` on stdout once listening.

Per request, relative to the moment the request body has been read:
  - chat only: a role-only chunk immediately (must NOT count as the first token),
  - output token k (k = 1..max_tokens) at ttft + (k - 1) * tpot, one token per chunk,
  - then a usage chunk and `data: [DONE]`.
With `--prefill-ms P`, prompts are prefilled one at a time, P each, before the TTFT delay: a
request's first token waits for the prefills queued ahead of it, as on a real server, so a burst
of simultaneous requests (a closed loop's start-up wave) sees TTFTs of P, 2P, ... while a steady
stream of spread-out arrivals sees about P.
With `--spec-tokens K`, GET /metrics exports vLLM's speculative-decoding counters (under
`--metrics-prefix`, default `vllm`) as if each output token had come from one verification step
of K drafted tokens, the j-th step of a request accepting j mod (K + 1) of them; the counters
move before a stream's [DONE], so a client that has read it sees them.
Behaviour switches, by a word in the prompt: FAIL -> HTTP 500; DROP -> the connection is closed
after 2 tokens; HANG -> nothing is ever sent; BADUSAGE -> usage reports one token too many.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time


class MockServer:
    def __init__(
        self,
        ttft_s: float,
        tpot_s: float,
        log_path: str | None,
        prefill_s: float = 0.0,
        spec_tokens: int = 0,
        metrics_prefix: str = "vllm",
    ) -> None:
        self.ttft_s = ttft_s
        self.spec_tokens = spec_tokens
        self.metrics_prefix = metrics_prefix
        self.num_drafts = self.num_draft_tokens = 0
        self.accepted_per_position = [0] * spec_tokens
        self.tpot_s = tpot_s
        self.prefill_s = prefill_s
        self.prefill_free_s = 0.0  # when the one prefill "unit" finishes its queue (perf_counter)
        # One JSON line per finished stream: what the server actually did, stamped with the same
        # system-wide monotonic clock (perf_counter) that the client uses.
        self.log = open(log_path, "a", buffering=1) if log_path else None

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:  # keep-alive: many requests per connection
                head = await reader.readuntil(b"\r\n\r\n")
                received_s = time.perf_counter()
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:] if ":" in ln)}
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                received_s = time.perf_counter()
                if method == "GET" and path == "/metrics" and self.spec_tokens:
                    self._text(writer, self._metrics())
                elif method == "GET" and path.endswith("/models"):
                    self._json(writer, 200, {"object": "list", "data": [{"id": "mock-model", "object": "model"}]})
                elif method == "POST" and path.endswith(("/completions", "/chat/completions")):
                    if not await self._complete(json.loads(body), path, received_s, writer):
                        return
                else:
                    self._json(writer, 404, {"error": {"message": f"no route {path}"}})
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    def _metrics(self) -> str:
        ns, labels = self.metrics_prefix, 'engine="0",model_name="mock-model"'
        lines = [
            f"# TYPE {ns}:spec_decode_num_drafts_total counter",
            f"{ns}:spec_decode_num_drafts_total{{{labels}}} {float(self.num_drafts)}",
            f"{ns}:spec_decode_num_drafts_created{{{labels}}} 1.7e9",
            f"{ns}:spec_decode_num_draft_tokens_total{{{labels}}} {float(self.num_draft_tokens)}",
            f"{ns}:spec_decode_num_accepted_tokens_total{{{labels}}} {float(sum(self.accepted_per_position))}",
        ]
        lines += [
            f'{ns}:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="{i}"}} {float(count)}'
            for i, count in enumerate(self.accepted_per_position)
        ]
        return "\n".join(lines) + "\n"

    def _record_drafts(self, num_steps: int) -> None:
        k = self.spec_tokens
        for step in range(num_steps):
            self.num_drafts += 1
            self.num_draft_tokens += k
            for i in range(step % (k + 1)):
                self.accepted_per_position[i] += 1

    def _request_drafts(self, n: int) -> dict:
        """servelab's usage.spec_decode for an n-token output, consistent with it: step s keeps
        s % (K + 1) drafts, as many as fit before the length limit; a step with no room drafts none."""
        k, produced, step = self.spec_tokens, 1, 0
        drafts = draft_tokens = 0
        per_position = [0] * k
        while produced < n:
            room, kept = min(k, n - produced - 1), 0
            if room > 0:
                drafts, draft_tokens, kept = drafts + 1, draft_tokens + room, min(step % (k + 1), room)
                for i in range(kept):
                    per_position[i] += 1
            produced, step = produced + kept + 1, step + 1
        return {"num_decode_steps": step, "num_drafts": drafts, "num_draft_tokens": draft_tokens,
                "num_accepted_tokens": sum(per_position), "accepted_per_position": per_position}  # fmt: skip

    def _text(self, writer: asyncio.StreamWriter, text: str) -> None:
        data = text.encode()
        writer.write(
            f"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data
        )

    def _json(self, writer: asyncio.StreamWriter, status: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        writer.write(
            f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode()
            + data
        )

    async def _complete(self, req: dict, path: str, received_s: float, writer: asyncio.StreamWriter) -> bool:
        chat = path.endswith("/chat/completions")
        prompt = req["messages"][-1]["content"] if chat else req["prompt"]
        n = int(req.get("max_tokens", 16))
        if "FAIL" in prompt:
            self._json(writer, 500, {"error": {"message": "injected failure", "type": "server_error"}})
            return True
        if "HANG" in prompt:
            await asyncio.sleep(3600)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")

        def event(obj: dict | str) -> None:
            data = ("data: " + (obj if isinstance(obj, str) else json.dumps(obj)) + "\n\n").encode()
            writer.write(b"%x\r\n%s\r\n" % (len(data), data))

        if chat:
            event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
            await writer.drain()
        first_s = received_s + self.ttft_s
        if self.prefill_s > 0:
            self.prefill_free_s = max(received_s, self.prefill_free_s) + self.prefill_s
            first_s = self.prefill_free_s + self.ttft_s
        write_times_s: list[float] = []
        loop = asyncio.get_running_loop()
        # Absolute deadlines, so one late wake-up does not shift every later token.
        offset = loop.time() - time.perf_counter()
        for k in range(n):
            due = first_s + k * self.tpot_s + offset
            delay = due - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            piece = f" tok{k}"
            if chat:
                event({"choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]})
            else:
                event({"choices": [{"index": 0, "text": piece, "finish_reason": None}]})
            await writer.drain()
            write_times_s.append(time.perf_counter())
            if "DROP" in prompt and k == 1:
                writer.transport.abort()
                return False
        reported = n + 1 if "BADUSAGE" in prompt else n
        usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": reported, "total_tokens": 0}
        if self.spec_tokens:
            usage["spec_decode"] = self._request_drafts(n)
        event({"choices": [], "usage": usage})
        if self.spec_tokens:
            self._record_drafts(n)
        event("[DONE]")
        writer.write(b"0\r\n\r\n")
        if self.log is not None:
            self.log.write(json.dumps({"prompt": prompt, "received_s": received_s, "token_s": write_times_s}) + "\n")
        return True


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--ttft-ms", type=float, default=50.0)
    parser.add_argument("--tpot-ms", type=float, default=20.0)
    parser.add_argument("--prefill-ms", type=float, default=0.0, help="serial prefill time per request")
    parser.add_argument("--log", default=None, help="JSONL file of the server-side timestamps")
    parser.add_argument("--spec-tokens", type=int, default=0, help="export spec-decode counters, K drafts a step")
    parser.add_argument("--metrics-prefix", default="vllm", help="the counters' namespace: vllm or servelab")
    args = parser.parse_args()
    mock = MockServer(
        args.ttft_ms / 1e3, args.tpot_ms / 1e3, args.log, args.prefill_ms / 1e3, args.spec_tokens, args.metrics_prefix
    )
    server = await asyncio.start_server(mock.handle, "127.0.0.1", args.port, backlog=1024)
    print(f"PORT {server.sockets[0].getsockname()[1]}", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main())
