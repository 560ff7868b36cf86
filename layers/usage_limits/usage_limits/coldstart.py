"""In Lambda, while a handler module initialises: no garbage collection, deferred model builds.

Importing a handler module (FastAPI, pydantic, redis, httpx, the layers, then the app and
its routes) makes a few hundred thousand objects that live as long as the execution
environment. Meanwhile Python's collector runs about 150 times (allocations trigger it), walks
them and frees next to nothing: about a tenth of a cold start's CPU time (40-50 ms of a
~450 ms import + first request on the development machine, measured with ``gc.callbacks``).

Every handler module imports this module first, which pauses the collector (``pause``);
``lambda_handler``, which each module calls last to make its handler, calls ``resume``: it
moves every object made so far into the collector's permanent generation (``gc.freeze``,
so later collections, every request's included, no longer walk them) and turns the
collector back on. Requests run with the collector on, as before.

Pausing also imports FastAPI, unless something already has, with pydantic deferring the
builds of the models it makes meanwhile (``defer_build``, pydantic's own setting for "build
the validator on first use", whose default, ``config_defaults``, is True for that import
only): FastAPI makes some 50 models at import, mostly its OpenAPI document's, whose
validators only ``/openapi.json`` ever needs, and building them is about a third of its
import time (50-60 ms of CPU). A deferred model that is used is built by its first use, as
pydantic does for any deferred model. Every other model (the layers', the app's) is built
when made, as before: deferring them too moved their builds to the first request and, in a
trial, made the first request dearer by more than it saved (about 40 ms of CPU more for the
eager variant of bench/cold_start.py, which imports FastAPI itself).

Only inside Lambda (``AWS_LAMBDA_FUNCTION_NAME`` set): there a module that fails to import
fails the environment's initialisation, so the collector cannot stay paused in a process
that goes on. Elsewhere (tests, local servers importing several apps) nothing changes.
"""

from __future__ import annotations

import gc
import os
import sys

_paused = False


def pause() -> bool:
    """Turn the collector off until ``resume``, inside Lambda and if it is on; then import
    FastAPI with its models' builds deferred, if nothing has imported it yet.

    Returns:
        True when this call paused it.
    """
    global _paused
    if _paused or not os.environ.get("AWS_LAMBDA_FUNCTION_NAME") or not gc.isenabled():
        return False
    gc.disable()
    _paused = True
    _import_fastapi_deferred()
    return True


def resume() -> bool:
    """End a ``pause``: freeze what initialisation made, then turn the collector back on.

    Returns:
        True when the collector was paused (and is now on again).
    """
    global _paused
    if not _paused:
        return False
    _paused = False
    gc.freeze()
    gc.enable()
    return True


def _import_fastapi_deferred() -> None:
    """Import FastAPI (if nothing has yet) with the builds of its models deferred."""
    if "fastapi" in sys.modules:
        return
    from pydantic._internal._config import config_defaults

    if "defer_build" not in config_defaults:  # a pydantic without it: import as usual
        return
    before = config_defaults["defer_build"]
    config_defaults["defer_build"] = True
    try:
        import fastapi  # noqa: F401
    finally:
        config_defaults["defer_build"] = before


pause()
