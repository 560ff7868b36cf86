"""Isolation of users across all seven handlers: no one reaches anything that is not theirs.

Identity comes only from the JWT authorizer's ``sub`` in ``requestContext.authorizer.jwt``;
every forged identity is 401 and charges no one. A user cannot read, replay, refund or
settle another user's charges through an Idempotency-Key or a shared API Gateway request
id, and crafted ``sub`` values cannot reach another user's Redis keys or break the hash
tag that keeps a user's keys in one cluster slot. The harness (routes, environment, ledger
and emulator readers) is shared with ``test_abuse.py``.
"""

from __future__ import annotations

import base64
import hashlib
import importlib
import json
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from redis.crc import key_slot

from local.emulator import EmulatorProcess
from local.lambda_events import fresh_environment, invoke
from local.redis_servers import RedisCluster3, RedisServer
from usage_limits.keys import safe_name, user_keys
from usage_limits.web import settings

abuse = importlib.import_module("tests.integration.test_abuse")
Route, ROUTES, METERED, USAGE = abuse.Route, abuse.ROUTES, abuse.METERED, abuse.USAGE
call, event, ledger, upstream, new_user, ids = (abuse.call, abuse.event, abuse.ledger,
                                                 abuse.upstream, abuse.new_user, abuse.ids)
env = abuse.env  # the same fixture (the emulator is conftest's, one per module)
EMBEDDINGS, MARKET = ROUTES[1], ROUTES[5]


Ledger = tuple[int, list[tuple[str, int, str]]]


def charge(victim: str) -> Ledger:
    """Give ``victim`` one charge (embeddings under Idempotency-Key victim-key); its ledger."""
    res = call(EMBEDDINGS, victim, headers={"Idempotency-Key": "victim-key"})
    assert res.status == 200, res.body
    return ledger(victim)


def charged_victim() -> tuple[str, Ledger]:
    """A new user with one charge, and its ledger."""
    victim = new_user()
    return victim, charge(victim)


def unsigned_jwt(sub: str) -> str:
    """A JWT that names ``sub`` but was never checked by the authorizer (alg none)."""
    def part(value: dict[str, Any]) -> str:
        return base64.urlsafe_b64encode(json.dumps(value).encode()).decode().rstrip("=")

    return f"{part({'alg': 'none', 'typ': 'JWT'})}.{part({'sub': sub})}."


def _anonymous(route: Route, **parts: Any) -> dict[str, Any]:
    return event(route, None, **parts)


def _authorizer(value: Any) -> Callable[[Route, str], dict[str, Any]]:
    def forge(route: Route, victim: str) -> dict[str, Any]:
        ev = _anonymous(route)
        ev["requestContext"]["authorizer"] = json.loads(json.dumps(value).replace("VICTIM", victim))
        return ev

    return forge


def _headers(**values: str) -> Callable[[Route, str], dict[str, Any]]:
    def forge(route: Route, victim: str) -> dict[str, Any]:
        return _anonymous(route, headers={k.replace("_", "-"): v.replace("VICTIM", victim)
                                          for k, v in values.items()})

    return forge


def _in_query(route: Route, victim: str) -> dict[str, Any]:
    base = {} if route.post else dict(route.ok)
    return _anonymous(route, query={**base, "sub": victim, "user": victim, "user_id": victim})


def _in_body(route: Route, victim: str) -> dict[str, Any]:
    return _anonymous(route, body={**(route.ok if route.post else {}), "sub": victim,
                                   "user_id": victim})


def _jwt_outside_request_context(route: Route, victim: str) -> dict[str, Any]:
    ev = _anonymous(route)
    ev["authorizer"] = {"jwt": {"claims": {"sub": victim}}}
    ev["claims"] = {"sub": victim}
    return ev


def _bearer(route: Route, victim: str) -> dict[str, Any]:
    return _anonymous(route, headers={"authorization": "Bearer " + unsigned_jwt(victim)})


def _blank_sub_and_header(route: Route, victim: str) -> dict[str, Any]:
    ev = _authorizer({"jwt": {"claims": {"sub": " "}}})(route, victim)
    ev["headers"]["x-atto-user"] = victim
    return ev


