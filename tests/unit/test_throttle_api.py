"""Provider throttle without Redis: configuration, validation and the decorator's wiring."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

import usage_limits
import usage_limits.throttle as throttle_module
from usage_limits.exceptions import CostExceedsLimit, InvalidArgument
from usage_limits.throttle import (
    DEFAULT_MAX_PAUSE_S,
    DEFAULT_PAUSE_S,
    ProviderThrottle,
    UpstreamRateLimited,
    _sleep_until,
    bind_share,
    parse_rate,
    share_scope,
    throttled,
)


class NoRedis:
    """A client that fails the test if the throttle touches Redis."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"redis was used: {name}")


def make(**kwargs: Any) -> ProviderThrottle:
    return ProviderThrottle(NoRedis(), "llm", **{"rate": 20, **kwargs})  # type: ignore[arg-type]


def test_package_exports_throttle_lazily() -> None:
    """``usage_limits`` exposes ProviderThrottle and throttled from the throttle module."""
    assert usage_limits.ProviderThrottle is ProviderThrottle
    assert usage_limits.throttled is throttled


@pytest.mark.parametrize(("text", "expected"), [
    ("20/s", (20.0, 1.0)), ("600/m", (600.0, 60.0)), ("1000/h", (1000.0, 3600.0)),
    ("5/10s", (5.0, 10.0)), (" 2.5 / min ", (2.5, 60.0)), ("90000/1m", (90000.0, 60.0)),
])
def test_parse_rate_accepts_count_per_period(text: str, expected: tuple[float, float]) -> None:
    """Rates read as count per period with s, m or h units (and an optional multiplier)."""
    assert parse_rate(text) == expected


@pytest.mark.parametrize("text", ["20", "20/d", "/s", "0/s", "20/0s", "-1/s", "abc", "20/s/s"])
def test_parse_rate_rejects_malformed_text(text: str) -> None:
    """Anything but a positive count per s, m or h is an InvalidArgument."""
    with pytest.raises(InvalidArgument):
        parse_rate(text)


def test_from_env_reads_provider_variables() -> None:
    """LLM_RATE, LLM_BURST and LLM_CONCURRENCY configure the "llm" throttle."""
    env = {"LLM_RATE": "600/m", "LLM_BURST": "4", "LLM_CONCURRENCY": "3"}
    th = ProviderThrottle.from_env(NoRedis(), "llm", env=env)  # type: ignore[arg-type]
    assert (th.rate, th.per_s, th.burst, th.max_concurrency) == (600.0, 60.0, 4.0, 3)
    assert th.jitter_s == pytest.approx(0.9)  # the default allowance: 1.5% of the period
    assert th.interval_s == pytest.approx(60.9 / 600)
    th = ProviderThrottle.from_env(NoRedis(), "llm", env={"LLM_RATE": "20/s",  # type: ignore[arg-type]
                                                          "LLM_JITTER_MS": "40"})
    assert th.jitter_s == pytest.approx(0.04)
    assert th.interval_s == pytest.approx(1.04 / 20)


def test_from_env_uses_defaults_when_unset_or_empty() -> None:
    """Unset or empty variables take the defaults given by the provider client."""
    th = ProviderThrottle.from_env(NoRedis(), "llm", default_rate="5/s",  # type: ignore[arg-type]
                                   default_burst=2, default_concurrency=7, env={"LLM_RATE": ""})
    assert (th.rate, th.per_s, th.burst, th.max_concurrency) == (5.0, 1.0, 2.0, 7)


def test_from_env_maps_provider_names_to_variable_names() -> None:
    """A provider "salary-api" reads SALARY_API_RATE; "none" turns the in-flight cap off."""
    env = {"SALARY_API_RATE": "2/s", "SALARY_API_CONCURRENCY": "none"}
    th = ProviderThrottle.from_env(NoRedis(), "salary-api",  # type: ignore[arg-type]
                                   default_concurrency=4, env=env)
    assert (th.rate, th.max_concurrency) == (2.0, None)


