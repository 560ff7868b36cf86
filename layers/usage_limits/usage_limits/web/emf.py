"""``MetricSet``: one CloudWatch embedded metric format (EMF) line of metrics, written by hand.

A request writes one or a few EMF lines; Powertools' ``Metrics`` costs tens of milliseconds
to import on a cold start and about 25 µs per line, so the request path writes them here.
The lines keep the shape Powertools' ``Metrics`` writes:

    {"_aws": {"Timestamp": <ms>, "CloudWatchMetrics": [{"Namespace": ...,
       "Dimensions": [[<dimensions>..., "service"], [<each further set>...]],
       "Metrics": [{"Name": ..., "Unit": ...}, ...]}]},
     <dimension>: <value>, ..., <metric>: [<value as float>, ...], ...}

Every value added to a metric during a request goes into its list, in order; a set holding
100 metrics, or a metric holding 100 values, is written at once and emptied (CloudWatch's
limit per line), as Powertools does.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

#: Units CloudWatch accepts.
UNITS = frozenset({
    "Seconds", "Microseconds", "Milliseconds", "Bytes", "Kilobytes", "Megabytes", "Gigabytes",
    "Terabytes", "Bits", "Kilobits", "Megabits", "Gigabits", "Terabits", "Percent", "Count",
    "Bytes/Second", "Kilobytes/Second", "Megabytes/Second", "Gigabytes/Second",
    "Terabytes/Second", "Bits/Second", "Kilobits/Second", "Megabits/Second",
    "Gigabits/Second", "Terabits/Second", "Count/Second", "None"})
#: Metrics per line, and values per metric per line.
MAX_METRICS = 100


class MetricSet:
    """The metrics of one group for the current request, and the line that writes them.

    Args:
        namespace: the CloudWatch namespace.
        service: the ``service`` dimension's value (always the last of the first set).
        dimensions: the dimensions of a line written without others (a full set).
        extra_sets: further dimension sets, each a tuple of dimension names.
    """

    def __init__(self, namespace: str, service: str, dimensions: dict[str, str],
                 extra_sets: tuple[tuple[str, ...], ...] = ()) -> None:
        self.namespace = namespace
        self.service = service
        self.dimensions = dimensions
        self.extra_sets = extra_sets
        self.values: dict[str, list[float]] = {}
        self.units: dict[str, str] = {}

    @property
    def metric_set(self) -> dict[str, dict[str, Any]]:
        """The metrics added so far as Powertools' ``Metrics.metric_set`` shows them:
        ``{name: {"Unit": unit, "Value": [values]}}``."""
        return {name: {"Unit": self.units[name], "Value": values}
                for name, values in self.values.items()}

    def add(self, name: str, value: float, unit: str = "Count") -> None:
        """Add ``value`` to metric ``name`` for this request.

        Raises:
            ValueError: ``unit`` is not a CloudWatch unit, or ``value`` is not a number.
        """
        if unit not in UNITS:
            raise ValueError(f"{unit!r} is not a CloudWatch unit")
        if not isinstance(value, (int, float)):
            raise ValueError(f"{value!r} is not a valid number")
        found = self.values.get(name)
        if found is None:
            found = self.values[name] = []
        found.append(float(value))
        self.units[name] = unit
        if len(self.values) == MAX_METRICS or len(found) == MAX_METRICS:
            self.flush()

    def line(self, dimensions: dict[str, str] | None = None,
             timestamp_ms: int | None = None) -> str:
        """The EMF line of the metrics added so far (which must not be empty).

        Args:
            dimensions: the first dimension set's names and values, in order (default
                ``self.dimensions``); ``service`` is added after them.
            timestamp_ms: the line's time (default now).
        """
        dimensions = {**(self.dimensions if dimensions is None else dimensions),
                      "service": self.service}
        document: dict[str, Any] = {
            "_aws": {
                "Timestamp": int(time.time() * 1000) if timestamp_ms is None else timestamp_ms,
                "CloudWatchMetrics": [{
                    "Namespace": self.namespace,
                    "Dimensions": [list(dimensions), *map(list, self.extra_sets)],
                    "Metrics": [{"Name": name, "Unit": unit}
                                for name, unit in self.units.items()],
                }],
            },
            **dimensions,
        }
        document.update(self.values)
        return json.dumps(document, separators=(",", ":"))

    def flush(self, dimensions: dict[str, str] | None = None) -> None:
        """Write the line to stdout (nothing when no metric was added) and start afresh.

        Args:
            dimensions: as for ``line``.
        """
        if self.values:
            line = self.line(dimensions)
            self.values, self.units = {}, {}
            sys.stdout.write(line + "\n")
