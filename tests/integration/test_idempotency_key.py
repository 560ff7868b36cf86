"""``Idempotency-Key`` as the IETF draft defines it, and answers kept in DynamoDB, through
the real handler (``functions/structured``), a real redis-server, the emulator as the LLM
and the local DynamoDB (moto's server, with injected faults)."""

from __future__ import annotations

import asyncio
import importlib
import json
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest
import redis
from hypothesis import settings as hsettings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from local.dynamodb import DynamoServer
from local.emulator import EmulatorProcess
from local.lambda_events import http_event, invoke
from local.redis_servers import RedisServer
from tests.dynamo import local_dynamo
from tests.ledger import used

if TYPE_CHECKING:
    from tests.conftest import StartEnvironment

structured = importlib.import_module("functions.structured.app")
SCHEMA = {"type": "object", "properties": {"title": {"type": "string"}},
          "required": ["title"], "additionalProperties": False}
BODY = {"prompt": "Senior Python engineer in Berlin", "schema": SCHEMA}
COST = 8


@pytest.fixture(scope="module")
def dynamo() -> Iterator[DynamoServer]:
    """The local DynamoDB of this module, whose faults the tests inject."""
    with local_dynamo("idem-key") as server:
        yield server


@pytest.fixture
def env(lambda_env: StartEnvironment, redis_server: RedisServer, emulator: EmulatorProcess,
        dynamo: DynamoServer) -> Iterator[EmulatorProcess]:
    """The structured function: real Redis, the emulator as the LLM, a 100/1h plan, answers
    stored in the module's local DynamoDB (no entitlements, no usage records)."""
    emulator.reset()
    dynamo.clear()
    lambda_env({
        "REDIS_URL": redis_server.url, "ATTO_BUDGET": "100/1h",
        "LLM_BASE_URL": emulator.openai_base_url, "LLM_API_KEY": "test-key",
        "LLM_RATE": "1000/s", "ATTO_DYNAMODB_ENDPOINT": dynamo.url,
        "ATTO_IDEMPOTENCY_TABLE": dynamo.idempotency_table,
        "AWS_ACCESS_KEY_ID": "local", "AWS_SECRET_ACCESS_KEY": "local",
        "AWS_DEFAULT_REGION": "us-east-1",
    }, unset=("ATTO_ENV", "LLM_SECRET_ARN", "ATTO_ENTITLEMENTS_TABLE", "ATTO_USAGE_TABLE"))
    yield emulator
    dynamo.clear()


def ask(user: str, key: str | None, body: Any = None) -> Any:
    headers = {} if key is None else {"Idempotency-Key": key}
    return invoke(structured.handler, http_event("POST", "/v1/structured",
                                                 body=BODY if body is None else body,
                                                 user=user, headers=headers))


def arrivals(emulator: EmulatorProcess) -> int:
    return int(emulator.family_stats("llm")["arrivals"])


def flushall(server: RedisServer) -> None:
    """The cache loses everything (a failover to an empty replica, an operator's mistake)."""
    client = redis.Redis.from_url(server.url)
    try:
        client.flushall()
    finally:
        client.close()


def items(dynamo: DynamoServer) -> list[dict[str, Any]]:
    """The stored answers' records."""
    import boto3

    client = boto3.client("dynamodb", endpoint_url=dynamo.url, region_name="us-east-1",
                          aws_access_key_id="local", aws_secret_access_key="local")
    return list(client.scan(TableName=dynamo.idempotency_table, ConsistentRead=True)["Items"])


# --- issue 30: the draft's error scenarios ---------------------------------------------------

def test_a_key_reused_for_another_payload_is_422_and_charges_nothing(
        env: EmulatorProcess) -> None:
    """The draft's 422 for another payload, with its own code: the client must change the
    request; nothing charged, no provider called, the RateLimit headers shown."""
    user, key = uuid.uuid4().hex, uuid.uuid4().hex
    assert ask(user, key).status == 200
    res = ask(user, key, {"prompt": "Junior Go developer in Paris", "schema": SCHEMA})
    assert res.status == 422 and res.body["error"]["code"] == "idempotency_key_reused"
    assert "retry-after" not in res.headers and "ratelimit" in res.headers
    assert res.body["error"]["request_id"] == key
    assert used(user) == COST and arrivals(env) == 1


