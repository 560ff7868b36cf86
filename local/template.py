"""Read template.yaml: the functions, their routes and settings, as ``sam local`` sees them.

``make serve`` mounts every function's app on its route, ``make invoke`` finds a function's
code and timeout, and the tests check the template, all from here, so template.yaml stays
the one place where a route is declared.

CloudFormation short tags (``!Ref``, ``!GetAtt``, ``!Sub``, ``!If``, ...) load as their long
forms (``{"Ref": ...}``, ``{"Fn::GetAtt": [...]}``), so no AWS tooling is needed.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

#: The project root: relative template paths are resolved against it, not the cwd.
ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TEMPLATE = "template.yaml"

#: Pseudo parameters as `sam local` resolves them without an AWS account.
PSEUDO_PARAMETERS = {
    "AWS::AccountId": "123456789012",
    "AWS::Partition": "aws",
    "AWS::Region": "us-east-1",
    "AWS::StackName": "atto-cloud-local",
    "AWS::URLSuffix": "amazonaws.com",
}


class CloudFormationLoader(yaml.SafeLoader):
    """A safe YAML loader that also reads CloudFormation's short-form intrinsic tags."""


def _construct_intrinsic(loader: CloudFormationLoader, tag_suffix: str,
                         node: yaml.Node) -> dict[str, Any]:
    """``!Name value`` -> ``{"Fn::Name": value}`` (``!Ref`` and ``!Condition`` keep their name)."""
    if isinstance(node, yaml.ScalarNode):
        value: Any = loader.construct_scalar(node)
    elif isinstance(node, yaml.SequenceNode):
        value = loader.construct_sequence(node, deep=True)
    else:
        value = loader.construct_mapping(node, deep=True)
    if tag_suffix == "GetAtt" and isinstance(value, str):
        value = value.split(".", 1)  # !GetAtt Cache.Endpoint.Address -> [Cache, Endpoint.Address]
    key = tag_suffix if tag_suffix in ("Ref", "Condition") else f"Fn::{tag_suffix}"
    return {key: value}


CloudFormationLoader.add_multi_constructor("!", _construct_intrinsic)


@dataclass(frozen=True)
class FunctionSpec:
    """One function route of the template.

    Attributes:
        logical_id: the function's logical id, e.g. ``StructuredFunction``.
        code_dir: its ``CodeUri`` as written, relative to the project root
            (``functions/structured``).
        handler: ``module.attribute`` inside ``code_dir`` (``app.handler``).
        method: HTTP method of its HttpApi event, upper-case (``POST``).
        path: path of its HttpApi event (``/v1/structured``).
        timeout: the function's timeout in seconds.
        env: environment variables (Globals merged with the function's own) whose values
            are known without deploying: literals and parameter defaults. Values that only
            exist after a deploy (the cache endpoint, secret ARNs) are left out.
    """

    logical_id: str
    code_dir: str
    handler: str
    method: str
    path: str
    timeout: int
    env: dict[str, str] = field(default_factory=dict)

    @property
    def route_key(self) -> str:
        """The HTTP API route key, ``"POST /v1/structured"``."""
        return f"{self.method} {self.path}"


def load_template(path: str | Path = DEFAULT_TEMPLATE) -> dict[str, Any]:
    """Parse a SAM template, short intrinsic tags included.

    Args:
        path: the template file; a relative path is relative to the project root.

    Returns:
        The template as plain dicts and lists.

    Raises:
        OSError: the file cannot be read.
        ValueError: the file is not a YAML mapping.
    """
    file = Path(path)
    if not file.is_absolute():
        file = ROOT / file
    with file.open(encoding="utf-8") as f:
        template = yaml.load(f, Loader=CloudFormationLoader)  # a SafeLoader subclass
    if not isinstance(template, dict):
        raise ValueError(f"{file} is not a template (expected a YAML mapping)")
    return template


def parameter_defaults(template: dict[str, Any]) -> dict[str, str]:
    """Every parameter that has a default, as the string CloudFormation would pass."""
    out: dict[str, str] = {}
    for name, spec in (template.get("Parameters") or {}).items():
        if isinstance(spec, dict) and "Default" in spec:
            out[name] = _as_string(spec["Default"])
    return out


