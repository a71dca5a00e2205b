"""kunlun-test-engine: OpenAI-shaped responses, SSE streaming, SGLang /generate, knobs and CLI."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from node_agent.testengine import KunlunTestEngine, ServerSettings, parse_args

ROOT = Path(__file__).resolve().parents[1]
MODEL = "demo-model"


async def http(
    port: int, method: str, path: str, body: Any = None, version: str = "1.1"
) -> tuple[int, dict[str, str], bytes]:
    """One request on a fresh connection; returns (status, lower-cased headers, decoded body)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    payload = json.dumps(body).encode() if body is not None else b""
    head = f"{method} {path} HTTP/{version}\r\nhost: x\r\ncontent-length: {len(payload)}\r\nconnection: close\r\n\r\n"
    writer.write(head.encode() + payload)
    raw = await reader.read(-1)
    writer.close()
    status, headers, rest = parse_head(raw)
    if headers.get("transfer-encoding") == "chunked":
        rest = dechunk(rest)
    return status, headers, rest


def parse_head(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, rest = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, rest


def dechunk(data: bytes) -> bytes:
    out = b""
    while True:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            return out
        out, data = out + data[:size], data[size + 2 :]


def sse(body: bytes) -> list[Any]:
    events = body.decode().split("\n\n")
    assert events[-1] == ""
    assert all(e.startswith("data: ") for e in events[:-1])
    assert events[-2] == "data: [DONE]"
    return [json.loads(e[6:]) for e in events[:-2]]


@pytest.fixture
async def engine() -> AsyncIterator[int]:
    server = KunlunTestEngine(ServerSettings(port=0, served_model_name=MODEL, model_path="/models/demo"))
    port = await server.start()
    yield port
    await server.close()


def check_usage(usage: dict[str, Any]) -> None:
    assert set(usage) == {"prompt_tokens", "completion_tokens", "total_tokens"}
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


async def test_health_models_and_model_info(engine: int) -> None:
    status, _, body = await http(engine, "GET", "/health")
    assert (status, body) == (200, b"")
    status, _, body = await http(engine, "GET", "/v1/models")
    models = json.loads(body)
    assert status == 200 and models["object"] == "list"
    assert [(m["id"], m["object"], m["owned_by"]) for m in models["data"]] == [
        (MODEL, "model", "kunlun-test-engine")
    ]
    assert isinstance(models["data"][0]["created"], int)
    info = json.loads((await http(engine, "GET", "/get_model_info"))[2])
    assert info["model_path"] == "/models/demo" and info["is_generation"] is True


async def test_completions_shape(engine: int) -> None:
    status, headers, body = await http(
        engine, "POST", "/v1/completions", {"model": MODEL, "prompt": "a b c", "max_tokens": 4}
    )
    assert status == 200 and headers["content-type"] == "application/json"
    data = json.loads(body)
    assert data["id"].startswith("cmpl-") and data["object"] == "text_completion" and data["model"] == MODEL
    assert isinstance(data["created"], int)
    assert data["choices"] == [{"index": 0, "text": "a b c a", "logprobs": None, "finish_reason": "length"}]
    check_usage(data["usage"])
    assert data["usage"]["completion_tokens"] == 4


async def test_chat_completion_and_its_stream_agree(engine: int) -> None:
    request = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello streaming world"}],
        "max_tokens": 5,
    }
    data = json.loads((await http(engine, "POST", "/v1/chat/completions", request))[2])
    assert data["id"].startswith("chatcmpl-") and data["object"] == "chat.completion"
    (choice,) = data["choices"]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"
    check_usage(data["usage"])

    stream_request = {**request, "stream": True, "stream_options": {"include_usage": True}}
    status, headers, body = await http(engine, "POST", "/v1/chat/completions", stream_request)
    assert status == 200 and headers["content-type"] == "text/event-stream"
    assert headers["transfer-encoding"] == "chunked"
    chunks = sse(body)
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == MODEL for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == choice["message"]["content"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == data["usage"]


async def test_completion_stream_and_http10(engine: int) -> None:
    request = {"model": MODEL, "prompt": "x y", "max_tokens": 3, "stream": True}
    chunks = sse((await http(engine, "POST", "/v1/completions", request))[2])
    assert "".join(c["choices"][0]["text"] for c in chunks) == "x y x"
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "length"]
    status, headers, body = await http(engine, "POST", "/v1/completions", request, version="1.0")
    assert status == 200 and "transfer-encoding" not in headers and len(sse(body)) == 4


async def test_sglang_generate(engine: int) -> None:
    request = {"text": "one two", "sampling_params": {"max_new_tokens": 3}}
    data = json.loads((await http(engine, "POST", "/generate", request))[2])
    assert data["text"] == "one two one"
    meta = data["meta_info"]
    assert meta["prompt_tokens"] == 2 and meta["completion_tokens"] == 3
    assert meta["finish_reason"] == {"type": "length", "length": 3}
    chunks = sse((await http(engine, "POST", "/generate", {**request, "stream": True}))[2])
    assert [c["text"] for c in chunks] == ["one", "one two", "one two one"]