@pytest.mark.parametrize(("env", "named"), [
    ({"LLM_RATE": "fast"}, "LLM_RATE"), ({"LLM_RATE": "20"}, "LLM_RATE"),
    ({"LLM_BURST": "x"}, "LLM_BURST"), ({"LLM_BURST": "0.5"}, "LLM_BURST"),
    ({"LLM_BURST": "inf"}, "LLM_BURST"), ({"LLM_CONCURRENCY": "0"}, "LLM_CONCURRENCY"),
    ({"LLM_CONCURRENCY": "2.5"}, "LLM_CONCURRENCY"), ({"LLM_CONCURRENCY": "-1"}, "LLM_CONCURRENCY"),
])
def test_from_env_names_the_bad_variable(env: dict[str, str], named: str) -> None:
    """A malformed variable raises InvalidArgument whose message names that variable."""
    with pytest.raises(InvalidArgument, match=named):
        ProviderThrottle.from_env(NoRedis(), "llm", env=env)  # type: ignore[arg-type]


@pytest.mark.parametrize("kwargs", [
    {"rate": 0}, {"rate": -1}, {"rate": float("nan")}, {"rate": True}, {"per_s": 0},
    {"burst": 0.5}, {"burst": float("inf")}, {"max_concurrency": 0}, {"max_concurrency": 1.5},
    {"max_concurrency": True}, {"lease_s": 0},
])
def test_constructor_rejects_out_of_range_arguments(kwargs: dict[str, Any]) -> None:
    """rate, per_s and lease_s must be > 0, burst >= 1, max_concurrency an int >= 1."""
    with pytest.raises(InvalidArgument):
        make(**kwargs)


def test_constructor_rejects_empty_provider() -> None:
    """A throttle needs a provider name."""
    with pytest.raises(InvalidArgument):
        ProviderThrottle(NoRedis(), "", rate=1)  # type: ignore[arg-type]


async def test_cost_above_burst_is_rejected_before_redis() -> None:
    """A cost above the burst can never be admitted: CostExceedsLimit, never queued."""
    th = make(burst=3)
    with pytest.raises(CostExceedsLimit, match="above the burst capacity") as err:
        await th.acquire(cost=4)
    assert (err.value.cost, err.value.limit) == (4, 3)
    with pytest.raises(CostExceedsLimit):
        async with th.slot(cost=4):
            pass


@pytest.mark.parametrize("cost", [0, -1, float("nan"), "1", None])
async def test_invalid_cost_is_rejected(cost: Any) -> None:
    """Costs must be finite numbers > 0."""
    with pytest.raises(InvalidArgument):
        await make().acquire(cost=cost)


@pytest.mark.parametrize("wait", [-0.1, float("nan"), "1"])
async def test_invalid_max_wait_is_rejected(wait: Any) -> None:
    """max_wait_s must be a number >= 0."""
    with pytest.raises(InvalidArgument):
        await make().acquire(max_wait_s=wait)


@pytest.mark.parametrize(("seconds", "expected"), [
    (2.5, 2.5), (0, 0.0), (1e9, DEFAULT_MAX_PAUSE_S), (float("inf"), DEFAULT_PAUSE_S),
    (float("-inf"), DEFAULT_PAUSE_S), (float("nan"), DEFAULT_PAUSE_S), (-1, DEFAULT_PAUSE_S),
    (None, DEFAULT_PAUSE_S)])
def test_pause_is_bounded(seconds: float | None, expected: float) -> None:
    """A pause is at most the maximum; a negative or non-finite one gets the default."""
    assert make().bounded_pause_s(seconds) == expected


def test_max_pause_is_configurable() -> None:
    """``<PROVIDER>_MAX_PAUSE_S`` sets the longest pause, within 0 < s <= 300."""
    th = ProviderThrottle.from_env(NoRedis(), "llm", env={"LLM_MAX_PAUSE_S": "5"})  # type: ignore[arg-type]
    assert th.max_pause_s == 5
    assert th.bounded_pause_s(600) == 5
    for bad in ("0", "301", "inf", "soon"):
        with pytest.raises(InvalidArgument, match="LLM_MAX_PAUSE_S"):
            ProviderThrottle.from_env(NoRedis(), "llm", env={"LLM_MAX_PAUSE_S": bad})  # type: ignore[arg-type]


@pytest.mark.parametrize("seconds", ["1", True])
async def test_pause_of_a_non_number_is_rejected(seconds: Any) -> None:
    """A pause must be a number of seconds (a programming error otherwise)."""
    with pytest.raises(InvalidArgument):
        await make().pause(seconds)


@pytest.mark.parametrize(("given", "expected"), [
    (2.5, 2.5), (0, 0.0), (None, DEFAULT_PAUSE_S), (-3, DEFAULT_PAUSE_S)])
def test_upstream_rate_limited_carries_retry_after(given: float | None, expected: float) -> None:
    """UpstreamRateLimited keeps a usable Retry-After, defaulting when absent or invalid."""
    assert UpstreamRateLimited(given).retry_after_s == expected


