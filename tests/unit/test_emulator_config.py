"""Emulator knobs, rate windows, counters, embeddings and CLI parsing (no server)."""

from __future__ import annotations

import math

import pytest

import local.emulator as emulator
from local.emulator.__main__ import build_config, parser
from local.emulator.config import ConfigError, EmulatorConfig, FamilyConfig, Rate
from local.emulator.dialects import ApiFault, render, retry_after_headers
from local.emulator.llm import embed_text
from local.emulator.state import EmulatorState, SlidingWindow, max_in_window


def test_exported_names() -> None:
    """The package exports exactly its documented public names."""
    assert sorted(emulator.__all__) == sorted([
        "FAMILIES", "ConfigError", "Emulator", "EmulatorConfig", "EmulatorProcess",
        "EmulatorThread",
        "FamilyConfig", "Rate", "create_app", "generate_instance"])
    for name in emulator.__all__:
        assert hasattr(emulator, name)


@pytest.mark.parametrize(("text", "limit", "window"), [
    ("5/s", 5, 1.0), ("300/m", 300, 60.0), ("300/min", 300, 60.0), ("10/2s", 10, 2.0),
    ("1000/h", 1000, 3600.0), ("3/0.5s", 3, 0.5), ("40000/1m", 40000, 60.0),
    ("7/250ms", 7, 0.25)])
def test_rate_parse(text: str, limit: int, window: float) -> None:
    """Rates parse from N/unit text into a limit and a window in seconds."""
    rate = Rate.parse(text)
    assert rate is not None
    assert (rate.limit, rate.window_s) == (limit, pytest.approx(window))


@pytest.mark.parametrize("text", ["0/s", "five/s", "5/fortnight", "5", "-1/s", "5/0s"])
def test_rate_parse_rejects(text: str) -> None:
    """Malformed or non-positive rates are refused with ConfigError."""
    with pytest.raises(ConfigError):
        Rate.parse(text)


def test_rate_none_means_unlimited() -> None:
    """No rate, an empty string or 'unlimited' all mean no limit."""
    assert Rate.parse(None) is None and Rate.parse("") is None and Rate.parse("unlimited") is None


def test_family_config_validates_knobs() -> None:
    """Unknown knobs and out-of-range values raise ConfigError."""
    cfg = FamilyConfig()
    assert cfg.updated(rate="5/s", latency_ms="20").as_dict()["rate"] == "5/s"
    for bad in ({"latncy_ms": 1}, {"failure_rate": 1.5}, {"failure_status": 200},
                {"latency_ms": -1}, {"require_auth": "maybe"}):
        with pytest.raises(ConfigError):
            cfg.updated(**bad)


def test_config_globals_then_families() -> None:
    """Global knobs apply to every family, then per-family knobs override."""
    config = EmulatorConfig.build(latency_ms=5, families={"llm": {"latency_ms": 50,
                                                                  "rate": "2/s"}})
    assert config.families["llm"].latency_ms == 50
    assert config.families["llm"].rate == Rate(2, 1.0)
    assert config.families["pages"].latency_ms == 5
    with pytest.raises(ConfigError):
        EmulatorConfig.build(families={"weather": {}})


def test_sliding_window_admits_limit_then_computes_wait() -> None:
    """A window admits `limit` units, then reports when the oldest unit leaves."""
    window, rate = SlidingWindow(), Rate(3, 1.0)
    for t in (10.0, 10.2, 10.4):
        assert window.wait_s(t, rate) == 0
        window.add(t)
    assert window.wait_s(10.5, rate) == pytest.approx(0.5)
    assert window.wait_s(11.0, rate) == 0  # the event at 10.0 has left (half-open window)
    assert window.wait_s(11.0, rate, weight=4) == math.inf


def test_sliding_window_weighted_wait() -> None:
    """A weighted request waits until enough weight has expired for it to fit."""
    window, rate = SlidingWindow(), Rate(100, 60.0)
    window.add(0.0, 40)
    window.add(10.0, 50)
    assert window.wait_s(20.0, rate, 30) == pytest.approx(40.0)  # the 40 at t=0 must leave
    assert window.wait_s(20.0, rate, 70) == pytest.approx(50.0)  # both must leave


