"""Emulator knobs over HTTP: rate limits, failures, latency, counters, control endpoints,
and starting and stopping the server."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from local.emulator import ConfigError, EmulatorProcess, EmulatorThread
from local.emulator.state import max_in_window

AUTH = {"Authorization": "Bearer test-key"}
EMBED = {"model": "text-embedding-3-small", "input": "hello"}
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def emu() -> Iterator[EmulatorProcess]:
    """One emulator process for this module."""
    with EmulatorProcess() as server:
        yield server


@pytest.fixture
def http(emu: EmulatorProcess) -> Iterator[httpx.Client]:
    """A client for the emulator, which starts every test from its start-up state."""
    emu.reset()
    with httpx.Client(base_url=emu.url, timeout=10.0, trust_env=False) as client:
        yield client


def embed(http: httpx.Client) -> httpx.Response:
    return http.post("/v1/embeddings", json=EMBED, headers=AUTH)


def tavily(http: httpx.Client) -> httpx.Response:
    return http.post("/tavily/search", json={"api_key": "k", "query": "acme"})


def test_rate_limit_answers_429_with_retry_after(emu: EmulatorProcess,
                                                 http: httpx.Client) -> None:
    """Over its rate a family answers 429 with an integer Retry-After and counts it all."""
    emu.configure("llm", rate="5/30s")
    responses = [embed(http) for _ in range(8)]
    assert [r.status_code for r in responses] == [200] * 5 + [429] * 3
    for r in responses[5:]:
        assert 1 <= int(r.headers["retry-after"]) <= 30
        assert int(r.headers["retry-after-ms"]) <= 1000 * int(r.headers["retry-after"])
        error = r.json()["error"]
        assert (error["type"], error["code"]) == ("requests", "rate_limit_exceeded")
    assert responses[0].headers["x-ratelimit-limit-requests"] == "5"
    assert responses[4].headers["x-ratelimit-remaining-requests"] == "0"
    llm = emu.family_stats("llm")
    assert (llm["arrivals"], llm["served"], llm["rate_limited"]) == (8, 5, 3)
    assert len(llm["arrival_times"]) == 8
    assert all(abs(t - time.time()) < 60 for t in llm["arrival_times"])
    assert llm["max_served_1s"] <= 5
    assert emu.family_stats("search")["arrivals"] == 0


def test_rate_limit_is_exact_under_concurrency(emu: EmulatorProcess,
                                               http: httpx.Client) -> None:
    """Twenty concurrent requests against 5/30s: exactly five served, fifteen 429s."""
    emu.configure("search", rate="5/30s")

    async def burst() -> list[int]:
        async with httpx.AsyncClient(base_url=emu.url, timeout=10.0, trust_env=False) as c:
            rs = await asyncio.gather(*[c.post("/tavily/search", json={
                "api_key": "k", "query": f"q{i}"}) for i in range(20)])
        return [r.status_code for r in rs]

    statuses = asyncio.run(burst())
    assert statuses.count(200) == 5 and statuses.count(429) == 15
    search = emu.family_stats("search")
    assert (search["arrivals"], search["served"], search["rate_limited"]) == (20, 5, 15)
    assert search["max_in_flight"] >= 1 and search["in_flight"] == 0


def test_retry_after_is_truthful(emu: EmulatorProcess, http: httpx.Client) -> None:
    """Waiting the advertised retry-after-ms is enough for the next request to pass."""
    emu.configure("llm", rate="2/0.6s")
    statuses = [embed(http) for _ in range(3)]
    assert [r.status_code for r in statuses] == [200, 200, 429]
    time.sleep(int(statuses[2].headers["retry-after-ms"]) / 1000)
    assert embed(http).status_code == 200


def test_rejected_arrivals_fill_window_when_configured(emu: EmulatorProcess,
                                                       http: httpx.Client) -> None:
    """With count_rejected, 429'd arrivals keep the window full after the admitted ones leave."""
    for count_rejected, expected in ((True, 429), (False, 200)):
        emu.reset()
        emu.configure("llm", rate="2/1s", count_rejected=count_rejected)
        assert [embed(http).status_code for _ in range(2)] == [200, 200]
        time.sleep(0.3)
        rejected = [embed(http) for _ in range(3)]
        assert {r.status_code for r in rejected} == {429}
        time.sleep(int(rejected[0].headers["retry-after-ms"]) / 1000)
        assert embed(http).status_code == expected


def test_max_arrivals_per_second(emu: EmulatorProcess, http: httpx.Client) -> None:
    """max_arrivals_1s is the most arrivals in any 1 s window of the recorded timestamps."""
    for _ in range(6):
        http.get("/pages/job/a-developer")
    time.sleep(1.05)
    for _ in range(2):
        http.get("/pages/job/a-developer")
    pages = emu.stats(window_s=10)["families"]["pages"]
    assert pages["arrivals"] == 8
    assert pages["max_arrivals_1s"] == max_in_window(pages["arrival_times"], 1.0)
    assert 2 <= pages["max_arrivals_1s"] <= 6
    assert pages["max_arrivals_window"] == 8


