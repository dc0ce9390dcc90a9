"""Logging for ``sluice serve``: text or JSON lines, uvicorn's loggers included.

``--log-format json`` writes one JSON object per line to stderr, for log shippers:

- every record: ``ts`` (UTC, ISO 8601 with milliseconds), ``level``, ``logger``,
  ``message``, and ``exc_info`` (the formatted traceback) when there is one;
- records about a stream carry ``stream_id``, ``model`` and ``tenant`` (passed as
  ``extra=``);
- the stream log (logger ``sluice.stream``, one line when a stream ends, see
  :func:`log_stream_end`) adds ``outcome``, ``tokens`` and ``e2e_s``;
- uvicorn's access log (``uvicorn.access``) adds ``client``, ``method``, ``path``,
  ``http_version`` and ``status``, taken from its record's arguments.

The access log and the stream log are both on with ``--access-log`` and off by default
(a line per request or stream costs CPU under load). Only the standard library's
``logging`` is used. :func:`configure_logging` sets up the process and returns the
``dictConfig`` that uvicorn applies at start-up: in JSON, its loggers and ours share one
handler and format; in text, uvicorn keeps its own (access lines on stdout).
"""

from __future__ import annotations

import datetime
import json
import logging
import logging.config
from typing import Any

from uvicorn.config import LOGGING_CONFIG

from sluice.streams.hub import Stream

__all__ = [
    "LOG_FORMATS",
    "STREAM_LOGGER",
    "JsonFormatter",
    "configure_logging",
    "log_stream_end",
]

LOG_FORMATS = ("text", "json")
STREAM_LOGGER = "sluice.stream"
_TEXT_FORMAT = "%(levelname)s %(name)s: %(message)s"
# ``extra=`` fields copied into a JSON line when a record carries them.
_EXTRA_FIELDS = ("stream_id", "model", "tenant", "outcome", "tokens", "e2e_s")
# The arguments of uvicorn's access log call: '%s - "%s %s HTTP/%s" %d'.
_ACCESS_FIELDS = ("client", "method", "path", "http_version", "status")


class JsonFormatter(logging.Formatter):
    """Formats a record as one line of JSON (see the module docstring for the fields)."""

    def format(self, record: logging.LogRecord) -> str:
        ts = datetime.datetime.fromtimestamp(record.created, datetime.UTC)
        line: dict[str, Any] = {
            "ts": ts.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = record.__dict__
        for name in _EXTRA_FIELDS:
            if name in fields:
                line[name] = fields[name]
        args = record.args
        is_access = record.name == "uvicorn.access"
        if is_access and isinstance(args, tuple) and len(args) == len(_ACCESS_FIELDS):
            line.update(zip(_ACCESS_FIELDS, args, strict=True))
        if record.exc_info:
            line["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False, default=str)


def configure_logging(log_format: str, level: str, *, access_log: bool) -> dict[str, Any]:
    """Set up logging for ``sluice serve`` now and return uvicorn's ``log_config``.

    ``json``: every logger (uvicorn's too) writes JSON lines to stderr. ``text``: ours as
    ``LEVEL logger: message`` on stderr, uvicorn's in its own format. The stream log is on
    only with ``access_log`` (uvicorn silences its access log by itself without it).
    """
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log_format must be one of {LOG_FORMATS}, got {log_format!r}")
    level = level.upper()
    stream_level = level if access_log else max(logging.WARNING, logging.getLevelName(level))
    if log_format == "text":
        logging.basicConfig(level=level, format=_TEXT_FORMAT)
        logging.getLogger(STREAM_LOGGER).setLevel(stream_level)
        return LOGGING_CONFIG
    config: dict[str, Any] = {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"json": {"()": JsonFormatter}},
        "handlers": {
            "stderr": {
                "class": "logging.StreamHandler",
                "formatter": "json",
                "stream": "ext://sys.stderr",
            }
        },
        "root": {"handlers": ["stderr"], "level": level},
        "loggers": {
            # uvicorn's loggers propagate to the root's handler, in the same format.
            "uvicorn": {"handlers": [], "level": level, "propagate": True},
            "uvicorn.error": {"level": level, "propagate": True},
            "uvicorn.access": {"handlers": [], "level": level, "propagate": True},
            STREAM_LOGGER: {"level": stream_level},
        },
    }
    logging.config.dictConfig(config)
    return config


def log_stream_end(stream: Stream, outcome: str, e2e_s: float) -> None:
    """The stream log's line for a stream that ended (at INFO, on ``sluice.stream``)."""
    logger = logging.getLogger(STREAM_LOGGER)
    if logger.isEnabledFor(logging.INFO):
        logger.info(
            "stream %s ended: %s, %d tokens, %.3f s",
            stream.id,
            outcome,
            stream.num_tokens,
            e2e_s,
            extra={
                "stream_id": stream.id,
                "model": stream.model,
                "tenant": stream.tenant,
                "outcome": outcome,
                "tokens": stream.num_tokens,
                "e2e_s": round(e2e_s, 6),
            },
        )
