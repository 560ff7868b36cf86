"""Redis for the fleet harness: a standalone server or a 3-master cluster with replicas.

Every server keeps its data across a SIGKILL (``appendonly yes`` + ``appendfsync always``),
so the ledger can be checked across a restart, and accepts ``DEBUG SLEEP`` (the slow-Redis
fault). The cluster has one replica per master, so a killed master fails over.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import redis
from redis.cluster import ClusterNode, RedisCluster

from local.redis_servers import HOST, RedisServer, free_port

#: Options of every fleet server: durable across SIGKILL, DEBUG allowed.
DURABLE = ["--appendonly", "yes", "--appendfsync", "always", "--enable-debug-command", "yes"]
#: Cluster node timeout, ms: a master down longer than this is failed over to its replica.
NODE_TIMEOUT_MS = 2000


class FleetRedis:
    """The Redis of one fleet run: one server, or 3 masters + 3 replicas (``cluster=True``)."""

    def __init__(self, *, cluster: bool = False) -> None:
        self.cluster = cluster
        self.dir = tempfile.mkdtemp(prefix="fleet-redis-")
        self.nodes: list[RedisServer] = []

    # -- lifecycle ---------------------------------------------------------------------
    def start(self) -> FleetRedis:
        if not self.cluster:
            self.nodes.append(RedisServer(workdir=self._node_dir("standalone"),
                                          extra=DURABLE).start())
            return self
        for _ in range(6):
            port = free_port(cluster=True)
            self.nodes.append(RedisServer(port, workdir=self._node_dir(str(port)), extra=[
                *DURABLE, "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(NODE_TIMEOUT_MS)]).start())
        subprocess.run(["redis-cli", "--cluster", "create",
                        *[f"{HOST}:{n.port}" for n in self.nodes],
                        "--cluster-replicas", "1", "--cluster-yes"],
                       capture_output=True, text=True, timeout=60, check=True)
        self.wait_healthy(30.0)
        return self

    def close(self) -> None:
        for node in self.nodes:
            node.stop(kill=True)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> FleetRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _node_dir(self, name: str) -> str:
        path = Path(self.dir) / name
        path.mkdir(parents=True)
        return str(path)

    # -- what the functions are given ----------------------------------------------------
    @property
    def url(self) -> str:
        return self.nodes[0].url

    def env(self) -> dict[str, str]:
        """``REDIS_URL`` / ``REDIS_CLUSTER`` for the fleet's Lambda environments."""
        return {"REDIS_URL": self.url, "REDIS_CLUSTER": "true" if self.cluster else "false"}

    def client(self) -> Any:
        """A blocking client for checks (bytes replies)."""
        if self.cluster:
            live = [n for n in self.nodes if n.ping()]
            return RedisCluster(startup_nodes=[ClusterNode(HOST, n.port) for n in live],
                                socket_timeout=5.0)
        return redis.Redis(host=HOST, port=self.nodes[0].port, socket_timeout=5.0)

    # -- topology ------------------------------------------------------------------------
    def masters(self) -> list[RedisServer]:
        """Nodes that are masters now (the one server when standalone)."""
        if not self.cluster:
            return list(self.nodes)
        return [n for n in self.nodes if n.ping() and "role:master" in n.cli("info", "replication")]

    def wait_healthy(self, timeout_s: float) -> float:
        """Wait until every running node reports ``cluster_state:ok`` and 3 masters have a
        live replica (standalone: answers PING). Returns the seconds waited."""
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            if self._healthy():
                return time.monotonic() - start
            time.sleep(0.05)
        raise RuntimeError(f"redis did not become healthy within {timeout_s} s")

    def _healthy(self) -> bool:
        live = [n for n in self.nodes if n.proc is not None and n.ping()]
        if not self.cluster:
            return bool(live)
        try:
            if not all("cluster_state:ok" in n.cli("cluster", "info") for n in live):
                return False
            masters = [n for n in live if "role:master" in n.cli("info", "replication")]
        except subprocess.SubprocessError:
            return False
        return len(masters) == 3

    def master_of(self, key: str) -> RedisServer:
        """The node serving ``key`` now."""
        if not self.cluster:
            return self.nodes[0]
        slot = int(self.nodes[0].cli("cluster", "keyslot", key).strip()) \
            if self.nodes[0].ping() else None
        for node in self.masters():
            for line in node.cli("cluster", "nodes").splitlines():
                parts = line.split()
                if "myself" in parts[2] and "master" in parts[2]:
                    for rng in parts[8:]:
                        lo, _, hi = rng.partition("-")
                        if slot is not None and lo.isdigit() and int(lo) <= slot <= int(hi or lo):
                            return node
        raise RuntimeError(f"no master serves {key!r}")

    def wait_promoted(self, dead: RedisServer, timeout_s: float) -> float:
        """After ``dead`` was killed, wait until a replica took over its slots."""
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            live = [n for n in self.nodes if n is not dead and n.proc is not None and n.ping()]
            try:
                ok = all("cluster_state:ok" in n.cli("cluster", "info") for n in live)
                masters = [n for n in live if "role:master" in n.cli("info", "replication")]
            except subprocess.SubprocessError:
                ok, masters = False, []
            if ok and len(masters) == 3:
                return time.monotonic() - start
            time.sleep(0.05)
        raise RuntimeError(f"no replica took over within {timeout_s} s")


class ExternalRedis:
    """A Redis the harness does not run (a staging cache): only read and written, never
    restarted, flushed or slowed. Connection settings come from this shell's ``REDIS_*``
    variables (``REDIS_CLUSTER``, ``REDIS_AUTH``, ``REDIS_USER``, ...), as the functions
    read them."""

    def __init__(self, url: str) -> None:
        import os

        self.url = url
        self._env = {k: v for k, v in os.environ.items()
                     if k.startswith(("REDIS_", "ELASTICACHE_", "AWS_"))}
        self._env["REDIS_URL"] = url
        self.cluster = self._env.get("REDIS_CLUSTER", "").lower() == "true"
        self.nodes: list[RedisServer] = []

    def __enter__(self) -> ExternalRedis:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def env(self) -> dict[str, str]:
        return dict(self._env)

    def client(self) -> Any:
        from usage_limits.connection import redis_from_env

        return redis_from_env(self._env, sync=True)

    def masters(self) -> list[RedisServer]:
        return []
