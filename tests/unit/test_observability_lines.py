"""The hand-written log and EMF lines are the ones Powertools' Logger and Metrics write."""

from __future__ import annotations

import io
import json
import logging
import re
import warnings
from typing import Any

import pytest

from usage_limits.web import emf, jsonlog
from usage_limits.web import observability as obs


def _powertools_logger(service: str, stream: io.StringIO) -> Any:
    from aws_lambda_powertools import Logger

    return Logger(service=service, level="DEBUG", stream=stream)


def _lines(stream: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def _log_everything(log: Any) -> None:
    """The kinds of line the layers write: keys, extras, %-arguments, an exception."""
    log.append_keys(request_id="r-1", route="POST /v1/x", user=None)
    log.info("request", extra={"status": 200, "duration_ms": 1.25, "tokens_charged": 8,
                               "tokens_refunded": 0, "user_obj": object.__name__})
    log.append_keys(user="0123456789abcdef")
    log.warning("limiter unavailable: %s", "timeout")
    log.debug({"details": "a dict message"})
    log.info('{"already": "json"}')
    log.info("keyword", count=3, codes=["a"])
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        log.exception("refund failed; kept to retry before the next request")
    log.error("pending refund expired", extra={"request_id": "overrides", "cost": 5})


@pytest.mark.parametrize("trace", [None, "Root=1-5759e988-bd862e3fe1be46a994272793;Sampled=1"])
def test_log_lines_match_powertools(monkeypatch: pytest.MonkeyPatch, trace: str | None) -> None:
    """Every kind of line has Powertools' keys, their order and values (bar time and service)."""
    if trace is None:
        monkeypatch.delenv(jsonlog.XRAY_TRACE_ID_ENV, raising=False)
    else:
        monkeypatch.setenv(jsonlog.XRAY_TRACE_ID_ENV, trace)
    monkeypatch.delenv(jsonlog.LAMBDA_LOG_LEVEL_ENV, raising=False)
    suffix = "trace" if trace else "plain"
    theirs, ours = io.StringIO(), io.StringIO()
    _log_everything(_powertools_logger(f"pt-lines-{suffix}", theirs))
    _log_everything(jsonlog.JsonLogger(f"own-lines-{suffix}", level="DEBUG", stream=ours))
    expected, got = _lines(theirs), _lines(ours)
    assert len(got) == len(expected) == 7
    for want, have in zip(expected, got, strict=True):
        assert list(have) == list(want)
        for key in ("timestamp", "service"):
            want.pop(key, None)
            have.pop(key, None)
        assert have == want
    failed = _lines(ours)[5]
    assert failed["exception_name"] == "RuntimeError"
    assert failed["exception"].endswith("RuntimeError: boom")
    assert failed["stack_trace"]["type"] == "RuntimeError"
    assert failed["stack_trace"]["frames"][-1]["function"] == "_log_everything"
    assert all(line["location"].startswith("_log_everything:") for line in _lines(ours))
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}[+-]\d{4}",
                        _lines(ours)[0]["timestamp"])


def test_log_level_follows_lambda_then_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lambda's log level wins over LOG_LEVEL; without either, INFO; lower lines are dropped."""
    assert jsonlog.log_level("DEBUG", {"AWS_LAMBDA_LOG_LEVEL": "WARN"}) == "WARNING"
    assert jsonlog.log_level(None, {"LOG_LEVEL": "debug"}) == "DEBUG"
    assert jsonlog.log_level(None, {}) == "INFO"
    monkeypatch.delenv(jsonlog.LAMBDA_LOG_LEVEL_ENV, raising=False)
    out = io.StringIO()
    log = jsonlog.JsonLogger("own-level", level="WARNING", stream=out)
    log.info("dropped")
    log.warning("kept")
    assert [line["message"] for line in _lines(out)] == ["kept"]
    assert not logging.getLogger("own-level").propagate


