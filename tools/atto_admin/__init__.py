"""``atto_admin``: the operator CLI of Atto Cloud's usage limits.

It speaks only the operator API's HTTP contract (``/admin/v1/``): requests to a deployed
stack are SigV4-signed with the operator's AWS credentials (botocore's usual lookup:
environment, profile, SSO, instance role); requests to ``make serve`` are not signed.
"""

from __future__ import annotations

from .client import AdminClient, AdminError, stack_url

__all__ = ["AdminClient", "AdminError", "stack_url"]