def test_max_in_window() -> None:
    """The maximum count in any window matches a hand count."""
    times = [0.0, 0.1, 0.5, 0.95, 1.0, 1.05, 3.0]
    assert max_in_window(times, 1.0) == 5  # 0.1 .. 1.05
    assert max_in_window(times, 0.1) == 2
    assert max_in_window([], 1.0) == 0


def test_state_counts_forced_rate_and_random_outcomes() -> None:
    """Forced outcomes come first, then the rate limit, then seeded random failures."""
    state = EmulatorState(EmulatorConfig.build(families={"llm": {"rate": "2/60s"}}))
    fam = state.families["llm"]
    state.force("fail_next", {"count": 1, "status": 503}, ["llm"])
    outcomes = [fam.decide().outcome for _ in range(4)]
    assert outcomes == ["forced", "ok", "ok", "rate"]
    state.reset()
    assert fam.decide().outcome == "ok" and fam.arrivals == 0


def test_random_failures_follow_the_seed() -> None:
    """The same seed draws the same failure sequence; another seed draws another."""
    def draws(seed: int) -> list[str]:
        state = EmulatorState(EmulatorConfig.build(seed=seed, failure_rate=0.5))
        return [state.families["search"].decide().outcome for _ in range(40)]

    assert draws(1) == draws(1)
    assert draws(1) != draws(2)
    assert 5 < draws(1).count("random") < 35


def test_retry_after_is_rounded_up() -> None:
    """Retry-After is whole seconds rounded up, at least 1; OpenAI also gets milliseconds."""
    assert retry_after_headers("tavily", 0.2) == {"Retry-After": "1"}
    assert retry_after_headers("openai", 2.0001) == {"Retry-After": "3", "retry-after-ms": "2001"}
    assert retry_after_headers("adzuna", 2.0) == {"Retry-After": "2"}
    assert retry_after_headers("adzuna", None) == {}


@pytest.mark.parametrize(("dialect", "key"), [("openai", "error"), ("adzuna", "exception"),
                                              ("tavily", "detail"), ("brave", "error")])
def test_error_shapes(dialect: str, key: str) -> None:
    """Each dialect renders errors in its API's own JSON shape."""
    import json

    response = render(dialect, ApiFault(429, kind="rate", retry_after_s=1.5))
    assert response.status_code == 429
    assert response.headers["retry-after"] == "2"
    assert key in json.loads(bytes(response.body))


def test_embeddings_are_deterministic_unit_vectors() -> None:
    """Embeddings are stable, normalised, and shorter ones are truncations of longer ones."""
    a = embed_text("senior python developer", 256)
    assert a == embed_text("senior python developer", 256)
    assert math.isclose(math.sqrt(sum(x * x for x in a)), 1.0, abs_tol=1e-6)
    short = embed_text("senior python developer", 32)
    norm = math.sqrt(sum(x * x for x in a[:32]))
    assert short == pytest.approx([x / norm for x in a[:32]], abs=1e-6)


def test_embeddings_share_words_means_closer() -> None:
    """Texts sharing words are closer than unrelated texts."""
    def cos(x: list[float], y: list[float]) -> float:
        return sum(p * q for p, q in zip(x, y, strict=True))

    base = embed_text("python backend developer in london")
    near = embed_text("python developer london")
    far = embed_text("pastry chef bakery croissants")
    assert cos(base, near) > cos(base, far) + 0.3


def test_cli_builds_config_from_flags() -> None:
    """CLI flags take a global VALUE or FAMILY=VALUE, repeated, globals first."""
    args = parser().parse_args(["--port", "0", "--latency-ms", "20", "--latency-ms", "llm=100",
                                "--rate", "50/s", "--rate", "search=2/s",
                                "--failure-rate", "pages=0.25", "--no-auth", "salary",
                                "--count-rejected", "llm", "--seed", "9"])
    config = build_config(args)
    assert config.seed == 9
    assert config.families["llm"].latency_ms == 100
    assert config.families["pages"].latency_ms == 20
    assert str(config.families["salary"].rate) == "50/s"
    assert str(config.families["search"].rate) == "2/s"
    assert config.families["pages"].failure_rate == 0.25
    assert config.families["salary"].require_auth is False
    assert config.families["llm"].require_auth is True
    assert config.families["llm"].count_rejected is True


def test_cli_rejects_unknown_family() -> None:
    """A FAMILY=VALUE flag with an unknown family is an error."""
    with pytest.raises(ConfigError):
        build_config(parser().parse_args(["--rate", "weather=5/s"]))
