"""SnapStart: environments restored from one snapshot share no connection, nonce or request id.

A restore is imitated the way it happens: one process initialises a function and serves a
warm-up request (so it holds an open Redis connection, an HTTP client and cached state),
then ``os.fork()`` copies its memory into two "restored environments", each of which runs
the after-restore hooks registered with ``snapshot_restore_py`` exactly as the managed
runtime does, and serves one request. Without the hooks the copies would share the warm-up's
Redis connection; the control case shows that the test sees that.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from local.emulator import EmulatorProcess
from local.redis_servers import RedisServer
from usage_limits.keys import user_keys

ROOT = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent("""
    import asyncio, json, os, sys
    from local.lambda_events import http_event, invoke
    import snapshot_restore_py
    app = __import__("functions.embeddings.app", fromlist=["handler"])
    from usage_limits.web import runtime

    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)

    def serve(user):
        res = invoke(app.handler, http_event("POST", "/v1/embeddings", user=user,
                                             body={"input": ["python engineer"]}))
        async def connection_id():
            return await runtime.get_redis().client_id()
        conn_id = loop.run_until_complete(connection_id())
        return {"status": res.status, "client_id": conn_id}

    warm = serve("warm-up")  # before the snapshot: connections and clients now exist
    run_hooks = sys.argv[1] == "hooks"
    out = []
    for child in range(2):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # a restored environment
            os.close(r)
            if run_hooks:
                for func, args, kwargs in snapshot_restore_py.get_after_restore():
                    func(*args, **kwargs)
            answer = serve(f"restored-{child}")
            os.write(w, json.dumps(answer).encode())
            os._exit(0)
        os.close(w)
        data = b""
        while chunk := os.read(r, 65536):
            data += chunk
        os.waitpid(pid, 0)
        out.append(json.loads(data))
    print(json.dumps({"warm": warm, "restored": out,
                      "hooks": len(snapshot_restore_py.get_after_restore())}))
""")


def _restore_twice(redis_server: RedisServer, emulator: EmulatorProcess, mode: str,
                   ) -> dict[str, Any]:
    env = {"PATH": "/usr/bin:/bin", "REDIS_URL": redis_server.url, "ATTO_BUDGET": "100/1h",
           "LLM_BASE_URL": emulator.openai_base_url, "LLM_API_KEY": "test-key",
           "LLM_RATE": "1000/s", "AWS_DEFAULT_REGION": "us-east-1",
           "POWERTOOLS_METRICS_NAMESPACE": "AttoTest",
           "PYTHONPATH": ":".join(str(ROOT / p) for p in
                                  (".", "layers/usage_limits", "layers/providers"))}
    done = subprocess.run([sys.executable, "-c", CHILD, mode], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def _only_charge(redis_server: RedisServer, user: str) -> tuple[bytes, bytes]:
    """The (request id, nonce) of the one charge a user has in the ledger."""
    import redis

    [ev_key] = user_keys(user, "ev")
    records = redis.Redis(port=redis_server.port).hgetall(ev_key)
    assert len(records) == 1, records
    [(request_id, record)] = records.items()
    return request_id, record.split()[1]


@pytest.fixture
def fresh_emulator(emulator: EmulatorProcess) -> EmulatorProcess:
    """The module's emulator, reset."""
    emulator.reset()
    return emulator


def test_restored_environments_share_no_connection_nonce_or_request_id(
        redis_server: RedisServer, fresh_emulator: EmulatorProcess) -> None:
    """After the registered hooks run, each restored environment has its own Redis
    connection, its own nonce on the charge it made, and its own generated request id."""
    seen = _restore_twice(redis_server, fresh_emulator, "hooks")
    warm, first, second = seen["warm"], *seen["restored"]
    assert seen["hooks"] >= 1
    assert warm["status"] == first["status"] == second["status"] == 200
    assert len({warm["client_id"], first["client_id"], second["client_id"]}) == 3
    charges = [_only_charge(redis_server, user)
               for user in ("warm-up", "restored-0", "restored-1")]
    assert len({request_id for request_id, _ in charges}) == 3
    assert len({nonce for _, nonce in charges}) == 3


def test_without_the_hooks_restored_environments_share_the_connection(
        redis_server: RedisServer, fresh_emulator: EmulatorProcess) -> None:
    """Control: copies of a warmed environment that skip the hooks reuse its Redis connection
    (what the hooks exist to prevent)."""
    seen = _restore_twice(redis_server, fresh_emulator, "no-hooks")
    ids = {seen["warm"]["client_id"]} | {r["client_id"] for r in seen["restored"]}
    assert len(ids) == 1