def test_a_key_in_flight_is_409_with_retry_after(env: EmulatorProcess) -> None:
    """While the key's first request runs, a repeat gets 409 idempotency_conflict with
    Retry-After (the client may simply retry), and runs nothing."""
    from usage_limits.web import idempotency as idem

    user, key = uuid.uuid4().hex, uuid.uuid4().hex
    record = idem.record_data(user, "k:" + key, "POST", "/v1/structured", b"",
                              json.dumps(BODY).encode())
    asyncio.get_event_loop().run_until_complete(idem.begin(record, 10_000))
    res = ask(user, key)
    assert res.status == 409 and res.body["error"]["code"] == "idempotency_conflict"
    assert res.headers["retry-after"] == "1"
    assert used(user) == 0 and arrivals(env) == 0


@pytest.mark.parametrize(("first", "second"), [
    ('"{key}"', "{key}"), ("{key}", '"{key}"'), ('"{key}";v=1', "{key}")])
def test_the_quoted_and_the_bare_form_are_one_key(env: EmulatorProcess, first: str,
                                                  second: str) -> None:
    """The draft's sf-string and the bare key name one key: the second form gets the first
    one's answer, charged once, one provider call; the id shown is the key unquoted."""
    user, key = uuid.uuid4().hex, str(uuid.uuid4())
    one = ask(user, first.format(key=key))
    two = ask(user, second.format(key=key))
    assert one.status == two.status == 200 and two.headers["idempotent-replayed"] == "true"
    assert two.body == one.body and used(user) == COST and arrivals(env) == 1
    assert one.headers["x-request-id"] == two.headers["x-request-id"] == key


def test_an_escaped_quote_in_a_quoted_key_is_unescaped(env: EmulatorProcess) -> None:
    """``"a\\"b"`` is the key ``a"b``: the same key as sent bare, shown unquoted."""
    user = uuid.uuid4().hex
    one = ask(user, '"a\\"b\\\\c"')
    two = ask(user, 'a"b\\c')
    assert one.headers["x-request-id"] == 'a"b\\c' and two.headers["idempotent-replayed"]
    assert used(user) == COST


@pytest.mark.parametrize("field", ['"unterminated', '""', '"abc" trailing', '"caf\u00e9"',
                                   '"' + "x" * 129 + '"'])
def test_a_malformed_key_is_400_before_any_work(env: EmulatorProcess, dynamo: DynamoServer,
                                                field: str) -> None:
    """A key that is not the published format is refused (400) before the body is
    validated: nothing charged, nothing stored, no provider called."""
    user, before = uuid.uuid4().hex, len(items(dynamo))
    res = ask(user, field, {"prompt": ""})  # an invalid body too: the key is checked first
    assert res.status == 400 and res.body["error"]["code"] == "invalid_request"
    assert "Idempotency-Key" in res.body["error"]["message"]
    assert used(user) == 0 and arrivals(env) == 0 and len(items(dynamo)) == before


# --- issue 28, finding 2: a served key is never served and charged again ------------------------

def test_a_served_key_after_flushall_gets_its_answer_not_a_second_charge(
        env: EmulatorProcess, redis_server: RedisServer) -> None:
    """Served, then the cache loses everything, then the same key: the stored answer from
    DynamoDB, no charge in the (empty) windows, the provider called once."""
    user, key = uuid.uuid4().hex, uuid.uuid4().hex
    first = ask(user, key)
    assert first.status == 200 and used(user) == COST
    flushall(redis_server)
    again = ask(user, key)
    assert again.status == 200 and again.headers["idempotent-replayed"] == "true"
    assert again.body == first.body
    assert used(user) == 0 and arrivals(env) == 1  # the window forgot; nothing new charged


