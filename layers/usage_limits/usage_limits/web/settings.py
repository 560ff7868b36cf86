"""Settings of the web layer, read once from the environment into a frozen object.

Every name here is documented in docs/configuration.md. Explicit arguments beat the environment.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache

from ..entitlements.config import ENTITLEMENTS_TABLE_ENV
from ..entitlements.plans import SINGLE_PLAN_NAME, Plans, parse_windows
from ..exceptions import InvalidArgument

# "local" enables the X-Atto-User header; anything else ignores it
ATTO_ENV = "ATTO_ENV"
ATTO_BUDGET = "ATTO_BUDGET"            # the plan, e.g. "100/1h,1000/30d"
ATTO_PLANS = "ATTO_PLANS"              # named plans: "free=100/1h,1000/30d;pro=400/1h,..."
ATTO_DEFAULT_PLAN = "ATTO_DEFAULT_PLAN"  # the plan of a user with no override or claim
ATTO_PLAN_CLAIM = "ATTO_PLAN_CLAIM"    # the JWT claim naming the plan (custom:plan, ...)
ATTO_MAX_BODY_BYTES = "ATTO_MAX_BODY_BYTES"
ATTO_DEADLINE_MARGIN_S = "ATTO_DEADLINE_MARGIN_S"
ATTO_REQUEST_TIMEOUT_S = "ATTO_REQUEST_TIMEOUT_S"  # outside Lambda: the function timeout to assume
# a grant is "low" (one Atto Credit Low event) at this share of its tokens or below
ATTO_CREDIT_LOW_PERCENT = "ATTO_CREDIT_LOW_PERCENT"

DEFAULT_BUDGET = "100/1h,1000/30d"
DEFAULT_MAX_BODY_BYTES = 256 * 1024
DEFAULT_DEADLINE_MARGIN_S = 0.5
DEFAULT_REQUEST_TIMEOUT_S = 29.0
DEFAULT_CREDIT_LOW_PERCENT = 20  # the ledger's default (budget.DEFAULT_CREDIT_LOW_PERCENT)


def parse_credit_low_percent(text: str) -> int:
    """Parse ``ATTO_CREDIT_LOW_PERCENT``: an integer percent 1..99 ('' for the default, 20).

    Raises:
        InvalidArgument: the text is not an integer from 1 to 99.
    """
    text = text.strip()
    if not text:
        return DEFAULT_CREDIT_LOW_PERCENT
    try:
        value = int(text)
    except ValueError:
        raise InvalidArgument(f"{ATTO_CREDIT_LOW_PERCENT}: {text!r} is not an integer "
                              "percent (1..99)") from None
    if not 1 <= value <= 99:
        raise InvalidArgument(f"{ATTO_CREDIT_LOW_PERCENT} must be 1..99, got {text!r}")
    return value


def parse_plan(text: str) -> tuple[tuple[int, int], ...]:
    """Parse ``"100/1h,1000/30d"`` into ``((100, 3600), (1000, 2592000))`` (limit, seconds).

    Raises:
        InvalidArgument: the text is not a comma-separated list of ``LIMIT/[N]UNIT``.
    """
    return parse_windows(text, setting=ATTO_BUDGET)


def parse_plans(env: Mapping[str, str]) -> Plans:
    """The deployment's plans: ``ATTO_PLANS`` and ``ATTO_DEFAULT_PLAN``, else ``ATTO_BUDGET``
    alone as the plan ``default``.

    Raises:
        InvalidArgument: a plan is malformed, or the default names no plan.
    """
    text = env.get(ATTO_PLANS, "").strip()
    default = env.get(ATTO_DEFAULT_PLAN, "").strip() or None
    if not text:
        if default not in (None, SINGLE_PLAN_NAME):
            raise InvalidArgument(f"{ATTO_DEFAULT_PLAN}={default!r} needs {ATTO_PLANS}")
        return Plans.single(parse_plan(env.get(ATTO_BUDGET) or DEFAULT_BUDGET))
    return Plans.parse(text, default)


@dataclass(frozen=True)
class WebSettings:
    """What the web layer needs from the environment.

    Attributes:
        local: True only when ``ATTO_ENV=local``; enables the ``X-Atto-User`` header.
        plan: the default plan's windows as (limit, seconds), shortest first.
        plans: every plan of the deployment, and the default.
        plan_claim: the JWT claim that names a user's plan (None: every user without an
            override gets the default plan).
        max_body_bytes: request bodies above this get 413 ``payload_too_large``.
        deadline_margin_s: time kept back from the request deadline for refunds.
        request_timeout_s: the timeout assumed when there is no Lambda context (local
            serving); in Lambda the context's remaining time is used.
        entitlements: True when ``ATTO_ENTITLEMENTS_TABLE`` names the entitlements table:
            the request path then applies plan overrides, grants and suspensions.
        credit_low_percent: a grant whose remaining falls to this share of its tokens or
            below is reported once as low (1..99); the ledgers are made with it.
    """

    local: bool = False
    plan: tuple[tuple[int, int], ...] = parse_plan(DEFAULT_BUDGET)
    plans: Plans = Plans.single(parse_plan(DEFAULT_BUDGET))
    plan_claim: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    deadline_margin_s: float = DEFAULT_DEADLINE_MARGIN_S
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S
    entitlements: bool = False
    credit_low_percent: int = DEFAULT_CREDIT_LOW_PERCENT

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> WebSettings:
        """Read the settings from ``env`` (default ``os.environ``).

        Raises:
            InvalidArgument: a value is malformed.
        """
        env = os.environ if env is None else env
        try:
            max_body = int(env.get(ATTO_MAX_BODY_BYTES, DEFAULT_MAX_BODY_BYTES))
            margin = float(env.get(ATTO_DEADLINE_MARGIN_S, DEFAULT_DEADLINE_MARGIN_S))
            timeout = float(env.get(ATTO_REQUEST_TIMEOUT_S, DEFAULT_REQUEST_TIMEOUT_S))
        except ValueError as exc:
            raise InvalidArgument(f"malformed web setting: {exc}") from exc
        if max_body <= 0 or margin < 0 or timeout <= 0:
            raise InvalidArgument(f"{ATTO_MAX_BODY_BYTES} and {ATTO_REQUEST_TIMEOUT_S} must be "
                                  f"> 0 and {ATTO_DEADLINE_MARGIN_S} >= 0")
        plans = parse_plans(env)
        credit_low = parse_credit_low_percent(env.get(ATTO_CREDIT_LOW_PERCENT, ""))
        return cls(
            local=env.get(ATTO_ENV, "").strip().lower() == "local",
            plan=plans.default_plan.windows,
            plans=plans,
            plan_claim=env.get(ATTO_PLAN_CLAIM, "").strip() or None,
            max_body_bytes=max_body,
            deadline_margin_s=margin,
            request_timeout_s=timeout,
            entitlements=bool(env.get(ENTITLEMENTS_TABLE_ENV, "").strip()),
            credit_low_percent=credit_low,
        )


@cache
def settings() -> WebSettings:
    """The process-wide settings, read once per execution environment."""
    return WebSettings.from_env()
