"""The HTTP side of a serving engine: GET (health, metrics) and streamed OpenAI-style completions of token ids.

Only the standard library: the engine runs in its own venv, behind its server, and specdec never imports it.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

HOST = "127.0.0.1"


def http_get(url: str, timeout: float) -> tuple[int, str]:
    """(status, body) of GET `url` (http://host:port/path)."""
    host_port, _, path = url.removeprefix("http://").partition("/")
    host, _, port = host_port.partition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request("GET", "/" + path)
        resp = conn.getresponse()
        return resp.status, resp.read().decode(errors="replace")
    finally:
        conn.close()


@dataclass
class Request:
    """One streamed completion as the client saw it."""

    index: int  # prompt index
    start: float  # perf_counter at send
    end: float = 0.0
    tokens: list[int] = field(default_factory=list)
    marks: list[tuple[float, int]] = field(default_factory=list)  # (seconds since send, tokens in the chunk)
    finish_reason: str | None = None
    error: str | None = None

    @property
    def latency(self) -> float:
        return self.end - self.start


def _read_chunk(req: Request, data: bytes, now: float) -> bool:
    """One `data:` line of the stream into `req`; False once the stream is over (done or an error)."""
    if data == b"[DONE]":
        return False
    chunk = json.loads(data)
    if "error" in chunk:
        req.error = f"server error: {chunk['error']}"
        return False
    for choice in chunk.get("choices", []):
        ids = choice.get("token_ids") or []
        if ids:
            req.marks.append((now - req.start, len(ids)))
            req.tokens.extend(int(i) for i in ids)
        req.finish_reason = choice.get("finish_reason") or req.finish_reason
    return True


def stream_completion(port: int, prompt: list[int], body: dict, timeout: float, index: int = 0,
                      timeout_key: str = "request timeout", api_key: str | None = None) -> Request:
    """POST /v1/completions with prompt token ids, streamed (`return_token_ids` gives the generated ids back),
    with `api_key` as the bearer token when given; never raises for a failed request (see .error, which names
    `timeout_key` when the client gave up)."""
    payload = json.dumps({**body, "prompt": prompt, "stream": True, "return_token_ids": True}).encode()
    req = Request(index, time.perf_counter())
    deadline = req.start + timeout
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        headers = {"Content-Type": "application/json"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        conn.request("POST", "/v1/completions", body=payload, headers=headers)
        resp = conn.getresponse()
        if resp.status != 200:
            req.error = f"HTTP {resp.status}: {resp.read().decode(errors='replace')[:500]}"
            return req
        while True:
            line = resp.readline()
            now = time.perf_counter()
            if now > deadline:
                req.error = f"client timeout: no complete answer within {timeout:g} s ({timeout_key})"
                break
            if not line:
                if req.finish_reason is None:
                    req.error = "the server closed the stream before the completion finished"
                break
            if line.startswith(b"data: ") and not _read_chunk(req, line[6:].strip(), now):
                break
    except (OSError, http.client.HTTPException, json.JSONDecodeError) as err:
        kind = "client timeout" if isinstance(err, TimeoutError | socket.timeout) else "request failed"
        req.error = f"{kind}: {type(err).__name__}: {err}"
    finally:
        req.end = time.perf_counter()
        conn.close()
    return req


def request_body(sampling, max_new_tokens: int) -> dict:
    """The sampling fields of a completion request, as specdec's decoder samples (0 disables top-k in both)."""
    return {"max_tokens": max_new_tokens, "temperature": sampling.temperature, "top_k": sampling.top_k or 0,
            "top_p": sampling.top_p, "ignore_eos": False}


def run_requests(port: int, prompts: Sequence[list[int]], body: dict, concurrency: int, timeout: float,
                 seeds: Sequence[int | None] | None = None, progress=None,
                 timeout_key: str = "request timeout", api_key: str | None = None) -> tuple[list[Request], float]:
    """Send every prompt with `concurrency` clients, each sending its next prompt when its last one finishes;
    (the requests in prompt order, wall seconds)."""
    lock, next_index = threading.Lock(), [0]
    done: list[Request] = []

    def client() -> None:
        while True:
            with lock:
                i = next_index[0]
                next_index[0] += 1
            if i >= len(prompts):
                return
            extra = {} if seeds is None or seeds[i] is None else {"seed": seeds[i]}
            req = stream_completion(port, prompts[i], {**body, **extra}, timeout, i, timeout_key, api_key)
            with lock:
                done.append(req)
            if progress is not None:
                progress.update(1)

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        for f in [pool.submit(client) for _ in range(min(concurrency, len(prompts)))]:
            f.result()
    return sorted(done, key=lambda r: r.index), time.perf_counter() - start
