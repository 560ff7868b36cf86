"""An EventBridge bus (moto) whose ``atto.cloud`` events a test reads back from an SQS queue."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import boto3
import pytest

from usage_limits.web import events

REGION = "us-east-1"


@pytest.fixture(scope="module")
def moto_endpoint() -> Iterator[str]:
    """moto's AWS as a server on a free local port, for one module (processes and handlers
    the test starts reach it by URL)."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


class EventBus:
    """A new bus with a rule forwarding every ``atto.cloud`` event to a queue of its own.

    Args:
        name: The bus's name (default: a fresh ``usage-<hex>``), also its rule's and queue's.
        endpoint: moto's server (``http://host:port``); default: the in-process ``mock_aws``.
    """

    def __init__(self, name: str | None = None, *, endpoint: str | None = None) -> None:
        self.name = name or f"usage-{uuid.uuid4().hex[:12]}"
        args: dict[str, Any] = {"region_name": REGION, "aws_access_key_id": "testing",
                                "aws_secret_access_key": "testing"}
        if endpoint:
            args["endpoint_url"] = endpoint
        self.events = boto3.client("events", **args)
        self.sqs = boto3.client("sqs", **args)
        self.events.create_event_bus(Name=self.name)
        self.queue = self.sqs.create_queue(QueueName=self.name)["QueueUrl"]
        arn = self.sqs.get_queue_attributes(QueueUrl=self.queue, AttributeNames=["QueueArn"])
        self.events.put_rule(Name=self.name, EventBusName=self.name,
                             EventPattern=json.dumps({"source": [events.SOURCE]}))
        self.events.put_targets(Rule=self.name, EventBusName=self.name, Targets=[
            {"Id": "queue", "Arn": arn["Attributes"]["QueueArn"]}])

    def received(self) -> list[dict[str, Any]]:
        """Every event published since the last call (whole EventBridge events), oldest first."""
        out: list[dict[str, Any]] = []
        while True:
            batch = self.sqs.receive_message(QueueUrl=self.queue, MaxNumberOfMessages=10)
            messages = batch.get("Messages", [])
            if not messages:
                return out
            for message in messages:
                out.append(json.loads(message["Body"]))
                self.sqs.delete_message(QueueUrl=self.queue,
                                        ReceiptHandle=message["ReceiptHandle"])

    def details(self, detail_type: str) -> list[dict[str, Any]]:
        """The details of the events published since the last call, each of ``detail_type``."""
        got = self.received()
        assert [e["detail-type"] for e in got] == [detail_type] * len(got), got
        return [e["detail"] for e in got]
