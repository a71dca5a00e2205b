"""`kunlun-cli verify`: parse the layers, run them in order, remove what the run created (also on
Ctrl-C, SIGTERM or failure), print every checkpoint, write the report. Exit 0 only when every
checkpoint of every layer that ran passed."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from controlplane.cli.client import CliError
from controlplane.cli.output import print_json
from controlplane.cli.verify import layer1, layer2, layer3, layer4, layer5, report
from controlplane.cli.verify.api import Api
from controlplane.cli.verify.common import Options, text_table
from controlplane.cli.verify.model import LayerResult, Run
from kunlun_common.i18n import _, translate
from kunlun_common.messages import msg, plain

LayerFn = Callable[[Api, Options], LayerResult]
TITLES = {
    1: "Device visibility",
    2: "One model on one card",
    3: "Several cards and load balance",
    4: "Mixed chips",
    5: "High availability and canary",
}


def layer_functions() -> dict[int, LayerFn]:
    return {1: layer1.run, 2: layer2.run, 3: layer3.run, 4: layer4.run, 5: layer5.run}


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "verify",
        help="run the acceptance layers against the live cluster and write a report",
        parents=[common],
        description="Layers: 1 device visibility, 2 one model on one card, 3 several cards and load "
        "balance, 4 mixed chips, 5 high availability and canary (only with --disruptive). "
        "Test workloads use the built-in test engine and are removed at the end.",
    )
    p.add_argument("--layer", default="1..4", help="layers to run: 1..5, 2, or 1,3 (default 1..4)")
    p.add_argument("--report", metavar="DIR", help="write report.md, report.json and SVG pictures into DIR")
    p.add_argument(
        "--device", default="", help="layer 2: the card to use (NODE/TYPE:INDEX; default: a free one)"
    )
    p.add_argument(
        "--node",
        default="",
        help="layer 3: the node whose cards to load (default: the one with most free cards)",
    )
    p.add_argument(
        "--requests",
        type=int,
        default=1000,
        help="requests of the layer 3 and 5 bursts (layer 2: a fifth, layer 4: half)",
    )
    p.add_argument("--concurrency", type=int, default=32, help="concurrent connections of a burst")
    p.add_argument("--burst-timeout", type=float, default=120.0, help="seconds after which a burst stops")
    p.add_argument(
        "--ready-timeout", type=float, default=180.0, help="seconds a test workload may take to serve"
    )
    p.add_argument(
        "--allow-busy",
        action="store_true",
        help="run layers 2-5 even when cards they need serve workloads this run did not create",
    )
    p.add_argument(
        "--declared",
        action="append",
        default=[],
        metavar="NODE-CONFIG.yaml",
        help="layer 1: compare each node's topology matrix with this device-plugin-config file (repeatable)",
    )
    p.add_argument("--disruptive", action="store_true", help="allow layer 5 (stops and restarts a replica)")
    p.add_argument("--replica", default="", help="layer 5: the replica to drain (default: the leader)")
    p.set_defaults(handler=verify)


def parse_layers(text: str) -> list[int]:
    out: set[int] = set()
    for part in text.replace(" ", "").split(","):
        try:
            if ".." in part:
                lo, hi = (int(x) for x in part.split("..", 1))
                out.update(range(lo, hi + 1))
            elif part:
                out.add(int(part))
        except ValueError:
            raise CliError(
                _("--layer: {part!r} is not a layer list; write 1..5, 2 or 1,3").format(part=part)
            ) from None
    if not out or min(out) < 1 or max(out) > 5:
        raise CliError(_("--layer: layers are 1 to 5, found {text!r}").format(text=text))
    return sorted(out)


def _options(args: argparse.Namespace) -> Options:
    if args.requests < 1 or args.requests > 100_000:
        raise CliError(_("--requests: expected 1..100000, found {requests}").format(requests=args.requests))
    if args.concurrency < 1 or args.concurrency > 512:
        raise CliError(
            _("--concurrency: expected 1..512, found {concurrency}").format(concurrency=args.concurrency)
        )
    if args.burst_timeout <= 0 or args.ready_timeout <= 0:
        raise CliError(_("--burst-timeout and --ready-timeout: expected a positive number of seconds"))
    return Options(
        device=args.device,
        node=args.node,
        requests=args.requests,
        concurrency=args.concurrency,
        burst_timeout_s=args.burst_timeout,
        ready_timeout_s=args.ready_timeout,
        allow_busy=args.allow_busy,
        declared=tuple(args.declared),
        disruptive=args.disruptive,
        replica=args.replica,
    )


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt  # SIGTERM cleans up like Ctrl-C


def _say(args: argparse.Namespace, text: str) -> None:
    if args.output != "json":
        print(text, file=sys.stderr, flush=True)


def verify(args: argparse.Namespace) -> int:
    from controlplane.cli.main import make_client

    layers = parse_layers(args.layer)
    opts = _options(args)
    client = make_client(args)
    api = Api(client)
    run = Run(started_unix_ms=int(time.time() * 1000), endpoints=list(client.cfg.endpoints))
    functions = layer_functions()
    old = signal.signal(signal.SIGTERM, _terminate)
    interrupted = False
    try:
        for n in layers:
            if n == 5 and not opts.disruptive:
                run.layers.append(
                    LayerResult(5, TITLES[5], skipped="layer 5 stops a replica: give --disruptive")
                )
                continue
            if n not in functions:  # asked for and allowed, but not there: that is no pass
                missing = LayerResult(n, TITLES[n])
                missing.add(
                    "layer implemented",
                    msg("verify.no", "no"),
                    msg("verify.yes", "yes"),
                    None,
                    note="not implemented in this version",
                )
                run.layers.append(missing)
                continue
            _say(args, _("layer {n}: {title} ...").format(n=n, title=translate(TITLES[n])))
            try:
                result = functions[n](api, opts)
            except CliError as e:
                result = LayerResult(n, TITLES[n])
                result.add(
                    "layer ran to the end",
                    plain(str(e)),
                    msg("verify.no_error", "no error"),
                    None,
                    note="the layer stopped here",
                )
            finally:
                run.cleanup.extend(api.cleanup())  # each layer leaves the cards free for the next
            run.layers.append(result)
            for c in result.checkpoints:
                _say(
                    args,
                    _("  [{verdict:5}] {name}: {measured} (threshold {threshold})").format(
                        verdict=c.verdict.upper(),
                        name=translate(c.name),
                        measured=c.shown_measured,
                        threshold=c.shown_threshold,
                    ),
                )
    except KeyboardInterrupt:
        interrupted = True
        ran = {r.layer for r in run.layers}
        for n in [n for n in layers if n not in ran][:1]:
            cut = LayerResult(n, TITLES[n])
            cut.add(
                "layer ran to the end",
                msg("verify.interrupted", "interrupted"),
                msg("verify.no_interruption", "no interruption"),
                None,
                note="Ctrl-C or SIGTERM",
            )
            run.layers.append(cut)
        run.cleanup.extend(api.cleanup())
        run.cleanup.append(msg("verify.cleanup.interrupted", "interrupted: the remaining layers did not run"))
    finally:
        signal.signal(signal.SIGTERM, old)
    run.finished_unix_ms = int(time.time() * 1000)
    written = report.write(run, Path(args.report)) if args.report else []
    if args.output == "json":
        print_json(run.to_json())
    else:
        rows = report.summary_rows(run)
        print(text_table(["LAYER", "CHECKPOINT", "MEASURED", "THRESHOLD", "RESULT"], report.shown_rows(run)))
        for layer in run.layers:
            if layer.skipped:
                print(
                    _("layer {layer} skipped: {skipped}").format(
                        layer=layer.layer, skipped=translate(layer.skipped)
                    )
                )
        for line in layer_evidence_lines(run):
            print(line)
        print(
            (
                _("\nPASS: {sum}/{count} checkpoints passed")
                if run.passed
                else _("\nFAIL: {sum}/{count} checkpoints passed")
            ).format(
                sum=sum(1 for r in rows if r[4] == "PASS"),
                count=len(rows),
            )
        )
        for done in run.cleanup:
            print(_("cleanup: {line}").format(line=report.shown_line(done)))
    for f in written:
        _say(args, _("wrote {path}").format(path=f))
    if interrupted:
        return 130
    return 0 if run.passed else 1


def layer_evidence_lines(run: Run) -> list[str]:
    """The evidence of every checkpoint that did not pass, for the terminal (the report has all)."""
    out = []
    for layer in run.layers:
        for c in layer.checkpoints:
            if c.passed:
                continue
            head = _("\n-- layer {layer} / {name}: {verdict}").format(
                layer=c.layer, name=translate(c.name), verdict=c.verdict.upper()
            )
            out.append(head + (f" ({translate(c.note)})" if c.note else ""))
            for e in c.evidence:
                out.append(f"$ {e.shown_command}\n{e.shown_output.rstrip()}")
    return out
