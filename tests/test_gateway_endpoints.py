"""Request-as-a-Service through a real kunlun-gateway (fed by fake replicas over mTLS) in front of
real kunlun-test-engine processes, with raw HTTP and the OpenAI SDK's HTTP client: valid input ->
JSON conforming to the output schema; invalid input -> 400 naming the JSON path; an engine that
answers non-conforming JSON -> 502 naming the violation; openapi.json; the API key is required.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from gateway.httpclient import HttpConnection
from kunlun_common.api import gateway_pb2
from kunlun_common.traffic import key_hash
from tests.test_gateway_support import Engine, FakeControlPlane, GatewayProc, post, start_engines, until

KEY = "kl-test-endpoints-0123456789abcdefghijklmnopqrstuvwxyz"
AUTH = {"authorization": f"Bearer {KEY}"}
INPUT = {
    "type": "object",
    "properties": {
        "text": {"type": "string", "minLength": 1},
        "lang": {"enum": ["en", "zh"]},
        "items": {"type": "array", "items": {"type": "integer", "minimum": 0}},
    },
    "required": ["text"],
}
OUTPUT = {
    "type": "object",
    "properties": {
        "sentiment": {"type": "string", "enum": ["positive", "negative", "neutral"]},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "keywords": {
            "type": "array",
            "items": {"type": "string", "maxLength": 12},
            "minItems": 2,
            "maxItems": 4,
        },
        "count": {"type": "integer", "minimum": 1, "maximum": 5},
        "flagged": {"type": "boolean"},
    },
    "required": ["sentiment", "score", "keywords", "count", "flagged"],
}


def endpoint(name: str, workload: str, template: str = "") -> gateway_pb2.RequestEndpoint:
    return gateway_pb2.RequestEndpoint(
        name=name,
        workload=workload,
        input_schema_json=json.dumps(INPUT),
        output_schema_json=json.dumps(OUTPUT),
        prompt_template=template,
        version=1,
    )


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("endpoints")


@pytest.fixture(scope="module")
async def engines(base: Path) -> AsyncIterator[tuple[Engine, Engine]]:
    (good,) = await start_engines(base, ["good"])
    (bad,) = await start_engines(base, ["bad"], "--schema-violation")
    yield good, bad
    good.stop()
    bad.stop()


@pytest.fixture(scope="module")
def cp(cert_dir: Path, engines: tuple[Engine, Engine]) -> Iterator[FakeControlPlane]:
    good, bad = engines
    c = FakeControlPlane(cert_dir, replicas=1)
    c.start()
    cfg = gateway_pb2.GatewayConfig(
        key_hashes=[key_hash(KEY)],
        endpoints=[
            endpoint("sentiment", "good-wl", "Classify ({lang}): {text}"),
            endpoint("broken", "bad-wl"),
        ],
    )
    c.publish([good.endpoint("good-wl"), bad.endpoint("bad-wl")], cfg)
    yield c
    c.close()


@pytest.fixture(scope="module")
async def gw(base: Path, cp: FakeControlPlane, cert_dir: Path) -> AsyncIterator[GatewayProc]:
    g = GatewayProc(
        base,
        "gateway-1",
        "--name=gateway-1",
        f"--endpoints={','.join(cp.addresses)}",
        f"--cert-dir={cert_dir}",
        "--require-api-key",
        "--health-interval=0",
        key=KEY,
    )
    await g.ready()

    async def configured() -> bool:
        return bool((await g.status())["feed"]["config_revision"] >= 1)

    await until(configured, 10, "the gateway to apply the config with the endpoints")
    yield g
    g.stop()


async def call(gw: GatewayProc, method: str, path: str, body: Any = None, auth: bool = True) -> Any:
    conn = HttpConnection("127.0.0.1", gw.port)
    try:
        headers = AUTH if auth else {}
        if method == "POST":
            raw = body if isinstance(body, bytes) else json.dumps(body).encode()
            return await post(conn, path, raw, headers)
        return await conn.request(method, path, headers=headers, timeout_s=10.0)
    finally:
        await conn.close()


async def test_valid_input_gets_conforming_json(gw: GatewayProc) -> None:
    for body in ({"text": "what a lovely day", "lang": "en"}, {"text": "x", "items": [1, 2, 3]}):
        r = await call(gw, "POST", "/v1/endpoints/sentiment", body)
        assert r.status == 200, r.body
        assert r.headers["content-type"] == "application/json"
        jsonschema.validate(r.json(), OUTPUT)


async def test_invalid_input_is_400_with_the_json_path(gw: GatewayProc) -> None:
    cases = [
        ({"text": "hi", "items": [1, -5]}, "$.items[1]"),
        ({"text": "hi", "lang": "fr"}, "$.lang"),
        ({"lang": "en"}, "'text' is a required property"),
        ([1, 2], "is not of type 'object'"),
    ]
    for body, needle in cases:
        r = await call(gw, "POST", "/v1/endpoints/sentiment", body)
        assert r.status == 400, (body, r.body)
        message = r.json()["error"]["message"]
        assert needle in message and "sentiment" in message, message
    r = await call(gw, "POST", "/v1/endpoints/sentiment", b"{not json")
    assert r.status == 400 and "not valid JSON" in r.json()["error"]["message"]


async def test_non_conforming_engine_answer_is_502_naming_it(gw: GatewayProc) -> None:
    r = await call(gw, "POST", "/v1/endpoints/broken", {"text": "hello"})
    assert r.status == 502, r.body
    message = r.json()["error"]["message"]
    assert "does not conform to the output schema of endpoint 'broken'" in message, message
    assert "$.sentiment" in message, message


async def test_openapi_document(gw: GatewayProc) -> None:
    r = await call(gw, "GET", "/v1/endpoints/sentiment/openapi.json")
    assert r.status == 200, r.body
    doc = r.json()
    assert doc["openapi"].startswith("3.")
    op = doc["paths"]["/v1/endpoints/sentiment"]["post"]
    assert op["requestBody"]["content"]["application/json"]["schema"] == INPUT
    assert op["responses"]["200"]["content"]["application/json"]["schema"] == OUTPUT
    assert {"400", "502"} <= set(op["responses"])


async def test_unknown_endpoint_wrong_method_and_missing_key(gw: GatewayProc) -> None:
    r = await call(gw, "POST", "/v1/endpoints/nope", {"text": "a"})
    assert r.status == 404 and "broken, sentiment" in r.json()["error"]["message"], r.body
    r = await call(gw, "GET", "/v1/endpoints/sentiment")
    assert r.status == 405, r.body
    r = await call(gw, "POST", "/v1/endpoints/sentiment", {"text": "a"}, auth=False)
    assert r.status == 401, r.body
    r = await call(gw, "GET", "/v1/endpoints/sentiment/openapi.json", auth=False)
    assert r.status == 401, r.body


async def test_openai_sdk_client_posts_to_the_endpoint(gw: GatewayProc) -> None:
    import openai

    client = openai.AsyncOpenAI(base_url=f"http://{gw.address}/v1", api_key=KEY, max_retries=0, timeout=10.0)
    try:
        out = await client.post("/endpoints/sentiment", cast_to=object, body={"text": "great", "lang": "zh"})
        jsonschema.validate(out, OUTPUT)
        with pytest.raises(openai.BadRequestError, match=r"\$\.lang"):
            await client.post("/endpoints/sentiment", cast_to=object, body={"text": "great", "lang": "de"})
        with pytest.raises(openai.InternalServerError, match="output schema"):
            await client.post("/endpoints/broken", cast_to=object, body={"text": "great"})
    finally:
        await client.close()


def test_prompt_rendering() -> None:
    from gateway.endpoints import render

    data = {"text": "hi there", "n": [1, 2]}
    assert render("Say {text} ({n}) {missing}.", data) == "Say hi there ([1, 2]) ."
    assert render("", data) == '{"n": [1, 2], "text": "hi there"}'
    assert render("All: {input}", data) == 'All: {"n": [1, 2], "text": "hi there"}'
