"""A client for Atto Cloud: correct by default.

Every call carries an ``Idempotency-Key`` reused across its retries (never charged twice),
503s, a 409 "in progress" and connection errors are retried honouring ``Retry-After``
within a total time, every error code is a typed exception, and the budget headers of the
last answer are data (``client.rate_limit``)::

    from atto_cloud_client import AttoClient

    with AttoClient("http://127.0.0.1:8000", user="alice") as atto:   # make serve
        answer = atto.structured("Summarise: senior Python engineer, Berlin",
                                 {"type": "object", "properties": {"title": {"type": "string"}}})
        print(answer.data, atto.rate_limit.remaining)

Sign-in (``LoopbackSignIn``) and the test double (``atto_cloud_client.testing``) are in their
own modules; the first is re-exported here, the second is not imported by default.
"""

from ._core import NO_RETRY, RetryPolicy
from .client import AsyncAttoClient, AttoClient
from .exceptions import (
    AccountSuspended,
    ApiError,
    AttoError,
    BudgetExceeded,
    ContentFiltered,
    CostExceedsPlan,
    IdempotencyAnswerGone,
    IdempotencyConflict,
    IdempotencyKeyReused,
    InternalError,
    InvalidRequest,
    LimiterUnavailable,
    ModelRefused,
    OutputTruncated,
    PayloadTooLarge,
    ProviderBusy,
    ProviderError,
    ProviderQuotaExceeded,
    SchemaRejected,
    ServiceUnavailable,
    SignInError,
    TransportError,
    Unauthorized,
)
from .models import (
    CompanyResearch,
    CreditBalance,
    CreditGrant,
    EmbeddingsResult,
    EndedGrant,
    JobListing,
    MarketContext,
    ResponseInfo,
    SalaryResult,
    StructuredResult,
    SupportRefund,
    Usage,
    UsageDay,
    UsageHistory,
    UsageHistoryRecord,
    UsageTotals,
)
from .ratelimit import RateLimitStatus, RateLimitWindow
from .signin import LoopbackSignIn, OIDCEndpoints
from .tokens import FileTokenStore, MemoryTokenStore, TokenSet, TokenStore

__all__ = [
    "NO_RETRY",
    "AccountSuspended",
    "ApiError",
    "AsyncAttoClient",
    "AttoClient",
    "AttoError",
    "BudgetExceeded",
    "CompanyResearch",
    "ContentFiltered",
    "CostExceedsPlan",
    "CreditBalance",
    "CreditGrant",
    "EmbeddingsResult",
    "EndedGrant",
    "FileTokenStore",
    "IdempotencyAnswerGone",
    "IdempotencyConflict",
    "IdempotencyKeyReused",
    "InternalError",
    "InvalidRequest",
    "JobListing",
    "LimiterUnavailable",
    "LoopbackSignIn",
    "MarketContext",
    "MemoryTokenStore",
    "ModelRefused",
    "OIDCEndpoints",
    "OutputTruncated",
    "PayloadTooLarge",
    "ProviderBusy",
    "ProviderError",
    "ProviderQuotaExceeded",
    "RateLimitStatus",
    "RateLimitWindow",
    "ResponseInfo",
    "RetryPolicy",
    "SalaryResult",
    "SchemaRejected",
    "ServiceUnavailable",
    "SignInError",
    "StructuredResult",
    "SupportRefund",
    "TokenSet",
    "TokenStore",
    "TransportError",
    "Unauthorized",
    "Usage",
    "UsageDay",
    "UsageHistory",
    "UsageHistoryRecord",
    "UsageTotals",
]
