"""Usage-threshold and credit events on EventBridge (moto), and what a failed publish costs.

A rule on the bus forwards every ``atto.cloud`` event to an SQS queue, so a test reads
exactly what was published.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from moto import mock_aws

from tests.eventbus import EventBus
from usage_limits import budget
from usage_limits.budget import CreditCrossing
from usage_limits.exceptions import InvalidArgument
from usage_limits.web import events
from usage_limits.web import observability as obs
from usage_limits.web.settings import (
    ATTO_CREDIT_LOW_PERCENT,
    DEFAULT_CREDIT_LOW_PERCENT,
    WebSettings,
    settings,
)

BUS = "atto-test-usage"
#: The publication bound where the bound is not what a test checks: room for moto in
#: this process on a busy machine (the publisher's default of 1 s is for AWS).
ROOMY_S = 30.0


@pytest.fixture
def aws(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """moto's AWS in this process, region us-east-1, metrics collected."""
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.delenv("POWERTOOLS_METRICS_DISABLED", raising=False)
    obs.reset()
    with mock_aws():
        yield
    obs.reset()


def _failed_count() -> float:
    """``EventsFailed`` counted in this request so far."""
    found = obs.metrics().metric_set.get(obs.EVENTS_FAILED)
    return float(sum(found["Value"])) if found else 0.0


THRESHOLD = events.UsageThreshold(user="u-1", plan="free", window_s=3600, threshold=80,
                                  used=85, limit=100)


async def test_every_kind_of_event_reaches_the_bus(aws: None) -> None:
    """Each event arrives once, with its detail-type, source and fields."""
    bus = EventBus(BUS)
    publisher = events.EventPublisher(events.EventSettings(bus=BUS, timeout_s=ROOMY_S))
    sent = [THRESHOLD, *events.credit_events("u-1", "free", [
        CreditCrossing("inv-7", "low", 150, 1000), CreditCrossing("inv-7", "exhausted", 0, 1000)],
        low_percent=20)]
    assert await publisher.publish(sent) is True
    got = bus.received()
    assert [(e["source"], e["detail-type"]) for e in got] == [
        (events.SOURCE, events.USAGE_THRESHOLD), (events.SOURCE, events.CREDIT_LOW),
        (events.SOURCE, events.CREDIT_EXHAUSTED)]
    assert got[0]["detail"] == {"user": "u-1", "plan": "free", "window_s": 3600,
                                "threshold": 80, "used": 85, "limit": 100}
    assert got[1]["detail"] == {"user": "u-1", "plan": "free", "reference": "inv-7",
                                "grant_kind": None, "remaining": 150, "tokens": 1000,
                                "low_percent": 20}
    assert got[2]["detail"] == {"user": "u-1", "plan": "free", "reference": "inv-7",
                                "grant_kind": None, "remaining": 0, "tokens": 1000,
                                "low_percent": 20}
    assert _failed_count() == 0


async def test_more_events_than_one_call_takes_all_arrive(aws: None) -> None:
    """Events beyond PutEvents' ten entries per call go out in further calls."""
    bus = EventBus(BUS)
    publisher = events.EventPublisher(events.EventSettings(bus=BUS, timeout_s=ROOMY_S))
    sent = [events.UsageThreshold("u-2", "free", 60, 80, n, 100) for n in range(23)]
    assert await publisher.publish(sent) is True
    assert sorted(e["detail"]["used"] for e in bus.received()) == list(range(23))


async def test_without_a_bus_nothing_is_published_or_counted(aws: None) -> None:
    """With no bus configured (local mode) publishing is skipped, not counted as a failure."""
    bus = EventBus(BUS)
    publisher = events.EventPublisher(events.EventSettings(bus=None))
    assert await publisher.publish([THRESHOLD]) is False
    assert await publisher.publish([]) is True
    assert bus.received() == [] and _failed_count() == 0


async def test_a_refused_publish_is_counted_and_never_raises(aws: None) -> None:
    """PutEvents failing (no such bus) returns False, logs, and counts every event lost."""
    publisher = events.EventPublisher(events.EventSettings(bus="no-such-bus"))
    assert await publisher.publish([THRESHOLD, THRESHOLD]) is False
    assert _failed_count() == 2


@pytest.fixture
def silent_endpoint() -> Iterator[str]:
    """A TCP server that accepts connections and never answers (a hung EventBridge)."""
    server = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    server.close()


async def test_a_hung_endpoint_is_given_up_within_the_bound(
        monkeypatch: pytest.MonkeyPatch, silent_endpoint: str) -> None:
    """An endpoint that never answers ends in False and one counted failure, not a hang."""
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_ENDPOINT_URL_EVENTBRIDGE", silent_endpoint)
    monkeypatch.delenv("POWERTOOLS_METRICS_DISABLED", raising=False)
    obs.reset()
    publisher = events.EventPublisher(events.EventSettings(bus=BUS, timeout_s=0.3))
    # Without the bound this would wait forever: the endpoint accepts and never replies.
    assert await asyncio.wait_for(publisher.publish([THRESHOLD]), timeout=30) is False
    assert _failed_count() == 1
    assert publisher._events_client().meta.endpoint_url == silent_endpoint
    obs.reset()


