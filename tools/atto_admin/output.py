"""Readable output for a person (``--json`` prints the API's answer instead)."""

from __future__ import annotations

import csv
import io
from typing import Any

#: The columns of ``statement --csv``, one row per usage record.
CSV_COLUMNS = ("request_id", "at", "route", "plan", "state", "cost", "kept", "refunded",
               "credit", "changed_at")
#: First characters that make a spreadsheet read a cell as a formula, as OWASP's "CSV
#: Injection" lists them (=, +, -, @, tab, carriage return); such a cell is written with a
#: ``'`` before it, which spreadsheets show as text and hide. A cell that already begins with
#: ``'`` gets one too, so ``csv_cell`` is undone exactly by dropping one leading ``'``
#: (``csv_value``): a user's Idempotency-Key ``'=1`` comes back as itself, not ``=1``.
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r", "'")


def _grant_line(g: dict[str, Any]) -> str:
    state = "live" if g.get("live") else ("void" if g.get("voided") else "spent/expired")
    expiry = g.get("expires_at") or "never"
    return (f"  {g['reference']:<24} {g['kind']:<5} {g['remaining']:>8} of {g['tokens']:<8} "
            f"expires {expiry:<24} {state}")


def _picture(p: dict[str, Any]) -> str:
    lines = [f"user      {p['user_id']}",
             f"plan      {p['plan']['name']} ({p['plan']['source']})"]
    if p.get("override"):
        o = p["override"]
        lines.append(f"override  {o['plan']} by {o['by']} at {o['at']}: {o['reason']}")
    last = p.get("last_charged")
    lines.append(f"charged   under {last['plan'] or '(no plan name)'} at {last['at']} (the last "
                 "charge that stands)" if last else
                 "charged   unknown (no charge the cache still holds)")
    s = p.get("suspension")
    if s and s["active"]:
        lines.append(f"suspended YES, until {s['until'] or 'lifted'}, by {s['by']} "
                     f"since {s['since']}: {s['reason']}")
    elif s:
        lines.append(f"suspended no (a suspension by {s['by']} from {s['since']} ended at "
                     f"{s['until']}: {s['reason']})")
    else:
        lines.append("suspended no")
    lines.append("windows")
    for w in p["windows"]:
        reset = f", frees at {w['resets_at']}" if w.get("resets_at") else ""
        lines.append(f"  {w['window_s']:>9} s  {w['used']:>8} used of {w['limit']:<8} "
                     f"{w['remaining']} left{reset}")
    lines.append(f"credit    {p['credit']} tokens in live grants")
    for g in p["grants"]:
        lines.append(_grant_line(g))
    lines.append(f"events    {len(p['events'])} most recent")
    for e in p["events"]:
        lines.append(f"  {e['at']}  {e['cost']:>6}  {e['route']:<28} {e['request_id']}")
    return "\n".join(lines)


def _log(a: dict[str, Any]) -> str:
    if not a["entries"]:
        return "no operator actions"
    return "\n".join(f"{e['at']}  {e['user_id']:<20} {e['action']:<16} by {e['by']}: "
                     f"{e['reason']}  {_details(e['details'])}".rstrip() for e in a["entries"])


def _books(b: dict[str, Any]) -> str:
    head = (f"{b['users_audited']} of {b['users_active']} users audited "
            f"(since {b['since']}): ")
    missed = b.get("users_not_audited", 0)
    if b["balanced"] and not missed:
        lines = [head + "the books balance"]
    elif b["balanced"]:
        lines = [head + f"no divergence among them, but {missed} not audited, so the books "
                        "are not known to balance (see the notes)"]
    else:
        lines = [head + f"{b['divergence_count']} divergences, "
                        f"{b['divergence_tokens']} tokens off"]
    for d in b["divergences"]:
        where = d["reference"] or " ".join(d["request_ids"])
        mark = " (repaired)" if d["repaired"] else ""
        lines.append(f"  {d['kind']:<19} {d['user_id']:<20} {d['tokens']:>8} tokens  "
                     f"{where}{mark}")
        lines.append(f"    {d['detail']}")
        lines.append(f"    fix: {d['fix']}")
    for user, notes in b.get("notes", {}).items():
        for note in notes:
            lines.append(f"  note {user}: {note}")
    return "\n".join(lines)


def _credit(record: dict[str, Any]) -> str:
    """A record's credit draws as ``ref=n ref=n`` ("" for none)."""
    return " ".join(f"{c['reference']}={c['tokens']}" for c in record.get("credit") or [])


def _summary(t: dict[str, Any]) -> list[str]:
    """A statement's summary: what was charged, given back and kept, charges and tokens."""
    return [f"  charged   {t['charges']:>6} charges {t['reserved']:>9} tokens",
            f"  refunded  {t['refunds']:>6} charges {t['refunded']:>9} tokens  (refunded whole; "
            f"the tokens include what settles gave back)",
            f"  kept      {t['charges'] - t['refunds']:>6} charges {t['kept']:>9} tokens  "
            f"({t['credit']} drawn from credit)"]


