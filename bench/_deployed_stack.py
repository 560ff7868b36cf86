"""What a deployed function reaches, on loopback: for ``bench/cold_start.py --deployed``.

- Redis over TLS (``rediss://``, a self-signed certificate made with ``openssl``) with
  ``REDIS_AUTH=iam``: each function signs an ElastiCache IAM token with botocore, as in
  Lambda, and logs in with it as ``USER``. The local server cannot check a SigV4 token, so
  that ACL user takes any password (``nopass``); the signing, the TLS handshake and the
  ``AUTH`` are the cloud's. Standalone, not cluster mode (ElastiCache Serverless is a
  cluster: the cluster client's slot discovery is not in these numbers).
- One moto server (``local/dynamodb.py``) for DynamoDB, holding the entitlements table, and
  for Secrets Manager, holding the provider keys the functions read through Powertools'
  parameters, by ARN.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from pathlib import Path
from types import TracebackType
from typing import Any

#: The ElastiCache user the functions log in as (an ACL user of the local server).
USER = "atto-bench-iam"
#: The cache name signed into the token.
CACHE_NAME = "atto-bench"
REGION = "us-east-1"
#: Secret values, by the environment variable that names the secret (template.yaml).
SECRETS = {"LLM_SECRET_ARN": "local-key", "SEARCH_SECRET_ARN": "local-key",
           "SALARY_SECRET_ARN": json.dumps({"app_id": "local-id", "app_key": "local-key"})}


class DeployedStack:
    """A TLS Redis with an IAM user, and moto with the table and the provider secrets.

    Args:
        full: also start the TLS Redis and give the entitlements table (False: only the
            secrets, for ``bench/cold_start.py --secrets``).

    Attributes:
        redis: the TLS ``RedisServer`` (None unless ``full``); its plain port is the bench's
            own, for ``cli``.
        env: the variables a function needs to reach all of it, as deployed (without the
            ``*_SECRET_ARN`` variables: ``secret_arns`` has them).
        secret_arns: ARN of each secret, by the variable that names it.
    """

    def __init__(self, *, full: bool = True) -> None:
        self.full = full
        self.redis: Any = None
        self.env: dict[str, str] = {}
        self.secret_arns: dict[str, str] = {}
        self._dynamo: Any = None
        self._folder = ""

    def __enter__(self) -> DeployedStack:
        import logging

        from local.dynamodb import DynamoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's line per request
        try:
            self._dynamo = DynamoServer().__enter__()
            self.secret_arns = _create_secrets(self._dynamo.url)
            self.env = {"AWS_ENDPOINT_URL_SECRETS_MANAGER": self._dynamo.url}
            if self.full:
                self._start_redis()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _start_redis(self) -> None:
        from local.redis_servers import RedisServer, free_port

        if not shutil.which("openssl"):
            raise RuntimeError("--deployed needs openssl (a certificate for Redis over TLS)")
        self._folder = tempfile.mkdtemp(prefix="deployed-stack-")
        cert, key = Path(self._folder) / "cert.pem", Path(self._folder) / "key.pem"
        subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                        "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1",
                        "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1",
                        "-keyout", str(key), "-out", str(cert)], check=True,
                       capture_output=True)
        tls_port = free_port()
        self.redis = RedisServer(extra=[
            "--tls-port", str(tls_port), "--tls-cert-file", str(cert),
            "--tls-key-file", str(key), "--tls-ca-cert-file", str(cert),
            "--tls-auth-clients", "no"]).start()
        self.redis.cli("ACL", "SETUSER", USER, "on", "nopass", "~*", "&*", "+@all")
        self.env.update({
            "REDIS_URL": f"rediss://127.0.0.1:{tls_port}", "REDIS_TLS_CA_FILE": str(cert),
            "REDIS_AUTH": "iam", "REDIS_USER": USER, "ELASTICACHE_CACHE_NAME": CACHE_NAME,
            "REDIS_CLUSTER": "false",
            "ATTO_ENTITLEMENTS_TABLE": self._dynamo.table,
            "ATTO_DYNAMODB_ENDPOINT": self._dynamo.url,
        })

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._dynamo is not None:
            self._dynamo.__exit__(None, None, None)
            self._dynamo = None
        if self.redis is not None:
            self.redis.close()
            self.redis = None
        if self._folder:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = ""


def _create_secrets(endpoint: str) -> dict[str, str]:
    """Store ``SECRETS`` in the moto server; returns each secret's ARN by its variable."""
    import boto3

    client = boto3.client("secretsmanager", endpoint_url=endpoint, region_name=REGION,
                          aws_access_key_id="local", aws_secret_access_key="local")
    return {name: client.create_secret(Name=f"atto-bench/{name.lower()}",
                                       SecretString=value)["ARN"]
            for name, value in SECRETS.items()}
