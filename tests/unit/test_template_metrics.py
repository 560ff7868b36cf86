"""template.yaml's alarms and dashboard watch only metrics that the code emits.

The emitted set is derived from the code, not kept by hand: the metric-name constants and
dimension sets declared in ``usage_limits/web/observability.py``, and the calls
``obs.count(...)``/``obs.provider_count(...)`` found in the layers' and functions' source
(a declared metric that nothing counts is not emitted). Metrics of the ``AWS/Lambda``
namespace are the platform's own.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path
from typing import Any

import pytest

from local.template import functions, load_template, parameter_defaults
from usage_limits.web import events
from usage_limits.web import observability as obs

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "template.yaml"
SOURCES = [*sorted((ROOT / "layers").rglob("*.py")), *sorted((ROOT / "functions").rglob("*.py"))]
#: What stands for the template's ``${...}`` variables when the dashboard body is read.
SUB_SAMPLES = {"Stage": "dev", "AWS::Region": "us-east-1"}
#: The platform's metrics an alarm may watch, with their dimension names.
PLATFORM_METRICS = {("AWS/Lambda", "Duration"): frozenset({"FunctionName"}),
                    ("AWS/Lambda", "Errors"): frozenset({"FunctionName"})}
_SEARCH = re.compile(r"SEARCH\('\{(?P<schema>[^}]*)\}\s+MetricName=\"(?P<name>\w+)\""
                     r"(?P<filters>[^']*)'")
_FILTER = re.compile(r'(\w+)="([^"]*)"')


def _emitting_calls() -> dict[str, str]:
    """Metric name -> ``count`` or ``provider_count``, for every call found in the source."""
    found: dict[str, str] = {}
    for path in SOURCES:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if called not in ("count", "provider_count"):
                continue
            args = node.args[1:2] if called == "provider_count" else node.args[:1]
            for arg in args:
                constant = arg.attr if isinstance(arg, ast.Attribute) else getattr(arg, "id", None)
                value = getattr(obs, constant or "", None)
                if isinstance(value, str):
                    found[value] = called
    # request_done() counts requests and their 4xx/5xx answers: emitted when it is called.
    middleware = (ROOT / "layers/usage_limits/usage_limits/web/middleware.py").read_text()
    assert "obs.request_done(" in middleware
    return found


def _emitted() -> dict[str, set[frozenset[str]]]:
    """Metric name -> the dimension sets it is published under, derived from the code."""
    groups = {"count": (obs.REQUEST_METRICS, obs.REQUEST_DIMENSION_SETS),
              "provider_count": (obs.PROVIDER_METRICS, obs.PROVIDER_DIMENSION_SETS)}
    out: dict[str, set[frozenset[str]]] = {}
    for name, called in _emitting_calls().items():
        names, dimension_sets = groups[called]
        assert name in names, f"{name} is counted with {called} but not declared in its group"
        out[name] = {frozenset(d) for d in dimension_sets}
    return out


def _metered() -> set[str]:
    """Logical ids of the functions that charge tokens (their app uses ``require_tokens``)."""
    return {s.logical_id for s in functions(TEMPLATE)
            if "Depends(require_tokens(" in (ROOT / s.code_dir / "app.py").read_text()}


def _providers() -> set[str]:
    """The names of the provider clients (``ProviderClient.name``)."""
    import importlib
    import pkgutil

    import atto_providers
    from atto_providers.base import ProviderClient

    for module in pkgutil.iter_modules(atto_providers.__path__):
        importlib.import_module(f"atto_providers.{module.name}")

    names: set[str] = set()
    stack = list(ProviderClient.__subclasses__())
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        if "name" in vars(cls):
            names.add(cls.name)
    return names


def _dashboard(template: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The dashboard body (``${...}`` filled in with samples) and its ``Fn::Sub`` variables."""
    body, variables = template["Resources"]["Dashboard"]["Properties"]["DashboardBody"]["Fn::Sub"]
    samples = {**parameter_defaults(template), **SUB_SAMPLES,
               **{name: "7" for name in variables}}
    text = re.sub(r"\$\{([\w:]+)\}", lambda m: samples[m[1]], body)
    return json.loads(text), variables


