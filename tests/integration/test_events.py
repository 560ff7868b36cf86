"""Every event in events/ answers offline, through `make invoke`, with its documented status."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests import serving

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def documented_events() -> dict[str, tuple[str, int]]:
    """docs/development.md's event table: event file -> (function, status)."""
    text = (ROOT / "docs" / "development.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| `(events/\w+\.json)` \| `(\w+)` \| (\d{3}) \|$", text, re.M)
    return {path: (function, int(status)) for path, function, status in rows}


def test_every_event_is_documented() -> None:
    """The table lists every event file (env.json is settings, not an event; the auditor's
    schedule event is no API event) and no other."""
    files = {f"events/{p.name}" for p in (ROOT / "events").glob("*.json")
             if p.name not in ("env.json", "auditor_schedule.json")}
    assert set(documented_events()) == files


@pytest.mark.parametrize(("event", "function", "status"),
                         [(e, f, s) for e, (f, s) in documented_events().items()])
def test_event_answers_its_documented_status(event: str, function: str, status: int) -> None:
    """`make invoke FN=<function> EVENT=<event>` on a fresh stack answers the documented status."""
    out = serving.invoke(function, event)
    assert out.returncode == 0, out.stderr[-2000:]
    response = json.loads(out.stdout)
    assert response["statusCode"] == status, response["body"]
    if status == 200:
        assert "error" not in response["body"]
