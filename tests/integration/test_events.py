"""Every event in events/ answers offline, through `make invoke`, with its documented status."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from local.template import every_function
from tests import serving

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def documented_events() -> dict[str, tuple[str, int | None]]:
    """docs/development.md's event table: event file -> (function, status; None for the
    scheduled auditor's event, answered by its report)."""
    text = (ROOT / "docs" / "development.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| `(events/\w+\.json)` \| `(\w+)` \| (\d{3}|its report.*) \|$", text,
                      re.M)
    return {path: (function, int(status) if status.isdigit() else None)
            for path, function, status in rows}


def test_every_event_and_every_function_is_documented() -> None:
    """The table lists every event file (env.json is settings, not an event) and no other,
    and every function of template.yaml, the scheduled auditor included, has one."""
    files = {f"events/{p.name}" for p in (ROOT / "events").glob("*.json")
             if p.name != "env.json"}
    assert set(documented_events()) == files
    assert {f for f, _ in documented_events().values()} == {fn.name for fn in every_function()}


@pytest.mark.parametrize(("event", "function", "status"),
                         [(e, f, s) for e, (f, s) in documented_events().items()])
def test_event_answers_its_documented_status(event: str, function: str,
                                             status: int | None) -> None:
    """`make invoke FN=<function> EVENT=<event>` on a fresh stack answers the documented
    status (the auditor: a report of balanced books)."""
    out = serving.invoke(function, event)
    assert out.returncode == 0, out.stderr[-2000:]
    response = json.loads(out.stdout)
    if status is None:
        assert response["balanced"] is True and response["users_not_audited"] == 0
        return
    assert response["statusCode"] == status, response["body"]
    if status == 200:
        assert "error" not in response["body"]
