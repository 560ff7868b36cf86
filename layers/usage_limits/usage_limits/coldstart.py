"""In Lambda, while a handler module initialises: no garbage collection.

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

Only inside Lambda (``AWS_LAMBDA_FUNCTION_NAME`` set): there a module that fails to import
fails the environment's initialisation, so the collector cannot stay paused in a process
that goes on. Elsewhere (tests, local servers importing several apps) nothing changes.
"""

from __future__ import annotations

import gc
import os

_paused = False


def pause() -> bool:
    """Turn the collector off until ``resume``, inside Lambda and if it is on.

    Returns:
        True when this call paused it.
    """
    global _paused
    if _paused or not os.environ.get("AWS_LAMBDA_FUNCTION_NAME") or not gc.isenabled():
        return False
    gc.disable()
    _paused = True
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


pause()