FORGERIES: dict[str, Callable[[Route, str], dict[str, Any]]] = {
    "x-atto-user": _headers(x_atto_user="VICTIM"),
    "x-forwarded-user": _headers(x_forwarded_user="VICTIM", x_forwarded_email="VICTIM"),
    "x-amzn-oidc": _headers(x_amzn_oidc_identity="VICTIM", x_amzn_oidc_data="VICTIM"),
    "unverified-bearer": _bearer,
    "sub-in-query": _in_query,
    "sub-in-body": _in_body,
    "v1-claims-in-v2": _authorizer({"claims": {"sub": "VICTIM"}}),
    "lambda-authorizer": _authorizer({"lambda": {"sub": "VICTIM"}, "principalId": "VICTIM"}),
    "bare-sub": _authorizer({"sub": "VICTIM"}),
    "jwt-without-sub": _authorizer({"jwt": {"claims": {"username": "VICTIM",
                                                       "cognito:username": "VICTIM"}}}),
    "jwt-sub-not-a-string": _authorizer({"jwt": {"claims": {"sub": ["VICTIM"]}}}),
    "blank-sub-plus-header": _blank_sub_and_header,
    "outside-request-context": _jwt_outside_request_context,
}


# -- forged identity ------------------------------------------------------------------------


@pytest.mark.parametrize("forgery", FORGERIES.values(), ids=FORGERIES.keys())
@pytest.mark.parametrize("route", ROUTES, ids=ids(ROUTES))
def test_forged_identity_is_401_and_touches_no_one(env: EmulatorProcess, route: Route,
                                                   forgery: Callable[[Route, str], Any]) -> None:
    """Outside local mode only the JWT authorizer's sub names a user: every forgery is 401."""
    victim, before = charged_victim()
    calls = upstream(env)
    res = invoke(route.module.handler, forgery(route, victim))
    assert res.status == 401, res.body
    assert res.body["error"]["code"] == "unauthorized"
    assert "events" not in res.body and victim not in json.dumps(res.body)
    assert ledger(victim) == before
    assert upstream(env) == calls


