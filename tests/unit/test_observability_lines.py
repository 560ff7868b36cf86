"""The request path logs through Powertools' Logger, with the settings the docs name."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from usage_limits.web import observability as obs


@pytest.fixture
def fresh_logger(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                 request: pytest.FixtureRequest) -> Iterator[Any]:
    """A new environment's logger (a service of its own); yields a reader of its lines."""
    for name in ("AWS_LAMBDA_LOG_LEVEL", "POWERTOOLS_LOG_LEVEL", "LOG_LEVEL", "POWERTOOLS_DEV"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(obs.SERVICE_ENV, f"lines-{request.node.name}")
    monkeypatch.setattr(obs, "_logger", None)
    capsys.readouterr()

    def lines() -> list[dict[str, Any]]:
        return [json.loads(line) for line in capsys.readouterr().out.splitlines()
                if line.startswith("{") and '"_aws"' not in line]

    yield lines


def test_a_request_line_carries_its_keys_and_no_empty_user(fresh_logger: Any) -> None:
    """Appended keys and extras are written; a key set to None (user) is left out."""
    log = obs.logger()
    log.append_keys(request_id="r-1", route="POST /v1/x", user=None)
    log.info("request", extra={"status": 200, "tokens_charged": 8})
    (line,) = fresh_logger()
    assert line["message"] == "request" and line["level"] == "INFO"
    assert line["service"].startswith("lines-")
    assert (line["request_id"], line["route"], line["status"]) == ("r-1", "POST /v1/x", 200)
    assert "user" not in line


@pytest.mark.parametrize(("settings", "kept"), [
    ({}, ["info", "warning"]),
    ({"LOG_LEVEL": "WARNING"}, ["warning"]),
    ({"LOG_LEVEL": "WARNING", "POWERTOOLS_LOG_LEVEL": "DEBUG"}, ["debug", "info", "warning"]),
])
def test_the_level_follows_the_documented_settings(
        fresh_logger: Any, monkeypatch: pytest.MonkeyPatch, settings: dict[str, str],
        kept: list[str]) -> None:
    """INFO by default; LOG_LEVEL lowers it; POWERTOOLS_LOG_LEVEL wins over LOG_LEVEL."""
    for name, value in settings.items():
        monkeypatch.setenv(name, value)
    log = obs.logger()
    log.debug("debug")
    log.info("info")
    log.warning("warning")
    assert [line["message"] for line in fresh_logger()] == kept
