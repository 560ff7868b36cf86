"""The command line: ``python -m atto_admin [--url URL | --stack NAME] COMMAND ...``.

    show USER                                   the user's whole picture
    plan set USER PLAN --reason R               override the plan
    plan clear USER --reason R                  remove the override
    grant add USER --tokens N --kind paid|promo --reference REF [--expires-at T] --reason R
    grant void USER REF --reason R              void a grant
    refund USER REQUEST_ID --reason R           refund one charge, at most once
    suspend USER --reason R [--until T]         suspend (403 account_suspended)
    unsuspend USER --reason R                   lift the suspension
    audit [--user USER] [--limit N]             operator actions, newest first

The URL is ``--url``, else ``ATTO_ADMIN_URL``, else the ``AdminApiUrl`` output of the stack
``--stack`` (default ``ATTO_STACK``, else ``atto-cloud-dev``). Exit status: 0 done, 1 the
API refused (the error is printed), 2 bad usage.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from .client import AdminClient, AdminError, is_local, stack_url
from .output import render

URL_ENV = "ATTO_ADMIN_URL"
STACK_ENV = "ATTO_STACK"
DEFAULT_STACK = "atto-cloud-dev"


def parser() -> argparse.ArgumentParser:
    """The argument parser (every route has a command)."""
    p = argparse.ArgumentParser(prog="atto-admin", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help=f"the API's base URL (default ${URL_ENV}, else the stack's)")
    p.add_argument("--stack", help=f"the deployed stack (default ${STACK_ENV} or "
                                   f"{DEFAULT_STACK})")
    p.add_argument("--region", help="AWS region (default: from the URL or your AWS config)")
    p.add_argument("--profile", help="AWS profile of the operator's credentials")
    sign = p.add_mutually_exclusive_group()
    sign.add_argument("--sign", dest="sign", action="store_true", default=None,
                      help="SigV4-sign even a loopback URL")
    sign.add_argument("--no-sign", dest="sign", action="store_false",
                      help="do not sign (make serve)")
    p.add_argument("--json", action="store_true", help="print the API's JSON answer")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    show = sub.add_parser("show", help="the user's plan, windows, grants, suspension, spend")
    show.add_argument("user")

    plan = sub.add_parser("plan", help="set or clear a plan override")
    plan_sub = plan.add_subparsers(dest="action", required=True)
    plan_set = plan_sub.add_parser("set", help="override the user's plan")
    plan_set.add_argument("user")
    plan_set.add_argument("plan")
    plan_set.add_argument("--reason", required=True)
    plan_clear = plan_sub.add_parser("clear", help="remove the override")
    plan_clear.add_argument("user")
    plan_clear.add_argument("--reason", required=True)

    grant = sub.add_parser("grant", help="add or void a credit grant")
    grant_sub = grant.add_subparsers(dest="action", required=True)
    add = grant_sub.add_parser("add", help="give tokens (idempotent by --reference)")
    add.add_argument("user")
    add.add_argument("--tokens", type=int, required=True)
    add.add_argument("--kind", choices=("paid", "promo"), required=True)
    add.add_argument("--reference", required=True, help="e.g. the invoice id")
    add.add_argument("--expires-at", help="RFC 3339, e.g. 2027-01-31T00:00:00Z")
    add.add_argument("--reason", required=True)
    void = grant_sub.add_parser("void", help="void a grant")
    void.add_argument("user")
    void.add_argument("reference")
    void.add_argument("--reason", required=True)

    refund = sub.add_parser("refund", help="refund one charge, at most once")
    refund.add_argument("user")
    refund.add_argument("request_id")
    refund.add_argument("--reason", required=True)

    suspend = sub.add_parser("suspend", help="suspend the user")
    suspend.add_argument("user")
    suspend.add_argument("--reason", required=True)
    suspend.add_argument("--until", help="RFC 3339; default: until lifted")
    unsuspend = sub.add_parser("unsuspend", help="lift the suspension")
    unsuspend.add_argument("user")
    unsuspend.add_argument("--reason", required=True)

    audit = sub.add_parser("audit", help="operator actions, newest first")
    audit.add_argument("--user")
    audit.add_argument("--limit", type=int)
    return p


def run(client: AdminClient, args: argparse.Namespace) -> Any:
    """Call the route the command names; its decoded answer."""
    command = args.command + (" " + args.action if getattr(args, "action", None) else "")
    if command == "show":
        return client.show(args.user)
    if command == "plan set":
        return client.set_plan(args.user, args.plan, args.reason)
    if command == "plan clear":
        return client.clear_plan(args.user, args.reason)
    if command == "grant add":
        return client.create_grant(args.user, tokens=args.tokens, kind=args.kind,
                                   reference=args.reference, reason=args.reason,
                                   expires_at=args.expires_at)
    if command == "grant void":
        return client.void_grant(args.user, args.reference, args.reason)
    if command == "refund":
        return client.refund(args.user, args.request_id, args.reason)
    if command == "suspend":
        return client.suspend(args.user, args.reason, args.until)
    if command == "unsuspend":
        return client.unsuspend(args.user, args.reason)
    if command == "audit":
        return client.audit(args.user, args.limit)
    raise AssertionError(f"unhandled command {command!r}")  # argparse allows no other


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; the process exit status."""
    args = parser().parse_args(argv)
    try:
        url = args.url or os.environ.get(URL_ENV) or stack_url(
            args.stack or os.environ.get(STACK_ENV) or DEFAULT_STACK, region=args.region,
            profile=args.profile)
        client = AdminClient(url, sign=args.sign, region=args.region, profile=args.profile)
        answer = run(client, args)
    except AdminError as exc:
        if args.json and exc.body is not None:
            print(json.dumps(exc.body, indent=2), file=sys.stderr)
        where = f"HTTP {exc.status} " if exc.status else ""
        print(f"atto-admin: {where}{exc.code}: {exc.message}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(answer, indent=2))
    else:
        print(render(args.command, answer, local=is_local(url)))
    return 0
