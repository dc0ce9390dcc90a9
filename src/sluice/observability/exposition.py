"""The body of ``GET /metrics``: a registry without ``_created`` series, in the format the
scraper asked for.

prometheus-client adds a ``_created`` sample (the Unix time a child was made) to every
counter and histogram child. In the Prometheus text format each becomes a gauge of its
own, which doubles the series and which no dashboard reads; prometheus-client's switch for
it (``disable_created_metrics()``) is process-wide. :class:`Registry` leaves those samples
out of its own collection instead, so one app's choice does not change another's.

The format is negotiated from ``Accept`` by prometheus-client's own rules
(``choose_encoder``): OpenMetrics 1.0 for a scraper that asks for
``application/openmetrics-text`` (with version 1.0.0 or none), the Prometheus text format
(0.0.4) otherwise.

Divergence: prometheus-client's OpenMetrics writer, with the ``underscores`` escaping it
negotiates, keeps the ``:`` of a name such as ``vllm:num_requests_running`` on the
``# TYPE`` line but turns it into ``_`` on the samples (prometheus/client_python#1177,
open), so a parser sees samples of no declared family. Every name here is in the legacy
character set (``[a-zA-Z_:][a-zA-Z0-9_:]*``, checked when a family is made), which no
escaping scheme changes, so the OpenMetrics body is written with no escaping at all
(``allow-utf-8`` leaves legacy names as they are), under the plain OpenMetrics 1.0 type.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import Metric

__all__ = ["OPENMETRICS_CONTENT_TYPE", "Registry", "encode"]

OPENMETRICS_CONTENT_TYPE = "application/openmetrics-text; version=1.0.0; charset=utf-8"
# What picks prometheus-client's OpenMetrics 1.0 writer with no escaping (see above).
_OPENMETRICS_UNESCAPED = "application/openmetrics-text; version=1.0.0; escaping=allow-utf-8"

# Families whose children carry a ``_created`` sample.
_CREATED_TYPES = frozenset({"counter", "histogram", "summary", "gaugehistogram"})


class Registry(CollectorRegistry):
    """A registry whose collection has no ``_created`` samples."""

    def collect(self) -> Iterable[Metric]:
        for metric in super().collect():
            if metric.type in _CREATED_TYPES:
                created = metric.name + "_created"
                # collect() builds its families afresh each time: trimming one is safe.
                metric.samples = [s for s in metric.samples if s.name != created]
            yield metric


def encode(registry: CollectorRegistry, accept: str) -> tuple[bytes, str]:
    """``registry``'s exposition for a request's ``Accept`` header: body, content type."""
    encoder, content_type = choose_encoder(accept)
    if content_type.startswith("application/openmetrics-text"):
        encoder, _ = choose_encoder(_OPENMETRICS_UNESCAPED)
        return encoder(registry), OPENMETRICS_CONTENT_TYPE
    return encoder(registry), content_type
