"""``JsonLogger``: one JSON log line per record on stdout, as Powertools' Logger writes them.

The request path logs a line per request, so its logger is small and made here rather than
imported: Powertools' package costs tens of milliseconds to import on a cold start and about
30 µs per line. The lines keep Powertools' shape (its defaults, as the functions use them):

- keys in order ``level``, ``location`` (``function:line``), ``message``, ``timestamp``
  (``2026-12-01 23:40:17,123+0000``, local time, which is UTC in Lambda), ``service``; then
  the keys appended with ``append_keys`` (in the order first appended); then the record's
  ``extra``; then, for a record with an exception, ``exception`` (the traceback text),
  ``exception_name`` and ``stack_trace``; then ``xray_trace_id`` (from ``_X_AMZN_TRACE_ID``);
  keys whose value is None are left out;
- a message that is a dict is written as an object, one that is JSON text is decoded, one
  with ``%`` arguments is formatted;
- compact JSON (``separators=(",", ":")``), anything unserializable written as ``str()``.

The level is Lambda's advanced logging controls' (``AWS_LAMBDA_LOG_LEVEL``) when set, else
``POWERTOOLS_LOG_LEVEL``, else ``LOG_LEVEL``, else INFO. Records go to a stdlib logger named
after the service, which does not propagate to the root logger.

Not carried over from Powertools, since no function uses them: log sampling
(``POWERTOOLS_LOGGER_SAMPLE_RATE``), logging the incoming event, ``POWERTOOLS_DEV``'s indented
output, log buffering, and the warning when Lambda's level is above the one asked for.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import traceback
from collections.abc import Mapping
from typing import Any

#: Environment variables read here.
LAMBDA_LOG_LEVEL_ENV = "AWS_LAMBDA_LOG_LEVEL"
POWERTOOLS_LOG_LEVEL_ENV = "POWERTOOLS_LOG_LEVEL"
LOG_LEVEL_ENV = "LOG_LEVEL"
XRAY_TRACE_ID_ENV = "_X_AMZN_TRACE_ID"

#: Lambda's advanced logging control levels, as Python's.
_LAMBDA_LEVELS = {"TRACE": "NOTSET", "DEBUG": "DEBUG", "INFO": "INFO", "WARN": "WARNING",
                  "ERROR": "ERROR", "FATAL": "CRITICAL"}
#: LogRecord attributes that are never written as extra keys.
_RESERVED = frozenset({
    "name", "msg", "args", "level", "levelname", "levelno", "pathname", "filename", "module",
    "exc_info", "exc_text", "stack_info", "lineno", "funcName", "created", "msecs",
    "relativeCreated", "thread", "threadName", "processName", "process", "asctime",
    "location", "timestamp"})
#: First characters of a message that may be JSON text (decoded, as Powertools does).
_JSON_START = frozenset('{["-0123456789tfn')
#: Marks a stdlib logger whose handler this module installed.
_CONFIGURED = "_usage_limits_json"


def log_level(level: str | None = None, env: Mapping[str, str] | None = None) -> str:
    """The effective level name: Lambda's advanced logging controls first, then ``level``,
    then ``POWERTOOLS_LOG_LEVEL``/``LOG_LEVEL``, else INFO.

    Args:
        level: the level asked for (None: from the environment).
        env: the environment (default ``os.environ``).

    Returns:
        A level name ``logging`` knows (``"INFO"``, ``"WARNING"``, ...).
    """
    env = os.environ if env is None else env
    lambda_level = _LAMBDA_LEVELS.get(env.get(LAMBDA_LOG_LEVEL_ENV, ""))
    if lambda_level is not None:
        return lambda_level
    chosen = level or env.get(POWERTOOLS_LOG_LEVEL_ENV) or env.get(LOG_LEVEL_ENV)
    return chosen.upper() if chosen else "INFO"


class _JsonFormatter(logging.Formatter):
    """Formats a record as one line of JSON (see the module's docstring)."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service
        self.keys: dict[str, Any] = {}

    def format(self, record: logging.LogRecord) -> str:
        msecs = "%03d" % record.msecs  # noqa: UP031  (the timestamp's milliseconds)
        line: dict[str, Any] = {
            "level": record.levelname,
            "location": f"{record.funcName}:{record.lineno}",
            "message": _message(record),
            "timestamp": time.strftime(f"%Y-%m-%d %H:%M:%S,{msecs}%z",
                                       time.localtime(record.created)),
            "service": self.service,
        }
        line.update(self.keys)
        for key, value in record.__dict__.items():
            if key not in _RESERVED:
                line[key] = value
        exc_info = record.exc_info
        if isinstance(exc_info, tuple) and hasattr(exc_info[0], "__name__"):
            kind, error, tb = exc_info
            line.setdefault("exception", self.formatException(exc_info))
            line.setdefault("exception_name", kind.__name__)  # type: ignore[union-attr]
            line.setdefault("exception_notes", getattr(error, "__notes__", None))
            line["stack_trace"] = {
                "type": kind.__name__,  # type: ignore[union-attr]
                "value": error,
                "module": error.__class__.__module__,
                "frames": [{"file": fs.filename, "line": fs.lineno, "function": fs.name,
                            "statement": fs.line} for fs in traceback.extract_tb(tb)],
            }
        else:
            line.pop("stack_trace", None)
        trace = os.environ.get(XRAY_TRACE_ID_ENV)
        line["xray_trace_id"] = trace.split(";")[0].replace("Root=", "") if trace else None
        return json.dumps({k: v for k, v in line.items() if v is not None}, default=str,
                          separators=(",", ":"))


def _message(record: logging.LogRecord) -> Any:
    message = record.msg
    if isinstance(message, dict):
        return message
    if record.args:
        return record.getMessage()
    if isinstance(message, str) and message[:1] in _JSON_START:
        try:
            return json.loads(message)
        except ValueError:
            pass
    return message


class _StdoutHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stdout`` is when a line is written (a test may swap it)."""

    @property
    def stream(self) -> Any:
        return sys.stdout

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


class JsonLogger:
    """A structured logger for one service: ``append_keys`` plus the usual level methods.

    Args:
        service: the service name (the ``service`` key, and the stdlib logger's name).
        level: the level (None: from the environment, see ``log_level``).
        stream: where lines go (default: ``sys.stdout``, as it is when each line is written).
    """

    def __init__(self, service: str, level: str | None = None, stream: Any = None) -> None:
        self.service = service
        self._logger = logging.getLogger(service)
        formatter = getattr(self._logger, _CONFIGURED, None)
        if formatter is None:  # first logger of this service in the process
            formatter = _JsonFormatter(service)
            handler = (logging.StreamHandler(stream) if stream is not None
                       else _StdoutHandler())
            handler.setFormatter(formatter)
            self._logger.addHandler(handler)
            self._logger.propagate = False
            setattr(self._logger, _CONFIGURED, formatter)
        self._logger.setLevel(log_level(level))
        self._formatter: _JsonFormatter = formatter

    def append_keys(self, **keys: Any) -> None:
        """Add ``keys`` to every following line (a key set to None is left out of lines)."""
        self._formatter.keys.update(keys)

    def get_current_keys(self) -> dict[str, Any]:
        """The keys appended so far."""
        return self._formatter.keys

    def remove_keys(self, keys: list[str]) -> None:
        """Stop writing ``keys``."""
        for key in keys:
            self._formatter.keys.pop(key, None)

    def isEnabledFor(self, level: int) -> bool:  # noqa: N802  (logging's name)
        """True when a record of ``level`` would be written."""
        return self._logger.isEnabledFor(level)

    def _log(self, level: int, msg: object, args: tuple[object, ...], exc_info: Any,
             extra: Mapping[str, object] | None, kwargs: dict[str, object]) -> None:
        if self._logger.isEnabledFor(level):
            fields = {**extra, **kwargs} if extra else kwargs
            self._logger.log(level, msg, *args, exc_info=exc_info, extra=fields, stacklevel=3)

    def debug(self, msg: object, *args: object, exc_info: Any = None,
              extra: Mapping[str, object] | None = None, **kwargs: object) -> None:
        """Write a DEBUG line (``extra`` and keyword arguments become keys)."""
        self._log(logging.DEBUG, msg, args, exc_info, extra, kwargs)

    def info(self, msg: object, *args: object, exc_info: Any = None,
             extra: Mapping[str, object] | None = None, **kwargs: object) -> None:
        """Write an INFO line (``extra`` and keyword arguments become keys)."""
        self._log(logging.INFO, msg, args, exc_info, extra, kwargs)

    def warning(self, msg: object, *args: object, exc_info: Any = None,
                extra: Mapping[str, object] | None = None, **kwargs: object) -> None:
        """Write a WARNING line (``extra`` and keyword arguments become keys)."""
        self._log(logging.WARNING, msg, args, exc_info, extra, kwargs)

    def error(self, msg: object, *args: object, exc_info: Any = None,
              extra: Mapping[str, object] | None = None, **kwargs: object) -> None:
        """Write an ERROR line (``extra`` and keyword arguments become keys)."""
        self._log(logging.ERROR, msg, args, exc_info, extra, kwargs)

    def exception(self, msg: object, *args: object, exc_info: Any = True,
                  extra: Mapping[str, object] | None = None, **kwargs: object) -> None:
        """Write an ERROR line with the exception being handled."""
        self._log(logging.ERROR, msg, args, exc_info, extra, kwargs)

    def critical(self, msg: object, *args: object, exc_info: Any = None,
                 extra: Mapping[str, object] | None = None, **kwargs: object) -> None:
        """Write a CRITICAL line (``extra`` and keyword arguments become keys)."""
        self._log(logging.CRITICAL, msg, args, exc_info, extra, kwargs)
