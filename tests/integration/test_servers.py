"""The session's private Redis servers are real and reachable on both topologies."""

from __future__ import annotations


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
