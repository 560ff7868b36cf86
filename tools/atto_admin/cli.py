"""The command line: ``python -m atto_admin [OPTIONS] COMMAND ... [OPTIONS]``.

    show USER                                   the user's whole picture
    plan set USER PLAN --reason R               override the plan
    plan clear USER --reason R                  remove the override
    grant add USER --tokens N --kind paid|promo --reference REF [--expires-at T] --reason R
    grant void USER REF --reason R              void a grant
    refund USER REQUEST_ID --reason R           refund one charge, at most once
    suspend USER --reason R [--until T]         suspend (403 account_suspended)
    unsuspend USER --reason R                   lift the suspension
    log [--user USER] [--limit N]               operator actions (the audit log), newest first
    audit [--user USER] [--repair]              check that the books balance (exit 3: they do not)
    reload USER                                 drop the user's cached entitlements

The global options (``--json``, ``--url``, ``--stack``, ...) go before or after the command.
``--help`` prints ``DESCRIPTION`` and ``EPILOG``, plain text: where the CLI connects and its
exit statuses.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from .client import LOCAL_PROBE_S, AdminClient, AdminError, is_local, local_serve_url, stack_url
from .output import error_lines, render, statement_csv

URL_ENV = "ATTO_ADMIN_URL"
STACK_ENV = "ATTO_STACK"

DESCRIPTION = "The Atto Cloud operator CLI: one command per route of the operator API."
EPILOG = f"""where it connects:
  --url, else the AdminApiUrl output of the stack --stack (a flag beats the
  environment), else ${URL_ENV}, else the stack ${STACK_ENV}. With none of them set,
  the make serve answering on 127.0.0.1:$PORT (PORT default 8000), waited for up to
  {LOCAL_PROBE_S:g} s; with no make serve there, it fails, naming the URL and PORT: a stack
  is used only when named. A loopback URL is never signed.
  The options above go before or after the command. Every change prints where it
  goes on stderr; a change to a stack whose name contains "prod" asks first (--yes:
  do not ask; with no terminal to ask on, it is refused without --yes).