def _alarm_metrics(props: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    """(namespace, metric, dimensions) of every metric an alarm watches."""
    if "MetricName" in props:
        return [(props["Namespace"], props["MetricName"],
                 {d["Name"]: d["Value"] for d in props.get("Dimensions", [])})]
    out = []
    for query in props["Metrics"]:
        if "MetricStat" in query:
            metric = query["MetricStat"]["Metric"]
            out.append((metric["Namespace"], metric["MetricName"],
                        {d["Name"]: d["Value"] for d in metric.get("Dimensions", [])}))
        else:
            assert "Expression" in query and "SEARCH" not in query["Expression"]
    return out


def _widget_metrics(widget: dict[str, Any]) -> list[tuple[str, str, dict[str, Any], bool]]:
    """(namespace, metric, dimensions, exact) of every metric a widget shows.

    ``exact`` is False for a ``SEARCH``: its dimensions are the schema's names (the exact
    dimension set it matches), with the values it filters on.
    """
    out = []
    for row in widget["properties"]["metrics"]:
        if isinstance(row[0], dict):
            expression = row[0]["expression"]
            for match in _SEARCH.finditer(expression):
                namespace, *names = [p.strip() for p in match["schema"].split(",")]
                values = dict(_FILTER.findall(match["filters"]))
                out.append((namespace, match["name"], {n: values.get(n) for n in names}, False))
            continue
        fields = [f for f in row if not isinstance(f, dict)]
        namespace, name, *pairs = fields
        out.append((namespace, name, dict(zip(pairs[::2], pairs[1::2], strict=True)), True))
    return out


@pytest.fixture(scope="module")
def template() -> dict[str, Any]:
    """template.yaml with its short intrinsic tags in long form."""
    return load_template(TEMPLATE)


def _alarms(template: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: r["Properties"] for name, r in template["Resources"].items()
            if r["Type"] == "AWS::CloudWatch::Alarm"}


def _check(namespace: str, name: str, dimensions: dict[str, Any], stage: Any,
           emitted: dict[str, set[frozenset[str]]], providers: set[str]) -> None:
    """One metric the template names is one the code emits, under the same dimensions."""
    if (namespace, name) in PLATFORM_METRICS:
        assert set(dimensions) == PLATFORM_METRICS[namespace, name]
        return
    assert namespace == obs.NAMESPACE, f"{name}: namespace {namespace}"
    assert name in emitted, f"{name} is watched but nothing emits it"
    assert frozenset(dimensions) in emitted[name], (
        f"{name} is watched under {sorted(dimensions)}; it is emitted under "
        f"{[sorted(d) for d in emitted[name]]}")
    assert dimensions[obs.ENV] == stage, f"{name}: env must be the stage"
    if dimensions.get(obs.PROVIDER) is not None:  # a search may leave it open
        assert dimensions[obs.PROVIDER] in providers, f"{name}: unknown provider"


def test_every_alarm_watches_an_emitted_metric(template: dict[str, Any]) -> None:
    """Each alarm's metrics are emitted by the code, in its namespace, with its dimensions."""
    emitted, providers = _emitted(), _providers()
    alarms = _alarms(template)
    assert len(alarms) >= 7
    for name, props in alarms.items():
        watched = _alarm_metrics(props)
        assert watched, name
        for namespace, metric, dimensions in watched:
            _check(namespace, metric, dimensions, {"Ref": "Stage"}, emitted, providers)


def test_every_dashboard_widget_shows_an_emitted_metric(template: dict[str, Any]) -> None:
    """Each dashboard widget's metrics and searches name emitted metrics and dimension sets."""
    emitted, providers = _emitted(), _providers()
    body, _ = _dashboard(template)
    shown = [m for w in body["widgets"] for m in _widget_metrics(w)]
    assert shown and all(w["properties"]["metrics"] for w in body["widgets"])
    for namespace, metric, dimensions, _exact in shown:
        _check(namespace, metric, dimensions, SUB_SAMPLES["Stage"], emitted, providers)


def test_the_check_rejects_a_metric_nobody_sends() -> None:
    """The check itself fails for an unknown name and for dimensions the code never uses."""
    emitted, providers = _emitted(), _providers()
    with pytest.raises(AssertionError, match="nothing emits it"):
        _check(obs.NAMESPACE, "NoSuchMetric", {obs.ENV: "dev"}, "dev", emitted, providers)
    with pytest.raises(AssertionError, match="emitted under"):
        _check(obs.NAMESPACE, obs.UPSTREAM_429, {obs.ENV: "dev"}, "dev", emitted, providers)
    with pytest.raises(AssertionError, match="namespace"):
        _check("Other", obs.REQUESTS, {obs.ENV: "dev"}, "dev", emitted, providers)


def test_template_namespace_is_the_codes(template: dict[str, Any]) -> None:
    """The functions publish to the namespace the alarms and the dashboard read."""
    variables = template["Globals"]["Function"]["Environment"]["Variables"]
    assert variables[obs.NAMESPACE_ENV] == obs.NAMESPACE
    assert variables[obs.STAGE_ENV] == {"Ref": "Stage"}


def test_alarms_notify_the_alarm_topic(template: dict[str, Any]) -> None:
    """Every alarm sends to the alarm topic, which an optional email parameter subscribes to."""
    for name, props in _alarms(template).items():
        assert props["AlarmActions"] == [{"Ref": "AlarmTopic"}], name
    subscription = template["Resources"]["AlarmEmailSubscription"]
    assert subscription["Condition"] == "HasAlarmEmail"
    assert subscription["Properties"]["Endpoint"] == {"Ref": "AlarmEmail"}
    assert template["Parameters"]["AlarmEmail"]["Default"] == ""


def test_duration_alarm_divides_by_each_functions_timeout(template: dict[str, Any]) -> None:
    """The p99-duration alarm compares every function's p99 with that function's timeout."""
    props = _alarms(template)["DurationAlarm"]
    by_id = {q["Id"]: q for q in props["Metrics"]}
    expression = next(q["Expression"] for q in props["Metrics"] if "Expression" in q)
    divisors = {m[1]: int(m[2]) for m in re.finditer(r"FILL\((\w+), 0\) / (\d+)", expression)}
    timeouts = {s.logical_id: s.timeout for s in functions(TEMPLATE)}
    watched = {by_id[i]["MetricStat"]["Metric"]["Dimensions"][0]["Value"]["Ref"]: ms
               for i, ms in divisors.items()}
    assert watched == {fn: timeouts[fn] * 1000 for fn in watched}
    assert _metered() | {"UsageFunction"} <= set(watched)
    assert props["Threshold"] < 1


def test_provider_widgets_draw_each_providers_configured_limit(template: dict[str, Any]) -> None:
    """Each provider's calls widget has a limit line taken from the rate parameter it runs at."""
    body, variables = _dashboard(template)
    raw_body = template["Resources"]["Dashboard"]["Properties"]["DashboardBody"]["Fn::Sub"][0]
    rate_env = {name: value["Ref"] for name, value in
                template["Globals"]["Function"]["Environment"]["Variables"].items()
                if name.endswith("_RATE")}
    seen = set()
    for widget in body["widgets"]:
        calls = [m for m in _widget_metrics(widget) if m[1] == obs.PROVIDER_CALLS]
        if not calls:
            continue
        provider = calls[0][2][obs.PROVIDER]
        parameter = rate_env[f"{provider.upper()}_RATE"]
        (line,) = widget["properties"]["annotations"]["horizontal"]
        placeholder = re.search(re.escape(f'"label": "{provider} limit ')
                                + r'[^"]*", "value": \$\{(\w+)\}', raw_body)
        assert placeholder, provider
        assert variables[placeholder[1]] == {"Fn::Select": [0, {"Fn::Split": [
            "/", {"Ref": parameter}]}]}
        assert line["value"] == 7
        seen.add(provider)
    assert seen == _providers()


def test_rate_parameters_have_a_unit_the_dashboard_knows(template: dict[str, Any]) -> None:
    """Provider rate parameters are "<number>/<s|m|h>", which the limit lines convert."""
    from usage_limits.throttle import parse_rate

    pattern = re.compile(template["Parameters"]["LlmRate"]["AllowedPattern"])
    for name in ("LlmRate", "SalaryRate", "SearchRate", "PagesRate"):
        spec = template["Parameters"][name]
        assert spec["AllowedPattern"] == pattern.pattern
        assert pattern.fullmatch(spec["Default"]) and parse_rate(spec["Default"])
    assert not pattern.fullmatch("90000/1m") and pattern.fullmatch("1.5/h")


def test_events_rule_forwards_the_published_detail_types(template: dict[str, Any]) -> None:
    """The optional email rule matches exactly the source and detail-types the code sends."""
    resources = template["Resources"]
    rule = resources["UsageEventsRule"]
    assert rule["Condition"] == "HasUsageEventsEmail"
    pattern = rule["Properties"]["EventPattern"]
    assert pattern == {"source": [events.SOURCE], "detail-type": list(events.DETAIL_TYPES)}
    assert rule["Properties"]["EventBusName"] == {"Ref": "UsageEventBus"}
    topic = resources["UsageEventsTopic"]["Properties"]
    assert topic["Subscription"] == [{"Protocol": "email", "Endpoint": {"Ref": "UsageEventsEmail"}}]


def test_put_events_is_allowed_on_the_usage_bus_only(template: dict[str, Any]) -> None:
    """Metered functions and the auditor (its expiry sweep) may PutEvents on the usage bus
    and nowhere else; they know its name."""
    resources = template["Resources"]
    policy = resources["EventsPublishPolicy"]["Properties"]
    (statement,) = policy["PolicyDocument"]["Statement"]
    assert statement == {"Effect": "Allow", "Action": "events:PutEvents",
                         "Resource": {"Fn::GetAtt": ["UsageEventBus", "Arn"]}}
    assert {r["Ref"].removesuffix("Role") for r in policy["Roles"]} == _metered() | {
        "AuditorFunction"}
    variables = template["Globals"]["Function"]["Environment"]["Variables"]
    assert variables[events.ATTO_EVENT_BUS] == {"Ref": "UsageEventBus"}


def test_threshold_parameters_are_valid_settings(template: dict[str, Any]) -> None:
    """The threshold parameters reach the functions and their defaults parse as the code's."""
    from usage_limits import thresholds

    variables = template["Globals"]["Function"]["Environment"]["Variables"]
    params = template["Parameters"]
    env = {name: str(params[value["Ref"]]["Default"]) for name, value in variables.items()
           if name in (thresholds.ATTO_USAGE_THRESHOLDS, thresholds.ATTO_USAGE_THRESHOLD_MARGIN)}
    assert len(env) == 2
    assert thresholds.Thresholds.from_env(env) == thresholds.Thresholds()
    pattern = re.compile(params["UsageThresholds"]["AllowedPattern"])
    assert pattern.fullmatch("none") and pattern.fullmatch("50,90,100")
    assert not pattern.fullmatch("80, 100")


def test_the_dashboard_shows_credit_drawn_in_all_and_by_route(template: dict[str, Any]) -> None:
    """One widget shows CreditDrawn for the stage and per route, as the guard counts it."""
    body, _ = _dashboard(template)
    shown = [(m[2], m[3]) for w in body["widgets"] for m in _widget_metrics(w)
             if m[1] == obs.CREDIT_DRAWN]
    assert sorted(shown, key=lambda m: len(m[0])) == [
        ({obs.ENV: "dev"}, True),
        ({obs.ENV: "dev", obs.ROUTE: None, obs.SERVICE_DIMENSION: None}, False)]
    assert obs.CREDIT_DRAWN in obs.REQUEST_METRICS and obs.CREDIT_DRAWN in _emitted()


def test_credit_low_parameter_reaches_the_functions_as_a_valid_setting(
        template: dict[str, Any]) -> None:
    """``CreditLowPercent`` sets ``ATTO_CREDIT_LOW_PERCENT``; its default and bounds are the
    setting's."""
    from usage_limits.budget import DEFAULT_CREDIT_LOW_PERCENT
    from usage_limits.exceptions import InvalidArgument
    from usage_limits.web.settings import ATTO_CREDIT_LOW_PERCENT, WebSettings

    variables = template["Globals"]["Function"]["Environment"]["Variables"]
    assert variables[ATTO_CREDIT_LOW_PERCENT] == {"Ref": "CreditLowPercent"}
    param = template["Parameters"]["CreditLowPercent"]
    assert param["Type"] == "Number"
    default = WebSettings.from_env({ATTO_CREDIT_LOW_PERCENT: str(param["Default"])})
    assert default.credit_low_percent == DEFAULT_CREDIT_LOW_PERCENT == 20
    for value in (param["MinValue"], param["MaxValue"]):
        assert WebSettings.from_env({ATTO_CREDIT_LOW_PERCENT: str(value)}).credit_low_percent
    for value in (param["MinValue"] - 1, param["MaxValue"] + 1):
        with pytest.raises(InvalidArgument, match=ATTO_CREDIT_LOW_PERCENT):
            WebSettings.from_env({ATTO_CREDIT_LOW_PERCENT: str(value)})
