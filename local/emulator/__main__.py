"""``python -m local.emulator --port 8100 [--latency-ms 20] [--rate llm=5/s] ...``

Knob options take ``VALUE`` (every family) or ``FAMILY=VALUE`` and may repeat; global
values apply first. ``--fd`` serves on an inherited listening socket (used by
``EmulatorProcess``, which binds the port itself so no other process can take it).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import Any

from .config import FAMILIES, ConfigError, EmulatorConfig

_VALUE_KNOBS = {"latency-ms": "latency_ms", "jitter-ms": "jitter_ms",
                "failure-rate": "failure_rate", "failure-status": "failure_status",
                "rate": "rate", "token-rate": "token_rate"}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m local.emulator",
                                description="Offline emulator of Atto Cloud's upstream providers.")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8100, help="port to bind (default 8100)")
    p.add_argument("--fd", type=int, default=None, help="serve on this inherited socket")
    p.add_argument("--seed", type=int, default=0, help="seeds failure draws and jitter")
    for flag, knob in _VALUE_KNOBS.items():
        p.add_argument(f"--{flag}", dest=knob, action="append", default=[],
                       metavar="[FAMILY=]VALUE", help=f"{knob} for every family or one")
    p.add_argument("--count-rejected", action="append", default=[], nargs="?", const="true",
                   metavar="FAMILY", help="429s also fill the rate window (all or one family)")
    p.add_argument("--no-auth", action="append", default=[], nargs="?", const="true",
                   metavar="FAMILY", help="accept requests without credentials")
    p.add_argument("--config-json", default=None, help="a full config as JSON")
    p.add_argument("--log-level", default="warning")
    p.add_argument("--access-log", action="store_true")
    p.add_argument("--exit-with-parent", action="store_true",
                   help="exit when the process that started this one exits")
    return p


def build_config(args: argparse.Namespace) -> EmulatorConfig:
    """The configuration the command line describes.

    Raises:
        ConfigError: an unknown family or an invalid value.
    """
    if args.config_json:
        raw = json.loads(args.config_json)
        config = EmulatorConfig.build(seed=raw.get("seed", args.seed),
                                      families=raw.get("families"))
    else:
        config = EmulatorConfig.build(seed=args.seed)
    global_knobs: dict[str, Any] = {}
    family_knobs: dict[str, dict[str, Any]] = {name: {} for name in FAMILIES}
    items = [(knob, v) for knob in _VALUE_KNOBS.values() for v in getattr(args, knob)]
    items += [("count_rejected", v) for v in args.count_rejected]
    items += [("require_auth", v) for v in args.no_auth]
    for knob, value in items:
        family, sep, rest = str(value).partition("=")
        if sep and family in FAMILIES:
            target, val = family_knobs[family], rest
        elif knob in ("count_rejected", "require_auth") and value in FAMILIES:
            target, val = family_knobs[value], "true"
        elif sep:
            raise ConfigError(f"unknown family {family!r} in {value!r}")
        else:
            target, val = global_knobs, value
        if knob == "require_auth":
            val = "false"
        target[knob] = val
    return config.updated(families={k: v for k, v in family_knobs.items() if v}, **global_knobs)


def _watch_parent() -> None:
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os.kill(os.getpid(), signal.SIGTERM)
                return

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        config = build_config(args)
    except (ConfigError, ValueError) as exc:
        print(f"emulator: {exc}", file=sys.stderr)
        return 2
    import uvicorn

    from .app import create_app

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s %(message)s")
    app = create_app(config)
    server = uvicorn.Server(uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.log_level,
        access_log=args.access_log, lifespan="off", timeout_graceful_shutdown=2))
    if args.exit_with_parent:
        _watch_parent()
    # uvicorn re-raises the signal that stopped it once it has shut down; answering it
    # quietly here makes SIGTERM and Ctrl-C a clean exit (status 0).
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    if args.fd is not None:
        sock = socket.socket(fileno=args.fd)
        print(f"emulator: serving on fd {args.fd} ({sock.getsockname()})", file=sys.stderr)
        server.run(sockets=[sock])
    else:
        try:  # bind before the banner: a taken port is an error, not a banner then a crash
            sock = socket.create_server((args.host, args.port))
        except OSError as exc:
            print(f"emulator: port {args.port} on {args.host} is already in use ({exc.strerror}); "
                  "choose another with --port", file=sys.stderr)
            return 2
        print(f"emulator: serving on http://{args.host}:{args.port}", file=sys.stderr)
        server.run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