exit status: 0 done, 1 the API refused (its code, message and details go to stderr),
  2 bad usage, 3 books found not to balance (every divergence is printed), 4 no
  divergence found but some users could not be audited (the notes say why)."""

#: The global options' values when not given (they are SUPPRESSed in every parser, so
#: one given after the command is not overwritten by the top level's default).
GLOBAL_DEFAULTS: dict[str, Any] = {"url": None, "stack": None, "region": None,
                                   "profile": None, "sign": None, "json": False, "yes": False}
#: The commands that change something (the others only read).
CHANGES = ("plan set", "plan clear", "grant add", "grant void", "refund", "suspend",
           "unsuspend", "reload")
#: The exit status of ``audit`` when the books do not balance.
UNBALANCED = 3
#: The exit status of ``audit`` when nothing diverged but some users were not audited.
UNCHECKED = 4


def _global_options() -> argparse.ArgumentParser:
    """The options every command accepts, before or after its name."""
    p = argparse.ArgumentParser(add_help=False, argument_default=argparse.SUPPRESS)
    p.add_argument("--url", help=f"the API's base URL (default ${URL_ENV}, else the stack's)")
    p.add_argument("--stack", help=f"the deployed stack (default ${STACK_ENV}; unset, "
                                   "the make serve on $PORT)")
    p.add_argument("--region", help="AWS region (default: from the URL or your AWS config)")
    p.add_argument("--profile", help="AWS profile of the operator's credentials")
    sign = p.add_mutually_exclusive_group()
    sign.add_argument("--sign", dest="sign", action="store_true",
                      help="SigV4-sign even a loopback URL")
    sign.add_argument("--no-sign", dest="sign", action="store_false",
                      help="do not sign (make serve)")
    p.add_argument("--json", action="store_true", help="print the API's JSON answer")
    p.add_argument("--yes", action="store_true",
                   help="do not ask before a change to a production stack")
    return p


def parser() -> argparse.ArgumentParser:
    """The argument parser (every route has a command)."""
    common = _global_options()
    p = argparse.ArgumentParser(prog="atto-admin", description=DESCRIPTION, epilog=EPILOG,
                                parents=[common],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(parent: argparse._SubParsersAction[argparse.ArgumentParser], name: str,
                help: str) -> argparse.ArgumentParser:
        return parent.add_parser(name, help=help, description=help, parents=[common])

    show = command(sub, "show", "the user's plan, windows, grants, suspension, spend")
    show.add_argument("user")

    plan = command(sub, "plan", "set or clear a plan override")
    plan_sub = plan.add_subparsers(dest="action", required=True)
    plan_set = command(plan_sub, "set", "override the user's plan")
    plan_set.add_argument("user")
    plan_set.add_argument("plan")
    plan_set.add_argument("--reason", required=True)
    plan_clear = command(plan_sub, "clear", "remove the override")
    plan_clear.add_argument("user")
    plan_clear.add_argument("--reason", required=True)

    grant = command(sub, "grant", "add or void a credit grant")
    grant_sub = grant.add_subparsers(dest="action", required=True)
    add = command(grant_sub, "add", "give tokens (idempotent by --reference)")
    add.add_argument("user")
    add.add_argument("--tokens", type=int, required=True)
    add.add_argument("--kind", choices=("paid", "promo"), required=True)
    add.add_argument("--reference", required=True, help="e.g. the invoice id")
    add.add_argument("--expires-at", help="RFC 3339, e.g. 2027-01-31T00:00:00Z")
    add.add_argument("--reason", required=True)
    void = command(grant_sub, "void", "void a grant")
    void.add_argument("user")
    void.add_argument("reference")
    void.add_argument("--reason", required=True)
    history = command(grant_sub, "history", "a grant's history: created, draws, returns, "
                                            "void, expiry")
    history.add_argument("user")
    history.add_argument("reference")

    statement = command(sub, "statement", "the user's usage records and per-day totals")
    statement.add_argument("user")
    span = statement.add_mutually_exclusive_group()
    span.add_argument("--month", type=month_span, help="a UTC month, YYYY-MM")
    span.add_argument("--from", dest="since", help="RFC 3339, inclusive (default: 30 days "
                                                  "before --to)")
    statement.add_argument("--to", dest="until", help="RFC 3339, exclusive (default: now)")
    statement.add_argument("--csv", action="store_true", help="one CSV row per record")

    refund = command(sub, "refund", "refund one charge, at most once")
    refund.add_argument("user")
    refund.add_argument("request_id", help="the X-Request-Id the user quotes (show lists them)")
    refund.add_argument("--reason", required=True)

    suspend = command(sub, "suspend", "suspend the user")
    suspend.add_argument("user")
    suspend.add_argument("--reason", required=True)
    suspend.add_argument("--until", help="RFC 3339; default: until lifted")
    unsuspend = command(sub, "unsuspend", "lift the suspension")
    unsuspend.add_argument("user")
    unsuspend.add_argument("--reason", required=True)

    log = command(sub, "log", "operator actions (the audit log), newest first")
    log.add_argument("--user")
    log.add_argument("--limit", type=int)

    audit = command(sub, "audit", "check that the books balance (the conservation audit)")
    audit.add_argument("--user", help="this user only (default: the users active since the "
                                      "last scheduled run)")
    audit.add_argument("--repair", action="store_true",
                       help="write the usage records that are provably missing")
    reload = command(sub, "reload", "drop the user's cached entitlements (moves no money)")
    reload.add_argument("user")
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
    if command == "grant history":
        return client.grant_history(args.user, args.reference)
    if command == "statement":
        since, until = args.month if args.month else (args.since, args.until)
        return client.statement(args.user, since, until)
    if command == "refund":
        return client.refund(args.user, args.request_id, args.reason)
    if command == "suspend":
        return client.suspend(args.user, args.reason, args.until)
    if command == "unsuspend":
        return client.unsuspend(args.user, args.reason)
    if command == "log":
        return client.log(args.user, args.limit)
    if command == "audit":
        return client.audit(args.user, repair=args.repair)
    if command == "reload":
        return client.reload(args.user)
    raise AssertionError(f"unhandled command {command!r}")  # argparse allows no other


def month_span(month: str) -> tuple[str, str]:
    """``YYYY-MM`` as the RFC 3339 [from, to) of that UTC month.

    Raises:
        argparse.ArgumentTypeError: not a month (argparse prints it, exit status 2).
    """
    try:
        start = datetime.strptime(month, "%Y-%m").replace(tzinfo=UTC)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a month YYYY-MM: {month!r}") from None
    end = start.replace(year=start.year + 1, month=1) if start.month == 12 \
        else start.replace(month=start.month + 1)
    return (start.isoformat().replace("+00:00", "Z"), end.isoformat().replace("+00:00", "Z"))


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line's arguments, the global options filled in where not given."""
    args = parser().parse_args(argv)
    for name, value in GLOBAL_DEFAULTS.items():
        if not hasattr(args, name):
            setattr(args, name, value)
    return args