async def test_errors(engine: int) -> None:
    assert (await http(engine, "GET", "/nope"))[0] == 404
    assert (await http(engine, "GET", "/v1/completions"))[0] == 405
    status, _, body = await http(engine, "POST", "/v1/completions", None)
    assert status == 200  # an empty body is an empty request
    reader, writer = await asyncio.open_connection("127.0.0.1", engine)
    writer.write(b"POST /v1/completions HTTP/1.1\r\ncontent-length: 5\r\n\r\n{bad}")
    status, _, body = parse_head(await reader.read(4096))
    writer.close()
    assert status == 400 and json.loads(body)["error"]["type"] == "invalid_request_error"
    reader, writer = await asyncio.open_connection("127.0.0.1", engine)
    writer.write(b"NOT HTTP AT ALL\r\n\r\n")
    assert (await reader.read(-1)).startswith(b"HTTP/1.1 400")
    writer.close()


async def test_keep_alive_pipelining_in_order(engine: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", engine)
    stream = json.dumps({"prompt": "s", "max_tokens": 2, "stream": True}).encode()
    plain = json.dumps({"prompt": "p", "max_tokens": 1}).encode()
    writer.write(
        b"GET /health HTTP/1.1\r\n\r\n"
        + b"POST /v1/completions HTTP/1.1\r\ncontent-length: %d\r\n\r\n%b" % (len(stream), stream)
        + b"POST /v1/completions HTTP/1.1\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%b"
        % (len(plain), plain)
    )
    raw = await asyncio.wait_for(reader.read(-1), 10)
    writer.close()
    assert raw.count(b"HTTP/1.1 200 OK") == 3
    first, second, third = (
        raw.index(b"content-length: 0"),
        raw.index(b"text/event-stream"),
        raw.index(b'"text":"p"'),
    )
    assert first < second < third


async def test_error_rate_and_latency() -> None:
    server = KunlunTestEngine(ServerSettings(port=0, error_rate=1.0, latency_ms=150, seed=1))
    port = await server.start()
    try:
        started = time.monotonic()
        status, _, body = await http(port, "POST", "/v1/chat/completions", {"messages": []})
        assert time.monotonic() - started >= 0.14
        assert status == 500 and json.loads(body)["error"]["type"] == "server_error"
        assert (await http(port, "GET", "/health"))[0] == 200  # health never fails
    finally:
        await server.close()
    server = KunlunTestEngine(ServerSettings(port=0, error_rate=0.3, seed=42))
    port = await server.start()
    try:
        statuses = [(await http(port, "POST", "/v1/completions", {"prompt": "x"}))[0] for _ in range(200)]
    finally:
        await server.close()
    assert 30 < statuses.count(500) < 90 and statuses.count(200) + statuses.count(500) == 200


async def test_openai_sdk_accepts_the_responses(engine: int, monkeypatch: pytest.MonkeyPatch) -> None:
    openai = pytest.importorskip("openai")
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{engine}/v1", api_key="unused", max_retries=0)

    def exercise() -> None:
        assert [m.id for m in client.models.list()] == [MODEL]
        chat = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi there"}], max_tokens=3
        )
        assert chat.choices[0].message.content == "hi there hi" and chat.usage.total_tokens == 5
        deltas = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi there"}], max_tokens=3, stream=True
        )
        assert "".join(c.choices[0].delta.content or "" for c in deltas if c.choices) == "hi there hi"
        completion = client.completions.create(model=MODEL, prompt="a b", max_tokens=2)
        assert completion.choices[0].text == "a b"

    await asyncio.to_thread(exercise)


def test_unknown_flags_are_accepted_and_ignored() -> None:
    settings, unknown = parse_args(
        ["--port", "1234", "--tp-size", "2", "--trust-remote-code", "--model", "/m"]
    )
    assert settings.port == 1234 and settings.model_path == "/m" and settings.served_model_name == "/m"
    assert unknown == ["--tp-size", "2", "--trust-remote-code"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


ENGINE_CMD = (sys.executable, "-m", "node_agent.testengine")
KNOBS = ("--log-lines-per-second", "400", "--tp-size", "2", "--quantization", "fp8")


def test_cli_startup_delay_memory_logging_and_sigterm() -> None:
    port = free_port()
    proc = subprocess.Popen(
        [*ENGINE_CMD, "--port", str(port), "--startup-delay", "0.5", "--memory-mb", "96", *KNOBS],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert proc.stdout is not None
        started = time.monotonic()
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        lines: list[bytes] = []
        while not any(b"ready on" in line for line in lines):
            line = proc.stdout.readline()
            assert line, b"".join(lines)
            lines.append(line)
        assert time.monotonic() - started >= 0.45
        assert rss_mib(proc.pid) >= 96
        with socket.create_connection(("127.0.0.1", port), timeout=2) as conn:
            conn.sendall(b"GET /health HTTP/1.1\r\nconnection: close\r\n\r\n")
            assert conn.recv(100).startswith(b"HTTP/1.1 200")
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=10)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0
    text = b"".join(lines).decode() + out.decode()
    assert "ignored_flags" in text and "--tp-size" in text
    count = text.count("kunlun-test-engine log seq=")
    assert 200 < count < 800, count
