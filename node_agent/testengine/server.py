"""kunlun-test-engine: a small, fast OpenAI-compatible HTTP server for tests and benchmarks.

It is a test engine, not a model: completions are words echoed from the prompt. It speaks
`/health`, `/v1/models`, `/v1/completions`, `/v1/chat/completions` (JSON or SSE streaming:
`data: {...}\\n\\n` chunks then `data: [DONE]`), SGLang's native `/generate` and
`/get_model_info`, with the response shapes the OpenAI Python SDK expects (id, object, created,
model, choices, usage); and `/debug/env`: the names (never the values) of its environment
variables, so tests can check the sandbox's environment allowlist. Chat completions honour
OpenAI-style `response_format` (`json_schema` / `json_object`): the content is JSON conforming to
the schema, for the subset documented in schema_output.py (`--schema-violation`: on purpose not).

Built directly on asyncio (an `asyncio.Protocol` per connection with the httptools parser, uvloop
when installed) with keep-alive and pipelining, so the gateway benchmark can use it as a backend.
Knobs for tests: startup delay, per-request latency, injected 500s, a memory ballast (to test
OOM handling) and heavy logging. Unknown SGLang-style flags (`--tp-size 2`...) are accepted
and ignored, so it can stand in for `sglang.launch_server` in a launch plan.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import httptools
import structlog

from kunlun_common.secrets import redact_args
from node_agent.testengine.schema_output import SchemaUnsupported, structured

log = structlog.get_logger(__name__)

ENGINE_NAME = "kunlun-test-engine"
_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    413: "Payload Too Large",
}
_REASONS[500] = "Internal Server Error"


@dataclass(frozen=True)
class ServerSettings:
    """Behaviour of the test engine (one field per command-line flag)."""

    host: str = "127.0.0.1"
    """Address to listen on."""
    port: int = 30000
    """Port to listen on (0 picks a free one)."""
    served_model_name: str = "kunlun-test-model"
    """Model id reported by /v1/models and in responses."""
    model_path: str = "kunlun-test-model"
    """Model path reported by /get_model_info (nothing is loaded)."""
    startup_delay_s: float = 0.0
    """Seconds to wait before listening, like an engine loading weights."""
    latency_ms: float = 0.0
    """Delay before each response (before the first chunk when streaming)."""
    inter_token_ms: float = 0.0
    """Delay between streamed chunks."""
    error_rate: float = 0.0
    """Fraction of generation requests answered with HTTP 500."""
    memory_mb: int = 0
    """MiB to allocate and touch at startup (to test OOM handling)."""
    log_lines_per_second: float = 0.0
    """Lines per second written to stdout (to test heavy logging)."""
    default_max_tokens: int = 16
    """Completion length when the request sets no max_tokens."""
    seed: int | None = None
    """Seed of the error injection, for reproducible tests."""
    ignore_sigterm_s: float = 0.0
    """Keep serving this long after SIGTERM before stopping (a slow-to-stop engine, for tests)."""
    max_body_bytes: int = 16 * 1024 * 1024
    """Largest accepted request body."""
    schema_violation: bool = False
    """Answer `response_format` json_schema requests with JSON that does NOT conform (for tests)."""


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _error(status: int, message: str, kind: str = "invalid_request_error") -> tuple[int, bytes]:
    return status, _dumps({"error": {"message": message, "type": kind, "param": None, "code": status}})


def _words(text: str) -> list[str]:
    return text.split() or [ENGINE_NAME]


def _message_text(messages: Any) -> str:
    parts: list[str] = []
    for message in messages if isinstance(messages, list) else []:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts.extend(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return " ".join(parts)


_Answer = tuple[int, bytes] | AsyncIterator[bytes]
"""A (status, JSON body) response, or the SSE events of a streamed one."""


def _choice_count(body: dict[str, Any]) -> int:
    n = body.get("n")
    return n if isinstance(n, int) and 1 <= n <= 16 else 1


@dataclass
class _Request:
    method: str
    path: str
    body: bytes
    keep_alive: bool
    http10: bool


class KunlunTestEngine:
    """The server: `await start()` binds (returns the port), `await close()` stops."""

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.rng = random.Random(settings.seed)
        self.created = int(time.time())
        self.ballast: list[bytes] = []
        self.requests = 0
        self._server: asyncio.AbstractServer | None = None
        self._log_task: asyncio.Task[None] | None = None
        self.routes: dict[str, tuple[str, Callable[[dict[str, Any]], _Answer]]] = {
            "/health": ("GET", self._health),
            "/health_generate": ("GET", self._health),
            "/v1/models": ("GET", self._models),
            "/get_model_info": ("GET", self._model_info),
            "/debug/env": ("GET", self._env_names),
            "/get_load": ("GET", self._load),
            "/v1/completions": ("POST", self._completions),
            "/v1/chat/completions": ("POST", self._chat),
            "/generate": ("POST", self._generate),
        }

    async def start(self) -> int:
        """Wait the startup delay, allocate the ballast, start logging and listen; return the port."""
        s = self.settings
        if s.startup_delay_s > 0:
            log.info("test_engine.loading", delay_s=s.startup_delay_s)
            await asyncio.sleep(s.startup_delay_s)
        for i in range(s.memory_mb):
            self.ballast.append(bytes([0xA5]) * (1 << 20))
            if (i + 1) % 64 == 0:
                print(f"{ENGINE_NAME}: allocated {i + 1} MiB", flush=True)
        if s.log_lines_per_second > 0:
            self._log_task = asyncio.create_task(self._log_loop())
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _HttpProtocol(self), s.host, s.port, backlog=1024)
        port = int(self._server.sockets[0].getsockname()[1])
        log.info(
            "test_engine.ready", host=s.host, port=port, model=s.served_model_name, memory_mb=s.memory_mb
        )
        print(f"{ENGINE_NAME} ready on {s.host}:{port}", flush=True)
        return port

    async def close(self) -> None:
        """Stop listening and logging."""
        if self._log_task is not None:
            self._log_task.cancel()
        if self._server is not None:
            self._server.close()

    async def _log_loop(self) -> None:
        seq, owed, tick = 0, 0.0, 0.05
        while True:
            owed += self.settings.log_lines_per_second * tick
            n = int(owed)
            owed -= n
            if n:
                lines = "".join(
                    f"{ENGINE_NAME} log seq={seq + i} filler=abcdefghijklmnopqrstuvwxyz\n" for i in range(n)
                )
                sys.stdout.write(lines)
                sys.stdout.flush()
                seq += n
            await asyncio.sleep(tick)

    # --- request handling ---------------------------------------------------------------------

    def respond(self, req: _Request) -> _Answer:
        """A (status, JSON body) answer, or an async iterator of SSE events for streaming."""
        path = req.path.split("?", 1)[0]
        if path not in self.routes:
            return _error(404, f"no route {path}", "not_found")
        method, handler = self.routes[path]
        if req.method != method:
            return _error(405, f"{path} takes {method}")
        if method == "GET":
            return handler({})
        try:
            body = json.loads(req.body or b"{}")
        except ValueError:
            return _error(400, "request body is not valid JSON")
        if not isinstance(body, dict):
            return _error(400, "request body must be a JSON object")
        self.requests += 1
        if self.settings.error_rate > 0 and self.rng.random() < self.settings.error_rate:
            return _error(500, f"{ENGINE_NAME}: injected error", "server_error")
        return handler(body)

    def _health(self, _body: dict[str, Any]) -> tuple[int, bytes]:
        return 200, b""

    def _load(self, _body: dict[str, Any]) -> tuple[int, bytes]:
        """Generation requests so far (simulated nodes turn the rate into chip utilization)."""
        return 200, _dumps({"requests": self.requests})

    def _env_names(self, _body: dict[str, Any]) -> tuple[int, bytes]:
        """The NAMES of the engine's environment variables (never values), to check the sandbox's."""
        return 200, _dumps({"env_names": sorted(os.environ)})

    def _models(self, _body: dict[str, Any]) -> tuple[int, bytes]:
        model = {
            "id": self.settings.served_model_name,
            "object": "model",
            "created": self.created,
            "owned_by": ENGINE_NAME,
            "root": self.settings.model_path,
        }
        return 200, _dumps({"object": "list", "data": [model]})

    def _model_info(self, _body: dict[str, Any]) -> tuple[int, bytes]:
        info = {"model_path": self.settings.model_path, "tokenizer_path": self.settings.model_path}
        return 200, _dumps(
            {**info, "is_generation": True, "served_model_name": self.settings.served_model_name}
        )

    def _tokens(self, prompt: str, body: dict[str, Any], key: str = "max_tokens") -> tuple[list[str], str]:
        limit = body.get(key)
        count = limit if isinstance(limit, int) and limit >= 0 else self.settings.default_max_tokens
        words = _words(prompt)
        pieces = [("" if i == 0 else " ") + words[i % len(words)] for i in range(count)]
        return pieces, "length" if isinstance(limit, int) else "stop"

    def _usage(self, prompt: str, completion: int) -> dict[str, int]:
        prompt_tokens = len(prompt.split())
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
        }

    def _completions(self, body: dict[str, Any]) -> _Answer:
        prompt = body.get("prompt", "")
        prompts = [str(p) for p in prompt] if isinstance(prompt, list) else [str(prompt)]
        n = _choice_count(body)
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time())}
        head["model"] = self.settings.served_model_name
        answers = [(i * n + j, p, *self._tokens(p, body)) for i, p in enumerate(prompts) for j in range(n)]
        if body.get("stream"):
            return self._completion_stream(head, answers, body)
        choices = [
            {"index": idx, "text": "".join(pieces), "logprobs": None, "finish_reason": reason}
            for idx, _, pieces, reason in answers
        ]
        usage = self._usage(" ".join(prompts), sum(len(a[2]) for a in answers))
        return 200, _dumps({**head, "choices": choices, "usage": usage, "system_fingerprint": ENGINE_NAME})

    async def _completion_stream(
        self, head: dict[str, Any], answers: list[Any], body: dict[str, Any]
    ) -> AsyncIterator[bytes]:
        for idx, _, pieces, reason in answers:
            for piece in pieces:
                choice = {"index": idx, "text": piece, "logprobs": None, "finish_reason": None}
                yield _dumps({**head, "choices": [choice]})
            yield _dumps(
                {**head, "choices": [{"index": idx, "text": "", "logprobs": None, "finish_reason": reason}]}
            )
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = self._usage(" ".join(a[1] for a in answers), sum(len(a[2]) for a in answers))
            yield _dumps({**head, "choices": [], "usage": usage})

    def _chat(self, body: dict[str, Any]) -> _Answer:
        prompt = _message_text(body.get("messages"))
        n = _choice_count(body)
        pieces, reason = self._tokens(
            prompt, body, "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        )
        head = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
        }
        head["model"] = self.settings.served_model_name
        if body.get("stream"):
            return self._chat_stream(
                {**head, "object": "chat.completion.chunk"}, n, pieces, reason, prompt, body
            )
        content = "".join(pieces)
        if "response_format" in body:
            try:
                content = structured(body["response_format"], _words(prompt), self.settings.schema_violation)
            except SchemaUnsupported as e:
                return _error(400, f"response_format: {e}")
        message = {"role": "assistant", "content": content, "tool_calls": None}
        choices = [
            {"index": i, "message": message, "logprobs": None, "finish_reason": reason} for i in range(n)
        ]
        usage = self._usage(prompt, n * len(pieces))
        return 200, _dumps({**head, "choices": choices, "usage": usage, "system_fingerprint": ENGINE_NAME})

    async def _chat_stream(
        self, head: dict[str, Any], n: int, pieces: list[str], reason: str, prompt: str, body: dict[str, Any]
    ) -> AsyncIterator[bytes]:
        for i in range(n):
            first = {"role": "assistant", "content": ""}
            yield _dumps(
                {**head, "choices": [{"index": i, "delta": first, "logprobs": None, "finish_reason": None}]}
            )
            for piece in pieces:
                delta = {"content": piece}
                yield _dumps(
                    {
                        **head,
                        "choices": [{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}],
                    }
                )
            yield _dumps(
                {**head, "choices": [{"index": i, "delta": {}, "logprobs": None, "finish_reason": reason}]}
            )
        if (body.get("stream_options") or {}).get("include_usage"):
            yield _dumps({**head, "choices": [], "usage": self._usage(prompt, n * len(pieces))})

    def _generate(self, body: dict[str, Any]) -> _Answer:
        text = body.get("text", "")
        params = body.get("sampling_params") or {}
        pieces, _ = self._tokens(str(text), params, "max_new_tokens")
        rid = str(body.get("rid") or uuid.uuid4().hex)
        started = time.monotonic()

        def meta(done: int, finished: bool) -> dict[str, Any]:
            info: dict[str, Any] = {
                "id": rid,
                "prompt_tokens": len(str(text).split()),
                "completion_tokens": done,
            }
            info["cached_tokens"] = 0
            info["finish_reason"] = {"type": "length", "length": done} if finished else None
            info["e2e_latency"] = time.monotonic() - started
            return info

        if body.get("stream"):
            return self._generate_stream(pieces, meta)
        return 200, _dumps({"text": "".join(pieces), "meta_info": meta(len(pieces), True)})

    async def _generate_stream(self, pieces: list[str], meta: Any) -> AsyncIterator[bytes]:
        for i in range(1, len(pieces) + 1):
            yield _dumps({"text": "".join(pieces[:i]), "meta_info": meta(i, i == len(pieces))})


class _HttpProtocol(asyncio.Protocol):
    """One HTTP/1.1 connection: parse with httptools, answer in order (pipelining-safe)."""

    def __init__(self, app: KunlunTestEngine) -> None:
        self.app = app
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.body: list[bytes] = []
        self.body_size = 0
        self.pending: deque[_Request] = deque()
        self.worker: asyncio.Task[None] | None = None
        self.writable = asyncio.Event()
        self.writable.set()

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not subclasses

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.writable.set()
        if self.worker is not None:
            self.worker.cancel()

    def pause_writing(self) -> None:
        self.writable.clear()

    def resume_writing(self) -> None:
        self.writable.set()

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._reply_and_close(*_error(400, "upgrades are not supported"))
        except httptools.HttpParserError:
            self._reply_and_close(*_error(400, "malformed HTTP request"))

    # httptools callbacks
    def on_message_begin(self) -> None:
        self.url, self.body, self.body_size = b"", [], 0

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"x-request-id":  # the gateway's trace id: logged, as SGLang logs rid
            print(f"{ENGINE_NAME}: request x-request-id={value.decode('latin-1')}", flush=True)

    def on_body(self, body: bytes) -> None:
        self.body_size += len(body)
        if self.body_size <= self.app.settings.max_body_bytes:
            self.body.append(body)

    def on_message_complete(self) -> None:
        if self.body_size > self.app.settings.max_body_bytes:
            self._reply_and_close(*_error(413, "request body too large"))
            return
        req = _Request(
            self.parser.get_method().decode(),
            self.url.decode("latin-1"),
            b"".join(self.body),
            bool(self.parser.should_keep_alive()),
            self.parser.get_http_version() == "1.0",
        )
        if self.worker is None and not self.pending and self.app.settings.latency_ms <= 0:
            answer = self.app.respond(req)  # fast path: answer inline
            if isinstance(answer, tuple):
                self._reply(*answer, keep_alive=req.keep_alive)
                return
            self.pending.append(req)  # a stream after all: hand it to the worker with its answer
            self.worker = asyncio.ensure_future(self._work(answer))
            return
        self.pending.append(req)
        if self.worker is None:
            self.worker = asyncio.ensure_future(self._work(None))

    # responses
    def _head(self, status: int, content_type: str, extra: str) -> bytes:
        return (
            f"HTTP/1.1 {status} {_REASONS.get(status, 'OK')}\r\nserver: {ENGINE_NAME}\r\n"
            f"content-type: {content_type}\r\n{extra}\r\n"
        ).encode()

    def _reply(self, status: int, body: bytes, keep_alive: bool) -> None:
        if self.transport is None:
            return
        connection = "" if keep_alive else "connection: close\r\n"
        head = self._head(status, "application/json", f"content-length: {len(body)}\r\n{connection}")
        self.transport.write(head + body)
        if not keep_alive:
            self.transport.close()

    def _reply_and_close(self, status: int, body: bytes) -> None:
        self._reply(status, body, keep_alive=False)

    async def _work(self, first: AsyncIterator[bytes] | None) -> None:
        try:
            while self.pending and self.transport is not None:
                req = self.pending.popleft()
                if self.app.settings.latency_ms > 0:
                    await asyncio.sleep(self.app.settings.latency_ms / 1000)
                answer = first if first is not None else self.app.respond(req)
                first = None
                if isinstance(answer, tuple):
                    self._reply(*answer, keep_alive=req.keep_alive)
                else:
                    await self._stream(answer, req)
        except ConnectionError:
            pass  # the client went away mid-stream
        finally:
            self.worker = None

    async def _stream(self, events: AsyncIterator[bytes], req: _Request) -> None:
        chunked = not req.http10
        extra = "cache-control: no-cache\r\n" + ("transfer-encoding: chunked\r\n" if chunked else "")
        keep_alive = req.keep_alive and chunked
        if not keep_alive:
            extra += "connection: close\r\n"
        assert self.transport is not None
        self.transport.write(self._head(200, "text/event-stream", extra))
        gap = self.app.settings.inter_token_ms / 1000

        async def send(payload: bytes) -> None:
            data = b"data: " + payload + b"\n\n"
            if self.transport is None:
                raise ConnectionResetError("client went away")
            self.transport.write(b"%x\r\n%b\r\n" % (len(data), data) if chunked else data)
            await self.writable.wait()

        first = True
        async for event in events:
            if gap > 0 and not first:
                await asyncio.sleep(gap)
            first = False
            await send(event)
        await send(b"[DONE]")
        if self.transport is not None:
            if chunked:
                self.transport.write(b"0\r\n\r\n")
            if not keep_alive:
                self.transport.close()


def parse_args(argv: Sequence[str] | None = None) -> tuple[ServerSettings, list[str]]:
    """Parse flags into settings; return them with the ignored unknown (SGLang-style) flags."""
    p = argparse.ArgumentParser(prog=ENGINE_NAME, description="OpenAI-compatible test engine (not a model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--model-path", "--model", default="kunlun-test-model")
    p.add_argument("--startup-delay", type=float, default=0.0, help="seconds before listening")
    p.add_argument("--latency-ms", type=float, default=0.0, help="delay before each response")
    p.add_argument("--inter-token-ms", type=float, default=0.0, help="delay between streamed chunks")
    p.add_argument(
        "--error-rate", type=float, default=0.0, help="fraction of generation requests failing with 500"
    )
    p.add_argument("--memory-mb", type=int, default=0, help="MiB to allocate and touch at startup")
    p.add_argument("--log-lines-per-second", type=float, default=0.0, help="stdout lines per second")
    p.add_argument("--default-max-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument(
        "--schema-violation",
        action="store_true",
        help="answer response_format json_schema requests with JSON that does not conform",
    )
    p.add_argument(
        "--ignore-sigterm", type=float, default=0.0, help="seconds to keep serving after SIGTERM (slow stop)"
    )
    args, unknown = p.parse_known_args(argv)
    if not 0.0 <= args.error_rate <= 1.0:
        p.error("--error-rate must be between 0 and 1")
    settings = ServerSettings(
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name or args.model_path,
        model_path=args.model_path,
        startup_delay_s=args.startup_delay,
        latency_ms=args.latency_ms,
        inter_token_ms=args.inter_token_ms,
        error_rate=args.error_rate,
        memory_mb=args.memory_mb,
        log_lines_per_second=args.log_lines_per_second,
        default_max_tokens=args.default_max_tokens,
        seed=args.seed,
        schema_violation=args.schema_violation,
        ignore_sigterm_s=max(0.0, args.ignore_sigterm),
    )
    return settings, unknown


async def serve(settings: ServerSettings) -> None:
    """Run until SIGTERM or SIGINT."""
    engine = KunlunTestEngine(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await engine.start()
    await stop.wait()
    if settings.ignore_sigterm_s > 0:
        log.info("test_engine.ignoring_sigterm", seconds=settings.ignore_sigterm_s)
        await asyncio.sleep(settings.ignore_sigterm_s)
    log.info("test_engine.stopping")
    await engine.close()


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m node_agent.testengine` entry point."""
    settings, unknown = parse_args(argv)
    if unknown:
        log.info("test_engine.ignored_flags", flags=redact_args(unknown))
    try:
        import uvloop

        factory: Any = uvloop.new_event_loop
    except ImportError:
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(serve(settings))
    return 0
