"""The EMF lines the code writes carry the metric groups and dimension sets it declares."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from usage_limits.web import observability as obs


@pytest.fixture
def emf(monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> Iterator[Any]:
    """Metrics on, for a function ``structured`` of stage ``dev``; yields a reader of EMF lines."""
    monkeypatch.delenv("POWERTOOLS_METRICS_DISABLED", raising=False)
    monkeypatch.delenv("POWERTOOLS_DEV", raising=False)
    monkeypatch.setenv(obs.STAGE_ENV, "dev")
    monkeypatch.setenv(obs.SERVICE_ENV, "structured")
    monkeypatch.delenv(obs.NAMESPACE_ENV, raising=False)
    obs.reset()
    capsys.readouterr()

    def lines() -> list[dict[str, Any]]:
        out = capsys.readouterr().out
        return [json.loads(line) for line in out.splitlines() if '"_aws"' in line]

    yield lines
    obs.reset()


def _dimension_sets(line: dict[str, Any]) -> set[frozenset[str]]:
    (directive,) = line["_aws"]["CloudWatchMetrics"]
    return {frozenset(d) for d in directive["Dimensions"]}


def _names(line: dict[str, Any]) -> set[str]:
    (directive,) = line["_aws"]["CloudWatchMetrics"]
    return {m["Name"] for m in directive["Metrics"]}


def test_request_metrics_go_out_under_the_declared_dimension_sets(emf: Any) -> None:
    """One line per request: its metrics, the namespace, env, service and route as declared."""
    obs.count(obs.TOKENS_RESERVED, 8)
    obs.request_done("POST /v1/structured", 200)
    obs.flush()
    (line,) = emf()
    assert _names(line) == {obs.TOKENS_RESERVED, obs.REQUESTS}
    assert line["_aws"]["CloudWatchMetrics"][0]["Namespace"] == obs.NAMESPACE
    assert _dimension_sets(line) == {frozenset(d) for d in obs.REQUEST_DIMENSION_SETS}
    assert (line[obs.ENV], line[obs.SERVICE_DIMENSION], line[obs.ROUTE]) == (
        "dev", "structured", "POST /v1/structured")
    assert line[obs.TOKENS_RESERVED] == [8] and line[obs.REQUESTS] == [1]


def test_provider_metrics_go_out_per_provider(emf: Any) -> None:
    """Each provider a request called gets its own line, under the provider dimension sets."""
    obs.provider_count("llm", obs.PROVIDER_CALLS)
    obs.provider_count("llm", obs.UPSTREAM_429)
    obs.provider_count("search", obs.PROVIDER_WAIT_MS, 12.5, unit="Milliseconds")
    obs.request_done("POST /v1/company-research", 200)
    obs.flush()
    lines = emf()
    by_provider = {line.get(obs.PROVIDER): line for line in lines}
    assert set(by_provider) == {None, "llm", "search"}
    expected = {frozenset(d) for d in obs.PROVIDER_DIMENSION_SETS}
    assert _dimension_sets(by_provider["llm"]) == expected
    assert _dimension_sets(by_provider["search"]) == expected
    assert _names(by_provider["llm"]) == {obs.PROVIDER_CALLS, obs.UPSTREAM_429}
    assert by_provider["search"][obs.PROVIDER_WAIT_MS] == [12.5]
    assert _names(by_provider[None]) == {obs.REQUESTS}
    obs.flush()
    assert emf() == []  # nothing is written twice


def test_answers_are_counted_by_status_class(emf: Any) -> None:
    """4xx answers count as client errors, 5xx as server errors, every answer as a request."""
    for status in (200, 429, 503):
        obs.request_done(None, status)
        obs.flush()
    ok, client, server = emf()
    assert _names(ok) == {obs.REQUESTS}
    assert _names(client) == {obs.REQUESTS, obs.CLIENT_ERRORS}
    assert _names(server) == {obs.REQUESTS, obs.SERVER_ERRORS}
    assert server[obs.ROUTE] == obs.UNMATCHED_ROUTE


def test_undeclared_metric_names_are_refused(emf: Any) -> None:
    """A name outside its group raises, so nothing undeclared can reach CloudWatch."""
    with pytest.raises(ValueError, match="not a request metric"):
        obs.count(obs.UPSTREAM_429)
    with pytest.raises(ValueError, match="not a provider metric"):
        obs.provider_count("llm", obs.TOKENS_RESERVED)
    with pytest.raises(ValueError, match="not a request metric"):
        obs.count("Typo")