@dataclass(frozen=True)
class FunctionCode:
    """One function of the template, with or without a route (``make invoke`` runs either).

    Attributes:
        logical_id: the function's logical id, e.g. ``AuditorFunction``.
        code_dir: its ``CodeUri`` as written (``functions/auditor``).
        handler: ``module.attribute`` inside ``code_dir`` (``app.handler``).
        timeout: the function's timeout in seconds.
        env: its environment known without deploying (as ``FunctionSpec.env``).
        routes: its HttpApi routes (none for a scheduled function).
    """

    logical_id: str
    code_dir: str
    handler: str
    timeout: int
    env: dict[str, str] = field(default_factory=dict)
    routes: tuple[FunctionSpec, ...] = ()

    @property
    def name(self) -> str:
        """The name ``make invoke FN=...`` takes: the last part of ``code_dir``."""
        return self.code_dir.rsplit("/", 1)[-1]


def every_function(path: str | Path = DEFAULT_TEMPLATE) -> list[FunctionCode]:
    """One ``FunctionCode`` per ``AWS::Serverless::Function``, routed or not.

    Args:
        path: the template file; a relative path is relative to the project root.

    Returns:
        The functions, in template order.

    Raises:
        ValueError: a function has no ``CodeUri`` or an HttpApi event has no method or path.
    """
    template = load_template(path)
    globals_ = (template.get("Globals") or {}).get("Function") or {}
    known = {**PSEUDO_PARAMETERS, **parameter_defaults(template)}
    found: list[FunctionCode] = []
    for logical_id, resource in (template.get("Resources") or {}).items():
        if resource.get("Type") != "AWS::Serverless::Function":
            continue
        props = resource.get("Properties") or {}
        code_dir = props.get("CodeUri", globals_.get("CodeUri"))
        if not isinstance(code_dir, str):
            raise ValueError(f"{logical_id} has no local CodeUri")
        variables = {
            **((globals_.get("Environment") or {}).get("Variables") or {}),
            **((props.get("Environment") or {}).get("Variables") or {}),
        }
        env = {}
        for name, raw in variables.items():
            value = _resolve(raw, known)
            if value is not None:
                env[name] = value
        code = FunctionCode(
            logical_id=logical_id, code_dir=code_dir.rstrip("/"),
            handler=str(props.get("Handler", globals_.get("Handler", "app.handler"))),
            timeout=int(props.get("Timeout", globals_.get("Timeout", 3))), env=env)
        routes = []
        for event_name, event in (props.get("Events") or {}).items():
            if event.get("Type") != "HttpApi":
                continue
            event_props = event.get("Properties") or {}
            method, route = event_props.get("Method"), event_props.get("Path")
            if not isinstance(method, str) or not isinstance(route, str):
                raise ValueError(f"{logical_id}.{event_name} needs a literal Method and Path")
            routes.append(FunctionSpec(
                logical_id=logical_id, code_dir=code.code_dir, handler=code.handler,
                method=method.upper(), path=route, timeout=code.timeout, env=dict(env)))
        found.append(FunctionCode(**{**code.__dict__, "routes": tuple(routes)}))
    return found


def functions(path: str | Path = DEFAULT_TEMPLATE) -> list[FunctionSpec]:
    """One ``FunctionSpec`` per HttpApi event of every ``AWS::Serverless::Function``.

    Args:
        path: the template file; a relative path is relative to the project root.

    Returns:
        The specs, in template order.

    Raises:
        ValueError: a function has no ``CodeUri`` or an HttpApi event has no method or path.
    """
    return [spec for code in every_function(path) for spec in code.routes]


def local_environment(spec: FunctionSpec | FunctionCode,
                      base: Mapping[str, str]) -> dict[str, str]:
    """A function's environment under ``make serve`` and ``make invoke``.

    Its template values (Globals merged with its own), under ``base``: what the shell and the
    local stack set wins, as ``--env-vars`` wins over the template under ``sam local``.

    Args:
        spec: the function.
        base: the process environment once the local stack has set its values.

    Returns:
        The variables to run the function with.
    """
    return {**spec.env, **base}


_SUB_VAR = re.compile(r"\$\{([^}!]+)\}")


def _resolve(value: Any, known: dict[str, str]) -> str | None:
    """A value's string when it needs no deploy (literal, parameter, pseudo parameter)."""
    if isinstance(value, str | int | float | bool):
        return _as_string(value)
    if isinstance(value, dict) and len(value) == 1:
        (key, arg), = value.items()
        if key == "Ref" and isinstance(arg, str):
            return known.get(arg)
        if key == "Fn::Sub" and isinstance(arg, str):
            names = _SUB_VAR.findall(arg)
            if all(name in known for name in names):
                return _SUB_VAR.sub(lambda m: known[m.group(1)], arg)
    return None


def _as_string(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return ",".join(_as_string(v) for v in value)
    return str(value)
