"""``make invoke FN=structured EVENT=events/structured.json``: run one handler like Lambda.

Loads ``functions/<FN>/app.py``, calls its Mangum ``handler`` with the event and a Lambda
context whose timeout is the function's ``Timeout`` in template.yaml, and prints the
response with its body decoded. Starts the local stack (private redis-server, emulator)
when ``REDIS_URL``/``LLM_BASE_URL`` are unset, as ``sam local invoke`` would need.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import sys


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m local.invoke FUNCTION EVENT_JSON", file=sys.stderr)
        return 2
    name, event_path = argv
    from .lambda_events import FakeContext
    from .stack import local_stack
    from .template import functions

    spec = next((fn for fn in functions() if fn.code_dir.rstrip("/").endswith("/" + name)), None)
    if spec is None:
        known = ", ".join(sorted(fn.code_dir.rstrip("/").rsplit("/", 1)[-1] for fn in functions()))
        print(f"unknown function {name!r}; known: {known}", file=sys.stderr)
        return 2
    with open(event_path, encoding="utf-8") as f:
        event = json.load(f)
    with local_stack():
        module = importlib.import_module(spec.code_dir.strip("/").replace("/", ".") + ".app")
        result = module.handler(event, FakeContext(timeout_s=float(spec.timeout),
                                                   function_name=spec.logical_id))
    body = result.get("body")
    if isinstance(body, str):
        with contextlib.suppress(ValueError):
            result["body"] = json.loads(body)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