class RecordingThrottle(ProviderThrottle):
    """Runs the call directly and records what ``throttled`` passed."""

    calls: list[tuple[float, int, float | None]]

    async def call(self, fn: Callable[[], Awaitable[Any]], *, cost: float = 1,
                   retries: int = 0, max_wait_s: float | None = None) -> Any:
        self.calls.append((cost, retries, max_wait_s))
        return await fn()


async def test_throttled_uses_the_instance_attribute_and_cost_function() -> None:
    """The decorator finds ``self.throttle`` and charges the cost computed from the arguments."""
    class Client:
        def __init__(self) -> None:
            self.throttle = RecordingThrottle(NoRedis(), "llm", rate=10,  # type: ignore[arg-type]
                                              burst=100)
            self.throttle.calls = []

        @throttled(cost=lambda self, prompt: len(prompt), retries=2, max_wait_s=1.5)
        async def complete(self, prompt: str) -> str:
            """Complete a prompt."""
            return prompt.upper()

    client = Client()
    assert await client.complete("hello") == "HELLO"
    assert client.throttle.calls == [(5, 2, 1.5)]
    assert Client.complete.__doc__ == "Complete a prompt."


async def test_throttled_accepts_a_throttle_or_a_callable() -> None:
    """A ProviderThrottle or a callable of ``self`` can name the limits too."""
    shared = RecordingThrottle(NoRedis(), "geo", rate=1)  # type: ignore[arg-type]
    shared.calls = []

    @throttled(shared)
    async def lookup(x: int) -> int:
        return x * 2

    class Client:
        limits = shared

        @throttled(lambda self: self.limits, cost=1)
        async def get(self) -> str:
            return "ok"

    assert await lookup(21) == 42
    assert await Client().get() == "ok"
    assert len(shared.calls) == 2


async def test_throttled_rejects_a_missing_throttle() -> None:
    """An attribute that is not a ProviderThrottle is a clear InvalidArgument."""
    class Client:
        throttle = "not a throttle"

        @throttled()
        async def get(self) -> None:
            return None

    with pytest.raises(InvalidArgument, match="not a ProviderThrottle"):
        await Client().get()


def test_throttled_rejects_bad_arguments() -> None:
    """The decorator validates its throttle and a constant cost when it is applied."""
    with pytest.raises(InvalidArgument):
        throttled(42)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        throttled(cost=0)


async def test_sleep_until_never_wakes_early() -> None:
    """The slot sleep returns only once the loop's clock has reached the target."""
    loop = asyncio.get_running_loop()
    for delay in (0.0, 0.001, 0.0025, 0.01):
        target = loop.time() + delay
        await _sleep_until(loop, target)
        assert loop.time() >= target


def test_share_comes_from_the_arguments_then_the_scope_then_anonymous() -> None:
    """A request's user and weight: the arguments, else the enclosing scope's (its weight
    only for its own user), else one anonymous user of weight 1."""
    assert throttle_module._share(None, None) == (throttle_module.ANONYMOUS, 1.0)
    with share_scope("alice", 2.5):
        assert throttle_module._share(None, None) == ("alice", 2.5)
        assert throttle_module._share("bob", None) == ("bob", 1.0)
        assert throttle_module._share(None, 3) == ("alice", 3.0)
    assert throttle_module._share(None, None) == (throttle_module.ANONYMOUS, 1.0)


@pytest.mark.parametrize(("user", "weight"), [("", 1.0), ("alice", 0), ("alice", -1.0),
                                              ("alice", float("inf")), ("alice", True)])
def test_a_bad_share_is_refused(user: str, weight: float) -> None:
    """An empty user or a weight that is not a finite number above 0 raises InvalidArgument."""
    with pytest.raises(InvalidArgument):
        throttle_module._share(user, weight)


def test_bind_share_holds_for_the_rest_of_the_task() -> None:
    """``bind_share`` (what the web guard calls) sets the share of the current task only."""

    async def request(user: str) -> tuple[str, float]:
        bind_share(user, 2)
        await asyncio.sleep(0)
        return throttle_module._share(None, None)

    async def both() -> list[tuple[str, float]]:
        return list(await asyncio.gather(request("alice"), request("bob")))

    assert asyncio.run(both()) == [("alice", 2.0), ("bob", 2.0)]
    assert throttle_module._share(None, None) == (throttle_module.ANONYMOUS, 1.0)