def test_token_rate(emu: EmulatorProcess, http: httpx.Client) -> None:
    """A token rate admits prompt + max_tokens, then answers OpenAI's tokens 429."""
    emu.configure("llm", token_rate="300/30s")
    body = {"model": "m", "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 150}
    assert http.post("/v1/chat/completions", json=body, headers=AUTH).status_code == 200
    over = http.post("/v1/chat/completions", json=body, headers=AUTH)
    assert over.status_code == 429 and over.json()["error"]["type"] == "tokens"
    assert 1 <= int(over.headers["retry-after"]) <= 30
    huge = http.post("/v1/chat/completions", json={**body, "max_tokens": 1000}, headers=AUTH)
    assert huge.status_code == 429 and "retry-after" not in huge.headers
    assert "Request too large" in huge.json()["error"]["message"]


def test_failure_rate_uses_api_error_shape(emu: EmulatorProcess, http: httpx.Client) -> None:
    """failure_rate 1 fails every request with the API's own error body and status."""
    emu.configure("search", failure_rate=1.0)
    response = tavily(http)
    assert response.status_code == 500 and "error" in response.json()["detail"]
    emu.configure("search", failure_status=503)
    assert tavily(http).status_code == 503
    emu.configure("salary", failure_rate=1.0)
    adzuna = http.get("/adzuna/v1/api/jobs/gb/histogram", params={"app_id": "a", "app_key": "b"})
    assert adzuna.status_code == 500 and adzuna.json()["exception"] == "INTERNAL_ERROR"
    search = emu.family_stats("search")
    assert (search["failures"], search["injected"], search["served"]) == (2, 2, 0)


def test_failures_are_deterministic_for_a_seed(emu: EmulatorProcess,
                                               http: httpx.Client) -> None:
    """The same seed draws the same failure sequence after a reset; another seed differs."""
    def run(seed: int) -> list[int]:
        emu.reset()
        emu.configure("search", failure_rate=0.5, seed=seed)
        return [tavily(http).status_code for _ in range(24)]

    first = run(11)
    assert first == run(11)
    assert first != run(12)
    assert 2 < first.count(500) < 22


def test_fail_next_forces_statuses(emu: EmulatorProcess, http: httpx.Client) -> None:
    """fail_next answers the next N requests with the status, then normal service resumes."""
    emu.fail_next(2, 503, family="llm")
    assert [embed(http).status_code for _ in range(3)] == [503, 503, 200]
    assert tavily(http).status_code == 200  # other families untouched
    emu.fail_next(1, 429, family="llm", retry_after_s=7)
    limited = embed(http)
    assert limited.status_code == 429 and limited.headers["retry-after"] == "7"
    assert limited.json()["error"]["code"] == "rate_limit_exceeded"
    llm = emu.family_stats("llm")
    assert (llm["failures"], llm["rate_limited"], llm["injected"]) == (2, 1, 3)
    assert llm["pending"]["fail_next"] == []


def test_forced_failures_do_not_use_rate_capacity(emu: EmulatorProcess,
                                                  http: httpx.Client) -> None:
    """Forced failures bypass the rate window: 1/30s still admits one real request."""
    emu.configure("llm", rate="1/30s", fail_next={"count": 2, "status": 500})
    assert [embed(http).status_code for _ in range(4)] == [500, 500, 200, 429]


def test_latency_and_spike(emu: EmulatorProcess, http: httpx.Client) -> None:
    """A latency spike or family latency outlasts a short client timeout; others are unaffected."""
    emu.spike_next(1, latency_ms=1500, family="pages")
    with pytest.raises(httpx.ReadTimeout):
        http.get("/pages/job/x", timeout=0.3)
    assert http.get("/pages/job/x", timeout=5).status_code == 200
    emu.configure("pages", latency_ms=1500)
    with pytest.raises(httpx.ReadTimeout):
        http.get("/pages/job/x", timeout=0.3)
    assert embed(http).status_code == 200


def test_in_flight_counts_concurrent_requests(emu: EmulatorProcess, http: httpx.Client) -> None:
    """Concurrent slow requests raise max_in_flight; in_flight returns to zero."""
    async def three() -> list[int]:
        # 2 s each: the three overlap even when a loaded machine starts them far apart
        async with httpx.AsyncClient(base_url=emu.url, timeout=10.0, trust_env=False) as c:
            rs = await asyncio.gather(*[c.get("/pages/slow", params={"ms": 2000})
                                        for _ in range(3)])
        return [r.status_code for r in rs]

    assert asyncio.run(three()) == [200, 200, 200]
    pages = emu.family_stats("pages")
    assert pages["max_in_flight"] == 3 and pages["in_flight"] == 0


def test_config_endpoint(emu: EmulatorProcess, http: httpx.Client) -> None:
    """POST /_emulator/config changes knobs per family and refuses unknown ones."""
    out = emu.configure(families={"llm": {"rate": "5/s"}, "pages": {"latency_ms": 3}})
    assert out["families"]["llm"]["rate"] == "5/s"
    assert out["families"]["pages"]["latency_ms"] == 3
    assert http.get("/_emulator/config").json()["families"]["llm"]["rate"] == "5/s"
    for bad in ({"latncy_ms": 1}, {"family": "weather", "rate": "1/s"}, {"rate": "fast"},
                {"fail_next": {"count": 0}}):
        with pytest.raises(ValueError):
            emu.configure(**bad)
    assert http.post("/_emulator/config", content=b"[1]").status_code == 400


def test_reset_restores_start_up_state(emu: EmulatorProcess, http: httpx.Client) -> None:
    """reset clears counters and queues and restores start-up knobs unless keep_config."""
    emu.configure("llm", rate="1/60s")
    emu.fail_next(5, 500, family="pages")
    embed(http)
    emu.reset(keep_config=True)
    stats = emu.stats()
    assert stats["families"]["llm"]["arrivals"] == 0
    assert stats["families"]["llm"]["config"]["rate"] == "1/60s"
    assert stats["families"]["pages"]["pending"]["fail_next"] == []
    emu.reset()
    assert emu.family_stats("llm")["config"]["rate"] is None


def test_stats_shape_and_control_not_counted(emu: EmulatorProcess, http: httpx.Client) -> None:
    """Stats cover the four families with the documented keys; control calls count nowhere."""
    for _ in range(3):
        emu.stats()
        emu.health()
    stats = http.get("/_emulator/stats", params={"times": 0}).json()
    assert {"now", "started_at", "seed", "window_s", "families"} <= set(stats)
    assert set(stats["families"]) == {"llm", "salary", "search", "pages"}
    for fam in stats["families"].values():
        assert {"arrivals", "served", "rate_limited", "failures", "client_errors", "redirects",
                "injected", "status_counts", "routes", "max_arrivals_1s", "max_served_1s",
                "max_arrivals_window", "in_flight", "max_in_flight", "config",
                "pending"} <= set(fam)
        assert fam["arrivals"] == 0 and "arrival_times" not in fam
    assert "tokens" in stats["families"]["llm"]


def test_client_errors_are_counted(emu: EmulatorProcess, http: httpx.Client) -> None:
    """Auth failures count as arrivals and client errors, never as served."""
    http.post("/v1/embeddings", json=EMBED)
    llm = emu.family_stats("llm")
    assert (llm["arrivals"], llm["client_errors"], llm["served"]) == (1, 1, 0)
    assert llm["status_counts"] == {"401": 1}


def _refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return True
    return False


def test_emulator_process_starts_and_stops_cleanly() -> None:
    """EmulatorProcess serves on a free loopback port in a child and stops with exit code 0."""
    server = EmulatorProcess(rate="7/s", families={"pages": {"latency_ms": 5}}, seed=3)
    server.start()
    try:
        assert server.port > 0 and server.alive()
        health = server.health()
        assert health["ok"] and health["pid"] != os.getpid()
        stats = server.stats()
        assert stats["seed"] == 3
        assert stats["families"]["llm"]["config"]["rate"] == "7/s"
        assert stats["families"]["pages"]["config"]["latency_ms"] == 5
    finally:
        code = server.stop()
    assert code == 0
    assert not server.alive() and _refused(server.port)
    assert server.stop() is None  # stopping twice is harmless


def test_emulator_process_rejects_bad_config() -> None:
    """An invalid knob raises ConfigError before any process starts."""
    with pytest.raises(ConfigError):
        EmulatorProcess(rate="lots")
    with pytest.raises(ConfigError):
        EmulatorProcess(families={"weather": {}})


def test_emulator_thread_serves_in_process() -> None:
    """EmulatorThread serves the same app from a thread and stops on exit."""
    with EmulatorThread(families={"llm": {"rate": "1/60s"}}) as server:
        with httpx.Client(base_url=server.url, trust_env=False, timeout=10) as client:
            assert [embed(client).status_code for _ in range(2)] == [200, 429]
        assert server.family_stats("llm")["arrivals"] == 2
        port = server.port
    assert not server.alive() and _refused(port)


def test_command_line_server() -> None:
    """`python -m local.emulator --port P` serves with the flags' knobs and exits on SIGTERM."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "local.emulator", "--port", str(port),
                             "--rate", "llm=5/s", "--latency-ms", "1"], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        config = None
        for _ in range(200):
            try:
                config = httpx.get(f"http://127.0.0.1:{port}/_emulator/config",
                                   trust_env=False, timeout=1).json()
                break
            except httpx.HTTPError:
                time.sleep(0.05)
        assert config is not None, proc.stderr.read().decode() if proc.poll() else "no answer"
        assert config["families"]["llm"]["rate"] == "5/s"
        assert config["families"]["search"]["latency_ms"] == 1
    finally:
        proc.terminate()
        assert proc.wait(10) == 0
        proc.stderr.close()
