"""``make invoke FN=structured EVENT=events/structured.json``: run one handler like Lambda.

Loads ``functions/<FN>/app.py`` (any function of template.yaml: one with routes, or the
scheduled auditor, whose event is ``events/auditor_schedule.json``) with the function's own
environment from template.yaml
(the shell's and the local stack's values winning, as ``--env-vars`` wins under
``sam local invoke``), calls its Mangum ``handler`` with the event and a Lambda context whose
timeout is the function's ``Timeout``, and prints the response with its body decoded.
Starts the local stack (private redis-server, emulator, local DynamoDB tables) when
``REDIS_URL``/``LLM_BASE_URL``/``ATTO_ENTITLEMENTS_TABLE`` are unset, as ``sam local
invoke`` would need. An event that names the emulator at its
documented address (``http://127.0.0.1:8100``) is pointed at the emulator this run started.

Exit status: 0 when the handler answered, 2 for a usage error (unknown function, an event
file that is missing or not a JSON object), each reported in one line.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
from pathlib import Path
from typing import Any


class EventError(Exception):
    """The event file cannot be used; the message is one line naming the file."""


def load_event(path: str) -> dict[str, Any]:
    """Read an API Gateway event from a JSON file.

    Args:
        path: the event file.

    Returns:
        The event.

    Raises:
        EventError: the file is missing, unreadable, not JSON or not a JSON object.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise EventError(f"event file not found: {path}") from None
    except OSError as exc:
        raise EventError(f"cannot read event file {path}: {exc.strerror or exc}") from None
    try:
        event = json.loads(text)
    except ValueError as exc:
        raise EventError(f"event file {path} is not JSON: {exc}") from None
    if not isinstance(event, dict):
        raise EventError(f"event file {path} is not a JSON object")
    return event


def retarget_event(event: dict[str, Any], documented_url: str, actual_url: str) -> dict[str, Any]:
    """The event with the emulator's documented base URL in its body replaced by the actual one.

    Args:
        event: a payload-v2 event.
        documented_url: the base URL events and docs name (``http://127.0.0.1:8100``).
        actual_url: where the emulator of this run listens.

    Returns:
        The event itself when nothing changes, else a copy with its body and
        ``content-length`` header updated.
    """
    body = event.get("body")
    if (documented_url == actual_url or not isinstance(body, str) or event.get("isBase64Encoded")
            or documented_url not in body):
        return event
    body = body.replace(documented_url, actual_url)
    headers = dict(event.get("headers") or {})
    for name in list(headers):
        if name.lower() == "content-length":
            headers[name] = str(len(body.encode()))
    return {**event, "body": body, "headers": headers}


def main(argv: list[str]) -> int:
    """Invoke one function with one event; see the module docstring."""
    if len(argv) != 2:
        print("usage: python -m local.invoke FUNCTION EVENT_JSON", file=sys.stderr)
        return 2
    name, event_path = argv
    from .lambda_events import FakeContext
    from .stack import DOCUMENTED_EMULATOR_URL, local_stack
    from .template import every_function, local_environment

    known = every_function()
    spec = next((fn for fn in known if fn.name == name), None)
    if spec is None:
        names = sorted(fn.name for fn in known)
        print(f"make invoke: unknown function {name!r}; known: {', '.join(names)}",
              file=sys.stderr)
        return 2
    try:
        event = load_event(event_path)
    except EventError as exc:
        print(f"make invoke: {exc}", file=sys.stderr)
        return 2
    with local_stack() as started:
        if "EMULATOR_URL" in started:
            event = retarget_event(event, DOCUMENTED_EMULATOR_URL, started["EMULATOR_URL"])
        os.environ.update(local_environment(spec, os.environ))
        module_name, _, attribute = spec.handler.rpartition(".")
        module = importlib.import_module(spec.code_dir.strip("/").replace("/", ".") + "."
                                         + module_name)
        result = getattr(module, attribute)(event, FakeContext(
            timeout_s=float(spec.timeout), function_name=spec.logical_id))
    body = result.get("body")
    if isinstance(body, str):
        with contextlib.suppress(ValueError):
            result["body"] = json.loads(body)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