@pytest.mark.parametrize("route", ROUTES, ids=ids(ROUTES))
def test_local_mode_jwt_wins_over_the_header(env: EmulatorProcess, route: Route,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """In local mode X-Atto-User names the caller only when no JWT does; a JWT sub always wins."""
    monkeypatch.setenv("ATTO_ENV", "local")
    settings.cache_clear()
    victim, before = charged_victim()
    caller, header_user = new_user(), new_user()
    res = call(route, caller, headers={"X-Atto-User": victim})
    assert res.status == 200, res.body
    assert ledger(victim) == before
    by_header = call(route, None, headers={"X-Atto-User": header_user})
    assert by_header.status == 200, by_header.body
    if route.metered:
        assert ledger(caller)[0] > 0 and ledger(header_user)[0] > 0
    else:
        assert res.body["user_id"] == caller and by_header.body["user_id"] == header_user


# -- Idempotency-Key and request ids ---------------------------------------------------------


@pytest.mark.parametrize("route", METERED, ids=ids(METERED))
def test_another_users_idempotency_key_is_a_fresh_charge(env: EmulatorProcess,
                                                         route: Route) -> None:
    """B reusing A's Idempotency-Key gets its own call and charge, never A's stored answer."""
    alice, bob, key = new_user(), new_user(), "shared-" + uuid.uuid4().hex
    first = call(route, alice, headers={"Idempotency-Key": key})
    assert first.status == 200, first.body
    alice_ledger, calls = ledger(alice), upstream(env)
    theirs = call(route, bob, headers={"Idempotency-Key": key})
    assert theirs.status == 200, theirs.body
    assert "idempotent-replayed" not in theirs.headers
    assert upstream(env)[route.families[0]] > calls[route.families[0]]
    bob_used, bob_events = ledger(bob)
    assert bob_used > 0 and bob_events == [(key, bob_used, route.path)]
    assert ledger(alice) == alice_ledger
    calls = upstream(env)
    again = call(route, alice, headers={"Idempotency-Key": key})
    assert again.headers.get("idempotent-replayed") == "true" and again.body == first.body
    assert ledger(alice) == alice_ledger and upstream(env) == calls


@pytest.mark.parametrize("route", METERED, ids=ids(METERED))
def test_another_users_failures_under_the_key_take_nothing(env: EmulatorProcess,
                                                           route: Route) -> None:
    """B's failed and invalid requests under A's key refund only B and leave A's answer stored."""
    assert route.too_long is not None
    alice, bob, key = new_user(), new_user(), "shared-" + uuid.uuid4().hex
    first = call(route, alice, headers={"Idempotency-Key": key})
    assert first.status == 200, first.body
    alice_ledger = ledger(alice)
    env.fail_next(1, 500, family=route.families[0])
    failed = call(route, bob, headers={"Idempotency-Key": key})
    assert failed.status == 502 and failed.body["error"]["code"] == "provider_error"
    invalid = call(route, bob, headers={"Idempotency-Key": key},
                   **({"body": route.too_long} if route.post else {"query": route.too_long}))
    assert invalid.status == 422
    assert ledger(bob) == (0, [])
    assert ledger(alice) == alice_ledger
    calls = upstream(env)
    again = call(route, alice, headers={"Idempotency-Key": key})
    assert again.headers.get("idempotent-replayed") == "true" and again.body == first.body
    assert upstream(env) == calls and ledger(alice) == alice_ledger


def test_settle_under_another_users_key_lowers_only_their_own_charge(env: EmulatorProcess) -> None:
    """A route that settles lower (market context without data) settles the caller's charge only."""
    alice, bob, key = new_user(), new_user(), "shared-" + uuid.uuid4().hex
    full = call(MARKET, alice, headers={"Idempotency-Key": key})
    settled = call(MARKET, bob, body={"role": "nojobs analyst"}, headers={"Idempotency-Key": key})
    assert full.status == settled.status == 200
    assert ledger(alice) == (30, [(key, 30, MARKET.path)])
    assert ledger(bob) == (2, [(key, 2, MARKET.path)])


@pytest.mark.parametrize("route", METERED, ids=ids(METERED))
def test_shared_gateway_request_id_is_a_charge_per_user(env: EmulatorProcess,
                                                        route: Route) -> None:
    """One API Gateway request id seen for two users is two charges; a replay of it is one."""
    alice, bob, rid = new_user(), new_user(), "gw-" + uuid.uuid4().hex[:16]
    assert call(route, alice, request_id=rid).status == 200
    alice_ledger, calls = ledger(alice), upstream(env)
    assert call(route, bob, request_id=rid).status == 200
    assert upstream(env)[route.families[0]] > calls[route.families[0]]
    bob_used, bob_events = ledger(bob)
    assert bob_used > 0 and bob_events == [(rid, bob_used, route.path)]
    assert alice_ledger[1] == [(rid, alice_ledger[0], route.path)]
    calls = upstream(env)
    repeat = call(route, alice, request_id=rid)
    assert repeat.status == 409 and repeat.body["error"]["code"] == "idempotency_conflict"
    assert ledger(alice) == alice_ledger and upstream(env) == calls


def test_usage_shows_only_the_callers_events(env: EmulatorProcess) -> None:
    """GET /v1/usage reports the caller alone, whatever it is asked and under any key."""
    alice, bob = new_user(), new_user()
    alice_keys = {f"a-{r.name}" for r in METERED[:3]}
    for route in METERED[:3]:
        assert call(route, alice, headers={"Idempotency-Key": f"a-{route.name}"}).status == 200
    for route in METERED[3:]:
        assert call(route, bob, headers={"Idempotency-Key": f"b-{route.name}"}).status == 200
    assert call(METERED[0], bob, headers={"Idempotency-Key": f"a-{METERED[0].name}"}).status == 200
    alice_used, alice_events = ledger(alice)
    assert {e[0] for e in alice_events} == alice_keys
    assert alice_used == sum(e[1] for e in alice_events)
    bob_keys = {f"b-{r.name}" for r in METERED[3:]} | {f"a-{METERED[0].name}"}
    asked = call(USAGE, bob, query={"user": alice, "user_id": alice, "sub": alice},
                 headers={"X-Atto-User": alice})
    stored = call(USAGE, alice, headers={"Idempotency-Key": "usage-key"})
    same_key = call(USAGE, bob, headers={"Idempotency-Key": "usage-key"})
    assert asked.status == stored.status == same_key.status == 200
    assert "idempotent-replayed" not in same_key.headers
    assert stored.body["user_id"] == alice
    for report in (asked, same_key):
        assert report.body["user_id"] == bob
        assert {e["request_id"] for e in report.body["events"]} == bob_keys
        assert alice not in json.dumps(report.body)


# -- Redis key injection ----------------------------------------------------------------------

def crafted_ids(safe: str, odd: str) -> tuple[list[str], list[str]]:
    """User ids aimed at the keys of ``safe`` (used as is) and ``odd`` (hashed): the ones a
    JWT may carry (printable, at most 256 characters) and the ones refused with 401."""
    odd_hash = hashlib.sha256(odd.encode()).hexdigest()
    accepted = [
        "{u:" + safe + "}", safe + "}", "{" + safe + "}", safe + "}:{u:" + safe,
        safe + ":log", "ul:{u:" + safe + "}:log", safe + " ", safe[:10] + "*",
        "😀{u:" + safe + "}", odd + "x",
        "~" + odd_hash,             # the odd victim's name inside its keys, as a user id
        odd_hash,                   # the same without the marker
        "ü" * 255 + safe[-1],       # the longest id accepted, not ASCII
    ]
    rejected = [safe + "\n", safe + "\x00", "\r\n" + safe, safe + "\t", "a\u2028" + safe,
                "   ", "x" * 257, "x" * 10_000]
    return accepted, rejected


def hash_tag(key: str) -> str:
    """The part of ``key`` Redis Cluster hashes: the first non-empty ``{...}``, else all of it."""
    start = key.find("{")
    end = key.find("}", start + 1) if start >= 0 else -1
    return key[start + 1:end] if start >= 0 and end > start + 1 else key


@pytest.fixture(params=["standalone", pytest.param("cluster", marks=pytest.mark.cluster)])
def topology(request: pytest.FixtureRequest, env: EmulatorProcess,
             monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[], dict[str, bytes]]]:
    """The handlers on the standalone server or the 3-master cluster; yields a key snapshot."""
    server: RedisServer | RedisCluster3 = request.getfixturevalue(
        "redis_server" if request.param == "standalone" else "redis_cluster")
    ports = [server.port] if isinstance(server, RedisServer) else [n.port for n in server.nodes]
    if isinstance(server, RedisCluster3):
        monkeypatch.setenv("REDIS_URL", server.url)
        monkeypatch.setenv("REDIS_CLUSTER", "true")
        fresh_environment()
    nodes = [redis.Redis(host="127.0.0.1", port=p) for p in ports]

    def snapshot() -> dict[str, bytes]:
        """Every key of every node, with its DUMP (serialized value)."""
        keys: dict[str, bytes] = {}
        for node in nodes:
            for key in node.scan_iter(count=1000):
                keys[key.decode()] = node.dump(key) or b""
        return keys

    yield snapshot
    for node in nodes:
        node.close()


