"""FastAPI glue: ``create_app``, ``require_tokens`` and the public error contract."""

from __future__ import annotations

from .app import COMMON_RESPONSES, METERED_RESPONSES, ErrorBody, create_app
from .charge import Charge
from .errors import (
    ApiError,
    BudgetExceeded,
    CostExceedsPlan,
    IdempotencyConflict,
    InvalidRequest,
    LimiterUnavailableError,
    PayloadTooLarge,
    ProviderBusyError,
    ProviderError,
    Unauthorized,
)
from .guard import current_user, require_tokens
from .lambda_handler import lambda_handler
from .settings import WebSettings, parse_plan, settings

__all__ = [
    "COMMON_RESPONSES", "METERED_RESPONSES", "ApiError", "ErrorBody", "BudgetExceeded", "Charge",
    "CostExceedsPlan",
    "IdempotencyConflict", "InvalidRequest", "LimiterUnavailableError", "PayloadTooLarge",
    "ProviderBusyError", "ProviderError", "Unauthorized", "WebSettings", "create_app",
    "current_user", "lambda_handler", "parse_plan", "require_tokens", "settings",
]