async def test_publish_soon_runs_alongside_and_drain_waits_for_it(
        aws: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """``publish_soon`` does not wait; after ``drain`` the event is on the bus."""
    bus = EventBus(BUS)
    monkeypatch.setenv(events.ATTO_EVENT_BUS, BUS)
    monkeypatch.setenv(events.ATTO_EVENTS_TIMEOUT_S, str(ROOMY_S))
    events.publisher.cache_clear()
    events.publish_soon([THRESHOLD])
    events.publish_soon([])
    await events.drain()
    assert [e["detail"]["threshold"] for e in bus.received()] == [80]
    events.publisher.cache_clear()


@dataclass(frozen=True)
class Crossing:
    """Any object with a grant crossing's four attributes (not the ledger's own class)."""

    reference: str
    kind: str
    remaining: int
    tokens: int


def test_credit_events_are_one_entry_per_crossing_with_the_grants_fields() -> None:
    """Each low or exhausted crossing becomes one entry of its detail-type, in order."""
    crossings = [Crossing("promo:welcome", "low", 2, 10), Crossing("inv-9", "low", 40, 200),
                 Crossing("promo:welcome", "exhausted", 0, 10)]
    made = events.credit_events("u-3", "pro", crossings, low_percent=25,
                                grant_kinds={"promo:welcome": "promo"})
    assert made == [
        events.CreditLow("u-3", "pro", "promo:welcome", "promo", 2, 10, 25),
        events.CreditLow("u-3", "pro", "inv-9", None, 40, 200, 25),
        events.CreditExhausted("u-3", "pro", "promo:welcome", "promo", 0, 10, 25)]
    entries = [events.entry(e, BUS) for e in made]
    assert [(e["Source"], e["DetailType"], e["EventBusName"]) for e in entries] == [
        (events.SOURCE, events.CREDIT_LOW, BUS), (events.SOURCE, events.CREDIT_LOW, BUS),
        (events.SOURCE, events.CREDIT_EXHAUSTED, BUS)]
    assert json.loads(entries[2]["Detail"]) == {
        "user": "u-3", "plan": "pro", "reference": "promo:welcome", "grant_kind": "promo",
        "remaining": 0, "tokens": 10, "low_percent": 25}
    assert events.credit_events("u-3", "pro", []) == []


def test_an_unknown_crossing_kind_is_left_out_not_raised() -> None:
    """A crossing that is neither low nor exhausted makes no event and no error."""
    made = events.credit_events("u-4", "free", [Crossing("g", "refilled", 5, 10),
                                                Crossing("g", "exhausted", 0, 10)],
                                low_percent=20)
    assert [type(e) for e in made] == [events.CreditExhausted]


def test_credit_events_name_the_configured_low_percent(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without an explicit percent, the event carries ``ATTO_CREDIT_LOW_PERCENT``."""
    monkeypatch.setenv(ATTO_CREDIT_LOW_PERCENT, "35")
    settings.cache_clear()
    try:
        (low,) = events.credit_events("u-5", "free", [CreditCrossing("g", "low", 3, 10)])
    finally:
        monkeypatch.delenv(ATTO_CREDIT_LOW_PERCENT)
        settings.cache_clear()
    assert low.low_percent == 35
    (low,) = events.credit_events("u-5", "free", [CreditCrossing("g", "low", 2, 10)])
    assert low.low_percent == DEFAULT_CREDIT_LOW_PERCENT == 20


def test_settings_read_the_bus_and_a_positive_bound() -> None:
    """The bus and the bound come from the environment; a bad bound is a clear error."""
    assert events.EventSettings.from_env({}) == events.EventSettings(None, 1.0)
    assert events.EventSettings.from_env(
        {events.ATTO_EVENT_BUS: " b ", events.ATTO_EVENTS_TIMEOUT_S: "0.25"}
    ) == events.EventSettings("b", 0.25)
    for bad in ("0", "-1", "soon", "nan"):
        with pytest.raises(InvalidArgument, match=events.ATTO_EVENTS_TIMEOUT_S):
            events.EventSettings.from_env({events.ATTO_EVENTS_TIMEOUT_S: bad})


def test_the_web_layer_imports_no_aws_sdk_until_an_event_is_published() -> None:
    """Importing the web layer (and with it the publisher) loads neither boto3 nor botocore."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    code = ("import sys\n"
            "import usage_limits.web, usage_limits.web.events\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('boto3', 'botocore')))\n")
    env = {**os.environ, "PYTHONPATH": str(root / "layers" / "usage_limits")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, cwd=root, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_the_credit_low_percent_is_read_once_and_checked() -> None:
    """``ATTO_CREDIT_LOW_PERCENT`` defaults to 20, takes 1..99, and names itself when bad."""
    read = WebSettings.from_env
    assert read({}).credit_low_percent == DEFAULT_CREDIT_LOW_PERCENT == 20
    assert DEFAULT_CREDIT_LOW_PERCENT == budget.DEFAULT_CREDIT_LOW_PERCENT  # the ledger's
    assert read({ATTO_CREDIT_LOW_PERCENT: " 1 "}).credit_low_percent == 1
    assert read({ATTO_CREDIT_LOW_PERCENT: "99"}).credit_low_percent == 99
    for bad in ("0", "100", "-5", "12.5", "low"):
        with pytest.raises(InvalidArgument, match=ATTO_CREDIT_LOW_PERCENT):
            read({ATTO_CREDIT_LOW_PERCENT: bad})
