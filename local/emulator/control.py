"""Control endpoints under ``/_emulator/`` (never counted, never delayed).

- ``GET  /_emulator/health``: ``{"ok": true, "pid": ..., "started_at": ...}``;
- ``GET  /_emulator/stats?window_s=1&times=1``: counters per family (see docs/emulator.md);
- ``GET  /_emulator/config``: the current knobs;
- ``POST /_emulator/config``: change knobs, queue forced outcomes;
- ``POST /_emulator/reset``: clear counters, windows and queues, restore the start-up
  knobs (``{"keep_config": true}`` keeps the current ones).

``POST /_emulator/config`` body::

    {"family": "llm",                 # or a list, or omitted for every family
     "rate": "5/s", "latency_ms": 50, # knobs for those families (see FamilyConfig)
     "families": {"search": {"failure_rate": 0.5}},   # knobs per family
     "seed": 7,                       # reseeds failure and jitter RNGs
     "fail_next": {"count": 2, "status": 503, "retry_after_s": 3},   # or {"kind": "quota"}
     "spike_next": {"count": 1, "latency_ms": 2000}}
"""

from __future__ import annotations

import json
import os
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .config import FAMILIES, ConfigError
from .state import EmulatorState


def _bad(message: str) -> Response:
    return JSONResponse({"error": {"code": "invalid_config", "message": message}},
                        status_code=400)


async def _body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if not raw.strip():
        return {}
    value = json.loads(raw)
    if not isinstance(value, dict):
        raise ConfigError("the body must be a JSON object")
    return value


async def health(request: Request) -> Response:
    """Readiness probe."""
    emu: EmulatorState = request.app.state.emulator
    return JSONResponse({"ok": True, "pid": os.getpid(), "started_at": emu.started_at,
                         "families": list(FAMILIES)})


async def stats(request: Request) -> Response:
    """Counters per family."""
    emu: EmulatorState = request.app.state.emulator
    try:
        window_s = float(request.query_params.get("window_s", "1"))
        if not window_s > 0:
            raise ValueError
    except ValueError:
        return _bad("window_s must be a positive number")
    times = request.query_params.get("times", "1").lower() not in ("0", "false", "no")
    return JSONResponse(emu.stats(window_s=window_s, include_times=times))


async def get_config(request: Request) -> Response:
    """The current configuration."""
    emu: EmulatorState = request.app.state.emulator
    return JSONResponse(emu.config.as_dict())


async def post_config(request: Request) -> Response:
    """Change knobs and queue forced outcomes; answers the new configuration."""
    emu: EmulatorState = request.app.state.emulator
    try:
        body = await _body(request)
        target = body.pop("family", None)
        families = body.pop("families", None) or {}
        seed = body.pop("seed", None)
        forced = {k: body.pop(k) for k in ("fail_next", "spike_next") if k in body}
        per_family_forced: list[tuple[str, Any, list[str]]] = []
        family_knobs: dict[str, dict[str, Any]] = {}
        if not isinstance(families, dict):
            raise ConfigError("families must be an object")
        for name, knobs in families.items():
            if name not in FAMILIES or not isinstance(knobs, dict):
                raise ConfigError(f"unknown family {name!r}; known: {', '.join(FAMILIES)}")
            knobs = dict(knobs)
            for kind in ("fail_next", "spike_next"):
                if kind in knobs:
                    per_family_forced.append((kind, knobs.pop(kind), [name]))
            family_knobs[name] = knobs
        new = emu.config.updated(families=family_knobs, target=target, seed=seed, **body)
        targets = _targets(target)
        for kind, spec in forced.items():
            per_family_forced.append((kind, spec, targets))
        # Validate every forced spec before changing anything.
        probe = EmulatorState(new)
        for kind, spec, names in per_family_forced:
            for one in spec if isinstance(spec, list) else [spec]:
                if not isinstance(one, dict):
                    raise ConfigError(f"{kind} must be an object or a list of objects")
                probe.force(kind, one, names)
    except (ConfigError, ValueError, TypeError) as exc:
        return _bad(str(exc))
    emu.apply(new)
    for kind, spec, names in per_family_forced:
        for one in spec if isinstance(spec, list) else [spec]:
            emu.force(kind, one, names)
    out = new.as_dict()
    out["pending"] = {name: {"fail_next": list(map(dict, fam.fail_next)),
                             "spike_next": list(map(dict, fam.spike_next))}
                      for name, fam in emu.families.items()}
    return JSONResponse(out)


async def reset(request: Request) -> Response:
    """Clear counters, windows and queues; restore start-up knobs unless ``keep_config``."""
    emu: EmulatorState = request.app.state.emulator
    try:
        body = await _body(request)
    except (ConfigError, ValueError) as exc:
        return _bad(str(exc))
    emu.reset(keep_config=bool(body.get("keep_config", False)))
    return JSONResponse({"ok": True, "config": emu.config.as_dict()})


def _targets(target: Any) -> list[str]:
    if target is None or target == "all":
        return list(FAMILIES)
    names = [target] if isinstance(target, str) else list(target)
    for name in names:
        if name not in FAMILIES:
            raise ConfigError(f"unknown family {name!r}; known: {', '.join(FAMILIES)}")
    return names