def test_an_answer_too_large_to_keep_is_never_served_again(
        env: EmulatorProcess, redis_server: RedisServer,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An answer above the stored size is recorded as served without its body: after a
    FLUSHALL a repeat gets 422 idempotency_answer_gone, not a second run or charge."""
    from usage_limits.web import idempotency as idem

    monkeypatch.setattr(idem, "MAX_STORED_BYTES", 16)
    monkeypatch.setattr(idem, "MAX_PARTS", 1)
    user, key = uuid.uuid4().hex, uuid.uuid4().hex
    assert ask(user, key).status == 200
    flushall(redis_server)
    again = ask(user, key)
    assert again.status == 422 and again.body["error"]["code"] == "idempotency_answer_gone"
    assert used(user) == 0 and arrivals(env) == 1


def test_a_large_answer_is_stored_compressed_and_replayed(env: EmulatorProcess) -> None:
    """An answer above the plain limit (an embeddings answer of many vectors) is stored
    compressed, within DynamoDB's item limit, and replayed byte for byte."""
    from usage_limits.web import idempotency as idem

    body = ('{"data":[' + ",".join(f'{{"index":{i},"embedding":[0.0125,-0.5,0.25]}}'
                                   for i in range(20_000)) + "]}").encode()
    assert len(body) > idem.MAX_STORED_BYTES
    record = idem.record_data(uuid.uuid4().hex, "k:big", "POST", "/v1/embeddings", b"", b"{}")
    loop = asyncio.get_event_loop()
    assert loop.run_until_complete(idem.begin(record, 10_000)) is None
    loop.run_until_complete(idem.complete(record, 200, [(b"content-type",
                                                         b"application/json")], body))
    replay = loop.run_until_complete(idem.begin(record, 10_000))
    assert replay is not None and replay.body == body and replay.status == 200


def test_an_answer_in_parts_is_replayed_after_flushall(
        env: EmulatorProcess, redis_server: RedisServer, dynamo: DynamoServer,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An answer larger than an item compressed is stored in parts beside its record and
    replayed whole after a FLUSHALL: one charge, one provider call."""
    from usage_limits.web import idempotency as idem

    monkeypatch.setattr(idem, "MAX_STORED_BYTES", 64)
    user, key, before = uuid.uuid4().hex, uuid.uuid4().hex, len(items(dynamo))
    first = ask(user, key)
    assert first.status == 200 and len(items(dynamo)) > before + 2  # the record and parts
    flushall(redis_server)
    again = ask(user, key)
    assert again.headers["idempotent-replayed"] == "true" and again.body == first.body
    assert used(user) == 0 and arrivals(env) == 1


# --- faults: DynamoDB unreachable ------------------------------------------------------------

def test_dynamodb_down_at_the_claim_is_503_and_nothing_charged(
        env: EmulatorProcess, dynamo: DynamoServer) -> None:
    """With DynamoDB refusing the claim, the answer is 503 limiter_unavailable: nothing
    charged, no provider called; once it answers, the same key is served."""
    user, key = uuid.uuid4().hex, uuid.uuid4().hex
    dynamo.inject("down", operations=("PutItem",), seconds=30, count=10)
    res = ask(user, key)
    assert res.status == 503 and res.body["error"]["code"] == "limiter_unavailable"
    assert used(user) == 0 and arrivals(env) == 0
    dynamo.clear()
    assert ask(user, key).status == 200 and used(user) == COST and arrivals(env) == 1


def test_dynamodb_failing_to_store_the_answer_withholds_it_and_refunds(
        env: EmulatorProcess, dynamo: DynamoServer, redis_server: RedisServer) -> None:
    """An answer DynamoDB refuses to store is never sent: 503 limiter_unavailable, tokens
    refunded, the claim deleted; the retry runs once more and is stored, so after a
    FLUSHALL a third try is its replay: one charge standing."""
    user, key = uuid.uuid4().hex, uuid.uuid4().hex
    dynamo.inject("down", operations=("UpdateItem",), seconds=30, count=10)
    res = ask(user, key)
    assert res.status == 503 and res.body["error"]["code"] == "limiter_unavailable"
    assert "withheld" in res.body["error"]["message"] and used(user) == 0
    dynamo.clear()
    again = ask(user, key)
    assert again.status == 200 and "idempotent-replayed" not in again.headers
    assert used(user) == COST and arrivals(env) == 2  # the withheld answer was never sent
    flushall(redis_server)
    third = ask(user, key)
    assert third.headers["idempotent-replayed"] == "true" and third.body == again.body
    assert used(user) == 0 and arrivals(env) == 2


@pytest.mark.parametrize("lost", [1, 10], ids=["once", "every-attempt"])
def test_a_stored_answer_whose_reply_was_lost_is_sent_and_replayed(
        env: EmulatorProcess, dynamo: DynamoServer, redis_server: RedisServer,
        lost: int) -> None:
    """The answer's store applies but its reply is lost (once: botocore's retry applies it
    again; on every attempt: the store raises, and the record is read back): the answer is
    stored, so it is sent, charged once; its repeat, after a FLUSHALL too, is replayed from
    DynamoDB, never run or charged again."""
    user, key = uuid.uuid4().hex, uuid.uuid4().hex
    fault = dynamo.inject("lost", operations=("UpdateItem",), seconds=30, count=lost)
    first = ask(user, key)
    assert fault.hits == min(lost, 2)  # botocore makes two attempts (MAX_ATTEMPTS)
    assert first.status == 200 and "idempotent-replayed" not in first.headers
    assert used(user) == COST and arrivals(env) == 1
    dynamo.clear()
    again = ask(user, key)
    assert again.status == 200 and again.headers["idempotent-replayed"] == "true"
    assert again.body == first.body and used(user) == COST and arrivals(env) == 1
    flushall(redis_server)
    third = ask(user, key)
    assert third.headers["idempotent-replayed"] == "true" and third.body == first.body
    assert used(user) == 0 and arrivals(env) == 1


def test_a_lost_store_that_cannot_be_read_back_is_withheld(
        env: EmulatorProcess, dynamo: DynamoServer) -> None:
    """A store whose reply is lost on every attempt, and whose record cannot be read back
    (DynamoDB refuses the read), is not known to be stored: the answer is withheld (503,
    refunded) and the claim deleted, so the retry runs once more and is charged once."""
    user, key = uuid.uuid4().hex, uuid.uuid4().hex
    dynamo.inject("lost", operations=("UpdateItem",), seconds=30, count=10)
    dynamo.inject("down", operations=("GetItem",), seconds=30, count=10)
    res = ask(user, key)
    assert res.status == 503 and "withheld" in res.body["error"]["message"]
    assert used(user) == 0 and arrivals(env) == 1
    dynamo.clear()
    again = ask(user, key)
    assert again.status == 200 and "idempotent-replayed" not in again.headers
    assert used(user) == COST and arrivals(env) == 2


def test_dynamodb_down_at_a_repeat_is_503_never_a_second_run(
        env: EmulatorProcess, dynamo: DynamoServer, redis_server: RedisServer) -> None:
    """A repeat of a served key while DynamoDB cannot be read, after a FLUSHALL: 503
    limiter_unavailable, nothing charged, no provider called (never served twice)."""
    user, key = uuid.uuid4().hex, uuid.uuid4().hex
    assert ask(user, key).status == 200
    flushall(redis_server)
    dynamo.inject("down", operations=("PutItem", "GetItem"), seconds=30, count=10)
    res = ask(user, key)
    assert res.status == 503 and used(user) == 0 and arrivals(env) == 1
    dynamo.clear()
    assert ask(user, key).headers["idempotent-replayed"] == "true"
    assert used(user) == 0 and arrivals(env) == 1


# --- the model: served keys against a cache that loses everything ---------------------------

KEYS = ("a", '"a"', "b", '"b";x=1')  # two keys, each sent in both forms
PROMPTS = ("Senior Python engineer in Berlin", "Junior Go developer in Paris")


def test_served_keys_survive_cache_loss_and_store_faults(
        env: EmulatorProcess, dynamo: DynamoServer, redis_server: RedisServer) -> None:
    """A model of one user's keyed requests (either form of two keys, two payloads) with
    FLUSHALL at any point and DynamoDB refusing to claim or to store: after every step,
    what was answered is what the model says, a served key is never run or charged again,
    and the charges standing in the windows are the serves since the last FLUSHALL."""
    class Keys(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.user = uuid.uuid4().hex
            self.served: dict[str, tuple[int, Any]] = {}  # key -> (prompt, answer)
            self.runs = arrivals(env)  # provider calls expected so far
            self.standing = 0  # tokens the windows should hold

        @rule(field=st.sampled_from(KEYS), prompt=st.sampled_from((0, 1)),
              fault=st.sampled_from((None, None, "claim", "store")))
        def request(self, field: str, prompt: int, fault: str | None) -> None:
            key = field.split(";")[0].strip('"')
            if fault is not None:
                dynamo.inject("down", operations=("PutItem",) if fault == "claim"
                              else ("UpdateItem",), seconds=30, count=10)
            try:
                res = ask(self.user, field, {"prompt": PROMPTS[prompt], "schema": SCHEMA})
            finally:
                dynamo.clear()
            known = self.served.get(key)
            if known is not None and fault != "claim":  # the claim finds the record
                if known[0] == prompt:
                    assert res.status == 200 and res.headers["idempotent-replayed"] == "true"
                    assert res.body == known[1]
                else:
                    assert (res.status, res.body["error"]["code"]) == (
                        422, "idempotency_key_reused")
            elif fault is not None:
                assert (res.status, res.body["error"]["code"]) == (503, "limiter_unavailable")
                self.runs += fault == "store"  # run, then withheld and refunded
            else:
                assert res.status == 200 and "idempotent-replayed" not in res.headers
                assert res.headers["x-request-id"] == key
                self.served[key] = (prompt, res.body)
                self.runs += 1
                self.standing += COST

        @rule()
        def cache_lost(self) -> None:
            flushall(redis_server)
            self.standing = 0

        @invariant()
        def charged_once_run_once(self) -> None:
            assert arrivals(env) == self.runs
            assert used(self.user) == self.standing

    base = hsettings()
    run_state_machine_as_test(Keys, settings=hsettings(
        base, max_examples=max(4, base.max_examples // 12), stateful_step_count=8,
        deadline=None))
