"""`kunlun-cli endpoint create|list|describe|delete` — Request-as-a-Service endpoints.

An endpoint is a JSON API over a workload, defined by an input and an output JSON Schema; every
gateway serves it at `POST /v1/endpoints/NAME` (documented at `GET /v1/endpoints/NAME/openapi.json`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from controlplane.cli.client import CliError
from controlplane.cli.output import print_json, print_table
from kunlun_common.api import gateway_pb2, gateway_pb2_grpc
from kunlun_common.i18n import _, error_text


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    e = sub.add_parser(
        "endpoint",
        help="Request-as-a-Service: JSON APIs defined by JSON Schemas, served by a workload",
        parents=[common],
    )
    es = e.add_subparsers(dest="cmd", required=True)
    c = es.add_parser("create", help="create (or replace: the version goes up) an endpoint", parents=[common])
    c.add_argument("name")
    c.add_argument("--workload", required=True, help="the workload whose engine answers")
    c.add_argument("--input-schema", required=True, help="JSON Schema file the request body must satisfy")
    c.add_argument(
        "--output-schema", required=True, help="JSON Schema file of the answer (structured output)"
    )
    c.add_argument(
        "--prompt-template", default="", help="file with the prompt; {field} placeholders come from the input"
    )
    c.set_defaults(handler=create)
    for name, helptext, fn in (
        ("describe", "an endpoint's definition, schemas included", describe),
        ("delete", "stop serving an endpoint", delete),
    ):
        p = es.add_parser(name, help=helptext, parents=[common])
        p.add_argument("name")
        p.set_defaults(handler=fn)
    ls = es.add_parser("list", help="every endpoint", parents=[common])
    ls.set_defaults(handler=list_endpoints)


def _call(args: argparse.Namespace, method: str, req: Any) -> Any:
    from controlplane.cli.main import make_client

    client = make_client(args)
    return client.call_stub(gateway_pb2_grpc.EndpointServiceStub, lambda s: getattr(s, method), req)


def _read(path: str, what: str, as_json: bool) -> str:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise CliError(
            _("{what}: cannot read {path} ({strerror})").format(what=what, path=path, strerror=e.strerror)
        ) from e
    if as_json:
        try:
            json.loads(text)
        except ValueError as e:
            raise CliError(
                _("{what}: {path} is not valid JSON ({e})").format(what=what, path=path, e=error_text(e))
            ) from e
    return text


def endpoint_json(ep: gateway_pb2.RequestEndpoint, schemas: bool = True) -> dict[str, Any]:
    out: dict[str, Any] = {
        "name": ep.name,
        "workload": ep.workload,
        "version": ep.version,
        "path": f"/v1/endpoints/{ep.name}",
        "prompt_template": ep.prompt_template,
        "updated_by": ep.updated_by,
        "updated_at_unix_ms": ep.updated_at_unix_ms,
    }
    if schemas:
        out["input_schema"] = json.loads(ep.input_schema_json or "null")
        out["output_schema"] = json.loads(ep.output_schema_json or "null")
    return out


def create(args: argparse.Namespace) -> int:
    ep = gateway_pb2.RequestEndpoint(
        name=args.name,
        workload=args.workload,
        input_schema_json=_read(args.input_schema, "--input-schema", True),
        output_schema_json=_read(args.output_schema, "--output-schema", True),
        prompt_template=_read(args.prompt_template, "--prompt-template", False)
        if args.prompt_template
        else "",
    )
    got = _call(args, "PutEndpoint", gateway_pb2.PutRequestEndpointRequest(endpoint=ep))
    if args.output == "json":
        print_json(endpoint_json(got))
    else:
        print(
            _("endpoint {name} version {version}: POST /v1/endpoints/{name} on every gateway").format(
                name=got.name, version=got.version
            )
        )
    return 0


def describe(args: argparse.Namespace) -> int:
    d = endpoint_json(_call(args, "GetEndpoint", gateway_pb2.GetRequestEndpointRequest(name=args.name)))
    if args.output == "json":
        print_json(d)
        return 0
    print(
        _("Name:      {name}\nWorkload:  {workload}\nVersion:   {version}").format(
            name=d["name"], workload=d["workload"], version=d["version"]
        )
    )
    print(_("Path:      POST {path}  (OpenAPI: GET {path}/openapi.json)").format(path=d["path"]))
    print(_("Updated:   by {updated_by}").format(updated_by=d["updated_by"]))
    print(_("Prompt:    {value}").format(value=d["prompt_template"] or _("(the input as JSON)")))
    print(
        _("Input:     {dumps}\nOutput:    {dumps2}").format(
            dumps=json.dumps(d["input_schema"]), dumps2=json.dumps(d["output_schema"])
        )
    )
    return 0


def delete(args: argparse.Namespace) -> int:
    got = _call(args, "DeleteEndpoint", gateway_pb2.DeleteRequestEndpointRequest(name=args.name)).endpoint
    if args.output == "json":
        print_json(endpoint_json(got, schemas=False))
    else:
        print(_("endpoint {name} deleted").format(name=got.name))
    return 0


def list_endpoints(args: argparse.Namespace) -> int:
    from controlplane.cli.main import make_client

    eps = make_client(args).pages(
        gateway_pb2_grpc.EndpointServiceStub,
        lambda s: s.ListEndpoints,
        gateway_pb2.ListRequestEndpointsRequest(),
        "endpoints",
    )
    if args.output == "json":
        print_json({"items": [endpoint_json(e, schemas=False) for e in eps]})
        return 0
    print_table(
        ["NAME", "WORKLOAD", "VERSION", "PATH"],
        [[e.name, e.workload, e.version, f"/v1/endpoints/{e.name}"] for e in eps],
    )
    return 0