def _statement(s: dict[str, Any]) -> str:
    lines = [f"statement of {s['user_id']} from {s['from']} to {s['to']}"]
    if s.get("summary"):
        lines += _summary(s["summary"])
    lines.append("days (UTC)    charges  reserved   refunds  refunded      kept    credit")
    for d in s.get("days") or []:
        lines.append(f"  {d['day']}  {d['charges']:>7} {d['reserved']:>9} {d['refunds']:>9} "
                     f"{d['refunded']:>9} {d['kept']:>9} {d['credit']:>9}")
    lines.append("records (newest first)")
    for r in s["records"]:
        credit = _credit(r)
        lines.append(f"  {r['at']}  {r['state']:<16} {r['kept']:>6} of {r['cost']:<6} "
                     f"{r['route']:<24} {r['request_id']}"
                     + (f"  credit {credit}" if credit else ""))
    return "\n".join(lines)


def csv_cell(value: Any) -> str:
    """``value`` as a CSV cell no spreadsheet evaluates (``FORMULA_STARTS``)."""
    text = "" if value is None else str(value)
    return "'" + text if text.startswith(FORMULA_STARTS) else text


def csv_value(cell: str) -> str:
    """The value ``csv_cell`` wrote as ``cell`` (its inverse)."""
    return cell[1:] if cell.startswith("'") else cell


def statement_csv(s: dict[str, Any]) -> str:
    """A statement as CSV: a header, then one row per record (``CSV_COLUMNS``).

    Every cell is quoted (a separator or line break inside one cannot start a new cell) and
    escaped with ``csv_cell`` (a user's Idempotency-Key is the request id: it may read
    ``=HYPERLINK(...)``), as OWASP's "CSV Injection" recommends.
    """
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n", quoting=csv.QUOTE_ALL)
    writer.writerow(CSV_COLUMNS)
    for r in s["records"]:
        writer.writerow([csv_cell(v) for v in (
            r["request_id"], r["at"], r["route"], r["plan"], r["state"], r["cost"],
            r["kept"], r["refunded"], _credit(r), r.get("changed_at") or "")])
    return out.getvalue().rstrip("\n")


def _grant_history(h: dict[str, Any]) -> str:
    lines = [f"grant {h['reference']} of {h['user_id']}"]
    for e in h["events"]:
        who = f" by {e['actor']}: {e['reason']}" if e.get("actor") else ""
        rid = f" {e['request_id']}" if e.get("request_id") else ""
        lines.append(f"  {e['at']}  {e['kind']:<8} {e['tokens']:>8}{rid}{who}")
    return "\n".join(lines)


def _details(details: Any) -> str:
    """An audit entry's details as ``key=value`` pairs (none shown as ``-``)."""
    if not isinstance(details, dict):
        return str(details or "")
    return " ".join(f"{k}={'-' if v is None else v}" for k, v in sorted(details.items()))


def error_lines(status: int, code: str, message: str, body: Any) -> list[str]:
    """An error for stderr: the status, code and message, then each validation detail
    (``tokens: Input should be greater than 0``) and the request id to quote."""
    where = f"HTTP {status} " if status else ""
    lines = [f"atto-admin: {where}{code}: {message}"]
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        for d in error.get("details") or []:
            if isinstance(d, dict):
                loc = ".".join(str(x) for x in d.get("loc") or [] if x not in ("body", "query"))
                lines.append(f"  {loc or 'request'}: {d.get('msg')}")
        if error.get("request_id"):
            lines.append(f"  request id: {error['request_id']}")
    return lines


def render(command: str, answer: Any, *, local: bool = False) -> str:
    """The answer of ``command`` as lines for a person."""
    if command == "show":
        return _picture(answer)
    if command == "log":
        return _log(answer)
    if command == "audit":
        return _books(answer)
    if "reloaded" in answer:
        return (f"the cached entitlements of {answer['user_id']} were dropped: the next "
                "request loads them from DynamoDB" if answer["reloaded"]
                else "this deployment caches no entitlements")
    if command == "statement":
        return _statement(answer)
    if "events" in answer and "reference" in answer:
        return _grant_history(answer)
    user = answer.get("user_id", "")
    if "grant" in answer:
        verb = ("created" if answer.get("created") else "already existed") \
            if "created" in answer else ("voided" if answer.get("voided") else "was already void")
        return f"grant {answer['grant']['reference']} for {user} {verb}\n" + \
            _grant_line(answer["grant"])
    if "refund" in answer:
        r = answer["refund"]
        verb = "refunded" if answer.get("created") else "was already refunded"
        return f"{r['request_id']} of {user} {verb}: {r['tokens']} tokens"
    if "cleared" in answer:
        return (f"plan override of {user} cleared" if answer["cleared"]
                else f"{user} had no plan override")
    if "override" in answer:
        return f"{user} is now on plan {answer['override']['plan']}"
    if "lifted" in answer:
        return (f"suspension of {user} lifted" if answer["lifted"]
                else f"{user} was not suspended")
    if "suspension" in answer:
        s = answer["suspension"]
        return f"{user} suspended until {s['until'] or 'lifted'}: {s['reason']}"
    return str(answer)
