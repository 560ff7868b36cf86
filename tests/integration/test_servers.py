"""The session's private Redis servers are real, reachable on both topologies, of each engine."""

from __future__ import annotations

from local.redis_servers import Engine, RedisCluster3, RedisServer


async def test_redis_client_round_trip(redis_client, uid) -> None:  # type: ignore[no-untyped-def]
    """A value written through the client reads back from the real server."""
    key = f"ul:{{t:{uid}}}:probe"
    await redis_client.set(key, b"1", px=10_000)
    assert await redis_client.get(key) == b"1"


def test_cluster_has_three_masters(redis_cluster) -> None:  # type: ignore[no-untyped-def]
    """The cluster fixture is a real 3-master cluster with every slot assigned."""
    info = redis_cluster.nodes[0].cli("cluster", "info")
    assert "cluster_state:ok" in info
    assert "cluster_slots_assigned:16384" in info
    assert "cluster_size:3" in info


def _reported_version(server: RedisServer, engine: Engine) -> str:
    """The version the running server itself reports (INFO server) for its product."""
    info = dict(line.split(":", 1) for line in server.cli("info", "server").splitlines()
                if ":" in line)
    return info[f"{engine.product}_version"]


def test_every_server_runs_the_tests_engine(redis_server: RedisServer,
                                            redis_cluster: RedisCluster3,
                                            engine: Engine) -> None:
    """The standalone server, each cluster node and a new RedisServer() run the test's engine."""
    for server in [redis_server, *redis_cluster.nodes]:
        assert _reported_version(server, engine) == engine.version
    with RedisServer() as own:  # as a test (or a process it starts) would make one
        assert own.engine == engine
        assert _reported_version(own, engine) == engine.version

