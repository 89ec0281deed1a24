"""One streamed request against an OpenAI-compatible endpoint, timed chunk by chunk.

Requests always stream (``stream: true`` with ``stream_options.include_usage``) so that the first token
and every later chunk can be timed as it arrives; the final usage chunk gives exact token counts. Whatever
goes wrong (an HTTP error status, a refused or dropped connection, an error event, a stream cut short)
becomes a failed :class:`RequestOutcome` carrying the error text, never an exception.

The client is aiohttp, as in vLLM's serving benchmark: at tens of thousands of streamed events per second
the client's own CPU time per event must stay far below the server's, or the client is what gets measured
(``bench/results/serve_demo.md`` measures the CPU each process spends per streamed token).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from deepinfer.benchmarks.datasets import BenchRequest
from deepinfer.benchmarks.metrics import RequestOutcome

@dataclass(frozen=True)
class Endpoint:
    """Where and how to send: ``fields`` (sampling options, extra body) are merged into every request."""

    url: str
    backend: str
    model: str
    api_key: str | None = None
    fields: Mapping[str, Any] = field(default_factory=dict)

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def request_body(ep: Endpoint, req: BenchRequest) -> dict[str, Any]:
    body: dict[str, Any] = {"model": ep.model, "stream": True, "stream_options": {"include_usage": True}}
    if ep.backend == "openai-chat":
        if not isinstance(req.prompt, str):
            raise ValueError("openai-chat backend: prompts must be text, not token ids")
        body.update(messages=[{"role": "user", "content": req.prompt}], max_completion_tokens=req.output_len)
    else:
        body.update(prompt=req.prompt if isinstance(req.prompt, str) else list(req.prompt), max_tokens=req.output_len)
    body.update(ep.fields)
    return body


def chunk_text(chunk: Mapping[str, Any]) -> str | None:
    """The generated text a chunk carries ("" for a chunk with choices but no text, such as the chat role
    opener or a finish-only chunk), or None for a chunk without choices (the usage chunk)."""
    choices = chunk.get("choices")
    if not choices:
        return None
    parts = []
    for choice in choices:
        if "text" in choice:  # /v1/completions
            parts.append(choice.get("text") or "")
            continue
        delta = choice.get("delta") or {}
        for key in ("reasoning_content", "reasoning", "content"):
            parts.append(delta.get(key) or "")
        for call in delta.get("tool_calls") or ():
            fn = call.get("function") or {}
            parts.append((fn.get("name") or "") + (fn.get("arguments") or ""))
    return "".join(parts)


def _error_text(status: int, body: bytes) -> str:
    text = body.decode("utf-8", errors="replace").strip()
    try:  # OpenAI-style {"error": {"message": ...}}: keep just the message
        message = json.loads(text)["error"]["message"]
        text = message if isinstance(message, str) else text
    except (ValueError, KeyError, TypeError):
        pass
    return f"HTTP {status}: {text[:500]}"


class _Timer:
    """Arrival times of the chunks that carry text, relative to the send."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.first: float | None = None
        self.first_choice: float | None = None
        self.last = 0.0
        self.itls: list[float] = []

    def chunk(self, now: float, text: str) -> None:
        if self.first_choice is None:
            self.first_choice = now - self.start
        if not text:
            return
        if self.first is None:
            self.first = now - self.start
        else:
            self.itls.append(now - self.start - self.last)
        self.last = now - self.start

    def ttft(self, latency: float) -> float:
        # A stream whose text is empty still had a first token: take the first chunk with choices.
        for t in (self.first, self.first_choice):
            if t is not None:
                return t
        return latency


def _sse_lines(buffer: bytearray, data: bytes) -> list[bytes]:
    """Append ``data`` to ``buffer`` and take out the complete lines it now holds (without line ends); an
    event may arrive in pieces, so an incomplete last line stays in the buffer."""
    buffer += data
    end = buffer.rfind(b"\n")
    if end < 0:
        return []
    lines = bytes(buffer[:end]).split(b"\n")
    del buffer[:end + 1]
    return lines


async def send(http: aiohttp.ClientSession, ep: Endpoint, req: BenchRequest,
               count_tokens: Callable[[str], int]) -> RequestOutcome:
    """Send ``req``, read its event stream, and time it. ``count_tokens`` counts the output when the server
    sends no usage."""
    body = request_body(ep, req)
    timer = _Timer()
    texts: list[str] = []
    usage: Mapping[str, Any] = {}
    finished = done = False

    def failed(error: str) -> RequestOutcome:
        return RequestOutcome(False, req.prompt_len, latency=time.perf_counter() - timer.start,
                              generated_text="".join(texts), error=error)

    try:
        async with http.post(ep.url, json=body, headers=ep.headers()) as resp:
            if resp.status != 200:
                return failed(_error_text(resp.status, await resp.read()))
            buffer = bytearray()
            async for data in resp.content.iter_any():
                now = time.perf_counter()  # events that arrive together are timed together
                for raw in _sse_lines(buffer, data):
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue  # blank separators, ": keep-alive" comments, event/id fields
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        done = True
                        break
                    chunk = json.loads(payload)
                    if not isinstance(chunk, dict):
                        return failed(f"unexpected event: {payload[:200].decode(errors='replace')}")
                    if chunk.get("error"):
                        err = chunk["error"]
                        return failed(f"error event: {err.get('message', err) if isinstance(err, dict) else err}")
                    text = chunk_text(chunk)
                    if text is not None:
                        timer.chunk(now, text)
                        texts.append(text)
                        finished = finished or any(c.get("finish_reason") for c in chunk["choices"])
                    usage = chunk.get("usage") or usage
                if done:
                    break
    except asyncio.CancelledError:
        raise
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:  # refused, reset, timed out, closed mid-body
        return failed(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
    except (ValueError, AttributeError, TypeError) as e:  # malformed JSON or chunk shape
        return failed(f"malformed stream: {e}")
    except Exception as e:  # anything else (an invalid URL, ...) is this request's failure, not the run's
        return failed(f"{type(e).__name__}: {e}")
    latency = time.perf_counter() - timer.start
    if not (done or finished):
        return failed("the stream ended before the response was complete (no finish_reason, no [DONE])")
    text = "".join(texts)
    out_len = usage.get("completion_tokens")
    in_len = usage.get("prompt_tokens")
    return RequestOutcome(
        True,
        prompt_len=in_len if isinstance(in_len, int) else req.prompt_len,
        output_len=out_len if isinstance(out_len, int) else count_tokens(text),
        ttft=timer.ttft(latency), itls=tuple(timer.itls), latency=latency, generated_text=text,
    )
