"""Plans, credit grants and suspensions, kept durably in DynamoDB.

``plans`` is what the request path uses (no AWS import); the store (``store``) imports
boto3 only when it is first used, so importing this package stays cheap.
"""

from __future__ import annotations

from .exceptions import (
    EntitlementError,
    GrantConflict,
    NotFound,
    NotRefreshed,
    StoreUnavailable,
)
from .models import (
    GRANT_KINDS,
    AuditEntry,
    Change,
    Grant,
    PlanOverride,
    SupportRefund,
    Suspension,
    UserEntitlements,
    iso,
    parse_time,
)
from .plans import SINGLE_PLAN_NAME, Plan, Plans, ResolvedPlan, claim_names, parse_windows

__all__ = [
    "GRANT_KINDS", "SINGLE_PLAN_NAME", "AuditEntry", "Change", "EntitlementError", "Grant",
    "GrantConflict",
    "NotFound", "NotRefreshed", "Plan", "PlanOverride", "Plans", "ResolvedPlan", "StoreUnavailable",
    "SupportRefund", "Suspension", "UserEntitlements", "claim_names", "iso", "parse_time",
    "parse_windows",
]
