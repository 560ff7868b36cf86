"""Lambda SnapStart: nothing made before the snapshot is shared after a restore.

With SnapStart, Lambda runs a function's initialisation once per published version, takes a
snapshot of the environment's memory, and starts every new execution environment from a copy
of it. Whatever existed when the snapshot was taken then exists, identically, in all of
them: an open socket would be one TCP connection used by many machines, a cached IAM token
or secret would outlive its rotation, and a seeded random generator would produce the same
sequence everywhere.

This module keeps a list of per-environment resets and runs them after every restore::

    from usage_limits import snapstart

    @snapstart.after_restore
    def _forget_clients() -> None:
        global _client
        _client = None

``install()`` (called by ``lambda_handler``) registers ``restore`` with the managed
runtime's ``snapshot_restore_py`` when it is importable, which is the case in the Python
3.12+ managed runtime; elsewhere it does nothing. The resets built in here drop the Redis
client (and with it every pooled connection and its IAM token), the Secrets Manager cache,
the idempotency store and the pending refunds, and reseed ``random``. Nonces and generated
request ids come from ``secrets``/``os.urandom``, which the kernel serves afresh in every
environment, so they are never shared.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable

Reset = Callable[[], None]

_resets: list[Reset] = []
_installed = False


def after_restore(reset: Reset) -> Reset:
    """Register ``reset`` to run after every restore from a snapshot (usable as a decorator).

    Args:
        reset: a callable taking no arguments; it must be cheap, since it runs before the
            restored environment's first request.

    Returns:
        ``reset`` itself.
    """
    if reset not in _resets:
        _resets.append(reset)
    return reset


def restore() -> None:
    """Run every registered reset, in registration order (what the runtime does on restore)."""
    for reset in list(_resets):
        reset()


def install() -> bool:
    """Register ``restore`` with the managed runtime's hooks, once.

    Returns:
        True when the runtime's ``snapshot_restore_py`` is present (the hook is registered).
    """
    global _installed
    try:
        from snapshot_restore_py import register_after_restore
    except ImportError:  # not in a SnapStart-capable managed runtime (local, tests)
        return False
    if not _installed:
        register_after_restore(restore)
        _installed = True
    return True


@after_restore
def _reset_usage_limits() -> None:
    """Forget the Redis client, cached secrets, the idempotency store and pending refunds."""
    random.seed()
    web = "usage_limits.web"
    if f"{web}.runtime" in sys.modules:
        sys.modules[f"{web}.runtime"].set_redis(None)
    if f"{web}.idempotency" in sys.modules:
        sys.modules[f"{web}.idempotency"].reset()
    if f"{web}.refunds" in sys.modules:
        sys.modules[f"{web}.refunds"].clear()
    if "usage_limits.connection" in sys.modules:
        sys.modules["usage_limits.connection"].clear_secret_cache()
