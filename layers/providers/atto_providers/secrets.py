"""Provider credentials: Secrets Manager in the cloud, environment variables locally.

In the cloud, ``<PROVIDER>_SECRET_ARN`` names a secret read through Powertools Parameters,
cached for ``SECRETS_MAX_AGE_S`` (default 300 s) per execution environment. The secret is a
plain string (the API key) or a JSON object whose fields the provider needs (for example
``{"app_id": ..., "app_key": ...}``). Locally, or when no ARN is set, the values come from
``<PROVIDER>_API_KEY`` (and, for JSON fields, ``<PROVIDER>_<FIELD>``). Secret values are
never logged and never part of an error message.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

from usage_limits.web.errors import ProviderError

SECRETS_MAX_AGE_S = "SECRETS_MAX_AGE_S"


def provider_secret(provider: str, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The provider's credentials as a dict (``{"api_key": ...}`` for a plain secret).

    Raises:
        ProviderError: the secret cannot be read (the message never contains its value).
    """
    env = os.environ if env is None else env
    prefix = provider.upper()
    arn = env.get(f"{prefix}_SECRET_ARN")
    if arn:
        from aws_lambda_powertools.utilities import parameters  # only in the cloud

        try:
            raw = parameters.get_secret(arn, max_age=int(env.get(SECRETS_MAX_AGE_S, "300")))
        except Exception as exc:
            raise ProviderError(f"credentials for the {provider} provider are unavailable",
                                provider=provider) from exc
        return _parse(str(raw))
    values = {key[len(prefix) + 1:].lower(): value for key, value in env.items()
              if key.startswith(prefix + "_") and key[len(prefix) + 1:] in _FIELDS}
    return values


_FIELDS = {"API_KEY", "APP_ID", "APP_KEY"}


def _parse(raw: str) -> dict[str, str]:
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        return {"api_key": raw.strip()}
    if isinstance(value, dict):
        return {str(k): str(v) for k, v in value.items()}
    return {"api_key": str(value)}