def test_crafted_user_ids_stay_in_their_own_keys(env: EmulatorProcess,
                                                 topology: Callable[[], dict[str, bytes]]) -> None:
    """Braces, colons, hashed forms, unicode or huge ids reach only their own hash tag.

    Victims are charged first; then every crafted ``sub`` calls embeddings with the
    victims' Idempotency-Key, GET /v1/usage and one more route. Printable ids of up to
    256 characters are served from keys tagged ``u:<safe_name(id)>`` (all in one slot);
    the others are 401. Victims' keys are byte-for-byte unchanged.
    """
    tag = uuid.uuid4().hex[:8]
    safe_victim, odd_victim = f"victim-{tag}", f"victim:{{{tag}}} ü"
    accepted, rejected = crafted_ids(safe_victim, odd_victim)
    victims = {v: charge(v) for v in (safe_victim, odd_victim)}
    before = topology()
    victim_tags = {"u:" + safe_name(v) for v in victims}
    victim_keys = {k: v for k, v in before.items() if hash_tag(k) in victim_tags}
    assert len(victim_keys) == 2 * 3  # log, ev, meta each (stored answers: in DynamoDB)
    for i, sub in enumerate(accepted):
        res = call(EMBEDDINGS, sub, headers={"Idempotency-Key": "victim-key"})
        assert res.status == 200 and "idempotent-replayed" not in res.headers, (sub, res.body)
        report = call(USAGE, sub)
        assert report.status == 200 and report.body["user_id"] == sub
        assert [e["request_id"] for e in report.body["events"]] == ["victim-key"]
        other = METERED[i % len(METERED)]
        assert call(other, sub).status == 200, (sub, other.name)
    for sub in rejected:
        for route in (EMBEDDINGS, USAGE):
            res = call(route, sub, headers={"Idempotency-Key": "victim-key"})
            assert res.status == 401 and res.body["error"]["code"] == "unauthorized", repr(sub)
    after = topology()
    assert {k: after.get(k) for k in victim_keys} == victim_keys
    assert {v: ledger(v) for v in victims} == victims
    own = {k: sub for sub in accepted for k in user_keys(sub, "log", "ev", "meta")}
    created = set(after) - set(before)
    throttles = {k for k in created if k.startswith("ul:{p:")}
    assert created - throttles <= set(own), created - throttles - set(own)  # answers: DynamoDB
    for sub in accepted:
        keys = user_keys(sub, "log", "ev", "meta")
        assert keys[0] in after
        assert {hash_tag(k) for k in keys} == {"u:" + safe_name(sub)}
        assert len({key_slot(k.encode()) for k in keys}) == 1
        assert not {hash_tag(k) for k in keys} & {hash_tag(k) for k in victim_keys}
