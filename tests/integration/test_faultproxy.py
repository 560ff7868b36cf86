"""The fault-injecting proxy does to each command exactly what its fault says."""

from __future__ import annotations

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from local.redis_servers import RedisServer
from tests.faultproxy import Fault, FaultProxy, command, frame_end

INCR = command("INCR", "INCRBY")  # redis-py sends INCRBY for incr()


def _client(port: int, timeout: float = 0.3) -> redis.Redis:
    return redis.Redis(port=port, socket_timeout=timeout, retry=Retry(NoBackoff(), 0))


@pytest.fixture
def direct(redis_server: RedisServer) -> redis.Redis:
    """A client that bypasses the proxy, to see what Redis really holds."""
    return _client(redis_server.port, timeout=2.0)


def test_drop_command_never_reaches_redis(fault_proxy: FaultProxy, direct: redis.Redis,
                                          uid: str) -> None:
    """A dropped command times out on the client and changes nothing in Redis."""
    fault = fault_proxy.inject(Fault.DROP_COMMAND, match=INCR)
    with pytest.raises(redis.TimeoutError):
        _client(fault_proxy.port).incr(uid)
    assert fault.hits == 1 and direct.get(uid) is None


def test_drop_reply_runs_the_command(fault_proxy: FaultProxy, direct: redis.Redis,
                                     uid: str) -> None:
    """A dropped reply times out on the client although Redis ran the command."""
    fault_proxy.inject(Fault.DROP_REPLY, match=INCR)
    with pytest.raises(redis.TimeoutError):
        _client(fault_proxy.port).incr(uid)
    assert direct.get(uid) == b"1"


def test_duplicate_runs_twice_and_answers_the_second(fault_proxy: FaultProxy,
                                                     direct: redis.Redis, uid: str) -> None:
    """A duplicated command runs twice; the client sees only the second reply."""
    fault_proxy.inject(Fault.DUPLICATE, match=INCR)
    client = _client(fault_proxy.port)
    assert client.incr(uid) == 2
    assert client.incr(uid) == 3  # the connection stays in step afterwards
    assert fault_proxy.seen["INCRBY"] == 3


def test_delay_holds_the_reply(fault_proxy: FaultProxy, direct: redis.Redis, uid: str) -> None:
    """A delayed reply trips a shorter socket timeout and reaches a patient client."""
    fault_proxy.inject(Fault.DELAY, match=INCR, delay_s=0.5)
    with pytest.raises(redis.TimeoutError):
        _client(fault_proxy.port, timeout=0.1).incr(uid)
    fault_proxy.inject(Fault.DELAY, match=INCR, delay_s=0.2)
    assert _client(fault_proxy.port, timeout=2.0).incr(uid) == 2


def test_cut_command_closes_before_redis_sees_it(fault_proxy: FaultProxy, direct: redis.Redis,
                                                 uid: str) -> None:
    """A connection cut before the command leaves Redis unchanged."""
    fault_proxy.inject(Fault.CUT_COMMAND, match=INCR)
    with pytest.raises(redis.ConnectionError):
        _client(fault_proxy.port).incr(uid)
    assert direct.get(uid) is None


def test_cut_reply_closes_mid_reply_after_redis_ran_it(fault_proxy: FaultProxy,
                                                       direct: redis.Redis, uid: str) -> None:
    """A connection cut in the middle of the reply leaves the command's effect in Redis."""
    direct.set(uid, "x" * 1000)
    fault_proxy.inject(Fault.CUT_REPLY, match=command("GET"))
    with pytest.raises(redis.ConnectionError):
        _client(fault_proxy.port).get(uid)
    fault_proxy.inject(Fault.CUT_REPLY, match=INCR)
    with pytest.raises(redis.ConnectionError):
        _client(fault_proxy.port).incr(uid + ":n")
    assert direct.get(uid + ":n") == b"1"


def test_only_matching_commands_are_hurt(fault_proxy: FaultProxy, uid: str) -> None:
    """Faults armed for one command let others pass, in a pipeline too, and are used up."""
    fault = fault_proxy.inject(Fault.DROP_REPLY, match=command("EVALSHA", "EVAL"), times=2)
    client = _client(fault_proxy.port)
    with client.pipeline(transaction=False) as pipe:
        pipe.set(uid, 1).incr(uid).get(uid)
        assert pipe.execute() == [True, 2, b"2"]
    assert fault.hits == 0
    with pytest.raises(redis.TimeoutError):
        client.eval("return 1", 0)
    with pytest.raises(redis.TimeoutError):
        _client(fault_proxy.port).eval("return 1", 0)
    assert fault.wait(0) and _client(fault_proxy.port).eval("return 1", 0) == 1


def test_pubsub_connections_pass_through(fault_proxy: FaultProxy, direct: redis.Redis,
                                         uid: str) -> None:
    """A subscribed connection still receives its messages through the proxy."""
    pubsub = _client(fault_proxy.port, timeout=2.0).pubsub()
    pubsub.subscribe(uid)
    assert pubsub.get_message(timeout=2.0)["type"] == "subscribe"
    direct.publish(uid, "hello")
    message = pubsub.get_message(timeout=2.0)
    assert message is not None and message["data"] == b"hello"
    pubsub.close()


def test_cut_all_resets_every_connection(fault_proxy: FaultProxy, uid: str) -> None:
    """cut_all closes open connections; a client reconnects and goes on."""
    client = redis.Redis(port=fault_proxy.port, socket_timeout=0.5)  # redis-py's default retry
    assert client.incr(uid) == 1
    fault_proxy.cut_all()
    assert client.incr(uid) == 2


@pytest.mark.parametrize(("frame", "end"), [
    (b"+OK\r\n", 5), (b"$3\r\nabc\r\n", 9), (b"$-1\r\n", 5), (b"*2\r\n:1\r\n$1\r\nx\r\n", 15),
    (b"%1\r\n+k\r\n:2\r\n", 12), (b"*1\r\n*1\r\n_\r\n", 11), (b"$3\r\nab", None),
    (b"*2\r\n:1\r\n", None),
])
def test_frame_end(frame: bytes, end: int | None) -> None:
    """RESP frames are measured exactly, and incomplete ones are recognised as such."""
    assert frame_end(frame) == end
