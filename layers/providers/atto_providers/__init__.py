"""Clients for Atto Cloud's paid upstream providers, each throttled through Redis.

Modules are imported on demand by the functions that need them (cold start): the
structured-output function imports only ``atto_providers.llm``.
"""

from __future__ import annotations

import sys

from usage_limits import snapstart

#: Per-environment singletons of the provider modules: (module, attribute).
_SINGLETONS = (("atto_providers.base", "_http"), ("atto_providers.llm", "_client"),
               ("atto_providers.salary", "_client"), ("atto_providers.search", "_client"),
               ("atto_providers.fetch", "_fetcher"))


@snapstart.after_restore
def _forget_clients() -> None:
    """After a SnapStart restore: new HTTP connections and freshly read provider secrets."""
    for module, attribute in _SINGLETONS:
        if module in sys.modules:
            setattr(sys.modules[module], attribute, None)
    if "aws_lambda_powertools.utilities.parameters" in sys.modules:
        sys.modules["aws_lambda_powertools.utilities.parameters"].clear_caches()