def _powertools_line(namespace: str, service: str, defaults: dict[str, str],
                     added: list[tuple[str, float, str]], first: dict[str, str],
                     extra: dict[str, str], capsys: pytest.CaptureFixture[str]) -> Any:
    """What Powertools' Metrics writes when used as observability.py used it."""
    from aws_lambda_powertools.metrics import EphemeralMetrics

    metrics = EphemeralMetrics(namespace=namespace, service=service)
    metrics.set_default_dimensions(**defaults)
    for name, value, unit in added:
        metrics.add_metric(name=name, unit=unit, value=value)
    for name, value in first.items():
        if name not in defaults:
            metrics.add_dimension(name, value)
    metrics.add_dimensions(**extra)
    capsys.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        metrics.flush_metrics()
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize(("defaults", "first", "extra_sets"), [
    ({"env": "dev"}, {"env": "dev", "route": "POST /v1/structured"}, (("env",),)),
    ({"env": "dev", "provider": "llm"}, {"env": "dev", "provider": "llm"},
     (("env", "provider"),)),
])
def test_emf_lines_match_powertools(monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str],
                                    defaults: dict[str, str], first: dict[str, str],
                                    extra_sets: tuple[tuple[str, ...], ...]) -> None:
    """Both groups' lines equal Powertools' (namespace, dimension sets, units, value lists)."""
    monkeypatch.delenv("POWERTOOLS_METRICS_DISABLED", raising=False)
    monkeypatch.delenv("POWERTOOLS_DEV", raising=False)
    added = [("Requests", 1, "Count"), ("TokensReserved", 8, "Count"),
             ("ProviderWaitMs", 12.5, "Milliseconds"), ("TokensReserved", 2, "Count")]
    theirs = _powertools_line("AttoCloud", "structured", defaults, added, first,
                              {name: first[name] for name in extra_sets[0]}, capsys)
    ours = emf.MetricSet("AttoCloud", "structured", defaults, extra_sets=extra_sets)
    for name, value, unit in added:
        ours.add(name, value, unit)
    line = json.loads(ours.line(first, timestamp_ms=theirs["_aws"]["Timestamp"]))
    assert json.dumps(line) == json.dumps(theirs)


def test_emf_refuses_what_cloudwatch_refuses() -> None:
    """An unknown unit or a value that is not a number raises; nothing is added."""
    metrics = emf.MetricSet("AttoCloud", "structured", {"env": "dev"})
    with pytest.raises(ValueError, match="unit"):
        metrics.add("Requests", 1, unit="Things")
    with pytest.raises(ValueError, match="number"):
        metrics.add("Requests", "1")  # type: ignore[arg-type]
    assert metrics.values == {}


def test_a_full_metric_is_written_at_once(capsys: pytest.CaptureFixture[str]) -> None:
    """The 100th value of a metric writes the line, as CloudWatch takes at most 100 per line."""
    metrics = emf.MetricSet("AttoCloud", "structured", {"env": "dev"})
    capsys.readouterr()
    for _ in range(emf.MAX_METRICS):
        metrics.add("ProviderCalls", 1)
    (line,) = capsys.readouterr().out.splitlines()
    assert json.loads(line)["ProviderCalls"] == [1.0] * emf.MAX_METRICS
    assert metrics.values == {}


def test_the_request_path_imports_no_powertools() -> None:
    """Logging and metrics do not load Powertools (its import is a cold start's cost)."""
    import subprocess
    import sys

    code = ("import sys; from usage_limits.web import observability as obs; "
            "obs.logger().info('x'); obs.count(obs.REQUESTS); obs.request_done(None, 200); "
            "obs.flush(); print(any(m.startswith('aws_lambda_powertools') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={"PATH": "", "PYTHONPATH": ":".join(sys.path)})
    assert out.stdout.splitlines()[-1] == "False"
    assert obs.NAMESPACE == "AttoCloud"