def resolve_target(args: argparse.Namespace) -> tuple[str, str | None]:
    """The operator API's URL and the stack it belongs to (None: a URL given as such):
    ``--url``, ``--stack`` (a flag beats the environment), ``ATTO_ADMIN_URL``,
    ``ATTO_STACK``, else the ``make serve`` on ``$PORT`` (a note on stderr). A stack is
    used only when one of these names it: a change must never reach a stack nobody named.

    Raises:
        AdminError: the stack's output cannot be read, or nothing is named and no ``make
            serve`` answers (the message names the URL and ``PORT`` it tried).
    """
    if args.url:
        return str(args.url), None
    if args.stack:
        return stack_url(args.stack, region=args.region, profile=args.profile), args.stack
    url = os.environ.get(URL_ENV)
    if url:
        return str(url), None
    stack = os.environ.get(STACK_ENV)
    if stack:
        return stack_url(stack, region=args.region, profile=args.profile), stack
    local = local_serve_url()
    print(f"atto-admin: using make serve at {local} (pass --stack NAME for a deployed "
          "stack)", file=sys.stderr)
    return local, None


def resolve_url(args: argparse.Namespace) -> str:
    """The operator API's URL (``resolve_target``)."""
    return resolve_target(args)[0]


def confirm_change(args: argparse.Namespace, url: str, stack: str | None) -> bool:
    """Say where a change goes (stderr); for a production stack, ask unless ``--yes``.

    Returns:
        False when the change must not be made (refused, or no terminal to ask on).
    """
    command = args.command + (" " + args.action if getattr(args, "action", None) else "")
    if command not in CHANGES:
        return True
    where = f"{url} (stack {stack})" if stack else url
    print(f"atto-admin: {command} -> {where}", file=sys.stderr)
    if stack is None or "prod" not in stack.lower() or args.yes:
        return True
    if not sys.stdin.isatty():
        print(f"atto-admin: {stack} is a production stack; pass --yes to change it",
              file=sys.stderr)
        return False
    answer = input(f"change {stack}? [y/N] ")
    return answer.strip().lower() in ("y", "yes")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; the process exit status."""
    args = parse(argv)
    try:
        url, stack = resolve_target(args)
        if not confirm_change(args, url, stack):
            return 1
        client = AdminClient(url, sign=args.sign, region=args.region, profile=args.profile)
        answer = run(client, args)
    except AdminError as exc:
        if args.json and exc.body is not None:
            print(json.dumps(exc.body, indent=2), file=sys.stderr)
        print("\n".join(error_lines(exc.status, exc.code, exc.message, exc.body)),
              file=sys.stderr)
        return 1
    if getattr(args, "csv", False) and not args.json:
        text = statement_csv(answer)
    else:
        text = json.dumps(answer, indent=2) if args.json else render(
            args.command, answer, local=is_local(url))
    status = _print(text)
    if args.command == "audit" and not answer.get("balanced", False):
        return UNBALANCED
    if args.command == "audit" and answer.get("users_not_audited", 0):
        return UNCHECKED
    return status


def _print(text: str) -> int:
    """Print ``text``; a reader that stops early (``| head``) is no error.

    Returns:
        0, also when the reader closed the pipe: it had what it asked for.
    """
    try:
        print(text)
        sys.stdout.flush()
    except BrokenPipeError:
        # Python would report the broken pipe again when it flushes stdout at exit
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    return 0
