"""Gateway settings: one frozen dataclass, validated when built."""

from __future__ import annotations

from dataclasses import dataclass, field

from sluice.dialects.base import RequestLimits
from sluice.errors import ConfigError
from sluice.gateway.cors import parse_origin
from sluice.gateway.hosts import parse_allowed_host
from sluice.streams.hub import HubSettings
from sluice.streams.log import LogLimits
from sluice.streams.shared import SharedStreams
from sluice.transports.delivery import DeliveryOptions
from sluice.transports.durable import DurableOptions
from sluice.transports.http1.opener import Http1Limits
from sluice.transports.http2 import Http2Options

__all__ = [
    "DEFAULT_MAX_RETAINED_STREAMS_PER_TENANT",
    "DEFAULT_MAX_STREAMS_PER_TENANT",
    "DEFAULT_TENANT_LOG_SHARE",
    "Settings",
]

# Per-tenant defaults when API keys are configured (several tenants share the server). A
# server without keys has one tenant, ``anonymous``, whose limits default to the server's.
# Live streams one tenant may hold (each may pin a model slot).
DEFAULT_MAX_STREAMS_PER_TENANT = 1_000
# Finished streams one tenant keeps readable (a tiny one holds a few KiB).
DEFAULT_MAX_RETAINED_STREAMS_PER_TENANT = 10_000
# One tenant's event logs may hold 1/this of the log memory budget: room for three more.
DEFAULT_TENANT_LOG_SHARE = 4


@dataclass(frozen=True, slots=True)
class Settings:
    """Everything the app needs to know; the CLI builds one from its options.

    Each layer's options are that layer's own frozen dataclass, held here as they are:
    delivery (:class:`~sluice.transports.delivery.DeliveryOptions`), one stream's log
    (:class:`~sluice.streams.log.LogLimits`), request bodies
    (:class:`~sluice.dialects.base.RequestLimits`) and HTTP/1.1 heads, bodies and deadlines
    (:class:`~sluice.transports.http1.opener.Http1Limits`). The hub's limits are fields of
    their own, because their per-tenant defaults depend on whether API keys are configured
    (:meth:`hub_settings` resolves them).
    """

    # SSE delivery: heartbeats, retry, batching of lagging readers, send timeout.
    delivery: DeliveryOptions = field(default_factory=DeliveryOptions)
    # One stream's log (records and bytes).
    log: LogLimits = field(default_factory=LogLimits)
    # Streams kept in a Redis shared by several replicas (``--redis``); None: in memory.
    shared: SharedStreams | None = None
    # Request bodies: prompt characters, max_tokens, interval_ms, the default model.
    requests: RequestLimits = field(default_factory=RequestLimits)
    # Request heads: all header lines (name, value, ": " and CRLF) answer 431 above
    # max_header_bytes, the request target (path and query) 414 above max_url_bytes (common
    # proxy defaults: nginx 8 KiB lines). A request head must arrive within head_timeout_s of
    # the connection (or, kept alive, of its first byte), its body within body_timeout_s of
    # the head; else 408 and close. A real client sends its head in one write right after
    # connecting, so 10 s covers slow links and loaded clients (Go's servers commonly use
    # ReadHeaderTimeout 10 s) while an idle or slowloris socket holds its descriptor 10 s at
    # most. Bodies are at most max_body_bytes (1 MiB): 30 s asks 35 KB/s of the largest one,
    # a few KB/s of a typical request (see sluice.transports.http1.deadline).
    http: Http1Limits = field(default_factory=Http1Limits)
    # The Durable Streams protocol under /v1/ds/: long-poll hold, SSE connection length.
    durable: DurableOptions = field(default_factory=DurableOptions)
    # Stream lifecycle
    default_grace_s: float = 15.0
    retention_s: float = 300.0
    # Live streams; retained (finished) ones are evicted to make room, never block one.
    max_streams: int = 100_000
    # None: DEFAULT_MAX_STREAMS_PER_TENANT with API keys, max_streams without.
    max_streams_per_tenant: int | None = None
    max_tokens_per_stream: int = 100_000
    max_stream_s: float = 3600.0
    # Every stream's log, live and retained (see sluice.streams.hub.HubSettings).
    log_budget_bytes: int = 1024 * 1024 * 1024
    # None: 1/DEFAULT_TENANT_LOG_SHARE of log_budget_bytes with API keys, all of it without.
    max_log_bytes_per_tenant: int | None = None
    # None: DEFAULT_MAX_RETAINED_STREAMS_PER_TENANT with API keys, max_streams without.
    max_retained_streams_per_tenant: int | None = None
    # Web origins other than the server's own that may call it (``"*"``: any). ``None``:
    # none while callers without a key are served, any when every caller needs a key
    # (see sluice.gateway.cors).
    cors_allow_origins: tuple[str, ...] | None = None
    # Host names answered besides loopback ones (``".example.com"``: a domain and the
    # names under it; ``"*"``: any). ``None``: loopback names only while callers without
    # a key are served, any when every caller needs a key (see sluice.gateway.hosts).
    allowed_hosts: tuple[str, ...] | None = None
    # The gRPC front (sluice.grpc_api.server): served on grpc_host:grpc_port for the app's
    # lifespan when grpc_port is set (0: a free port, logged).
    grpc_port: int | None = None
    grpc_host: str = "127.0.0.1"
    # The HTTP/2 listener beside the HTTP/1.1 one (sluice.transports.http2), if any.
    http2: Http2Options | None = None

    def __post_init__(self) -> None:
        if self.grpc_port is not None and not 0 <= self.grpc_port <= 65535:
            raise ConfigError(f"grpc_port must be a TCP port (0-65535), got {self.grpc_port}")
        positive = {
            "max_streams": self.max_streams,
            "max_streams_per_tenant": _or(self.max_streams_per_tenant, 1),
            "max_tokens_per_stream": self.max_tokens_per_stream,
            "max_stream_s": self.max_stream_s,
            "log_budget_bytes": self.log_budget_bytes,
            "max_log_bytes_per_tenant": _or(self.max_log_bytes_per_tenant, 1),
            "max_retained_streams_per_tenant": _or(self.max_retained_streams_per_tenant, 1),
        }
        for name, value in positive.items():
            if value <= 0:
                raise ConfigError(f"{name} must be positive, got {value!r}")
        non_negative = {
            "default_grace_s": self.default_grace_s,
            "retention_s": self.retention_s,
        }
        for name, value in non_negative.items():
            if value < 0:
                raise ConfigError(f"{name} must not be negative, got {value!r}")
        for origin in self.cors_allow_origins or ():
            parse_origin(origin)
        for host in self.allowed_hosts or ():
            parse_allowed_host(host)

    @property
    def request_limits(self) -> RequestLimits:
        """What request bodies are checked against while they are parsed."""
        return self.requests

    @property
    def log_limits(self) -> LogLimits:
        """One stream's log's bounds."""
        return self.log

    def hub_settings(self, *, multi_tenant: bool) -> HubSettings:
        """The hub's limits; ``multi_tenant`` (API keys are configured) picks the per-tenant
        defaults, else the one tenant gets the server's."""
        if multi_tenant:
            live = DEFAULT_MAX_STREAMS_PER_TENANT
            retained = DEFAULT_MAX_RETAINED_STREAMS_PER_TENANT
            log_bytes = self.log_budget_bytes // DEFAULT_TENANT_LOG_SHARE
        else:
            live = retained = self.max_streams
            log_bytes = self.log_budget_bytes
        return HubSettings(
            default_grace_s=self.default_grace_s,
            retention_s=self.retention_s,
            max_streams=self.max_streams,
            max_streams_per_tenant=_or(self.max_streams_per_tenant, live),
            max_tokens_per_stream=self.max_tokens_per_stream,
            max_stream_s=self.max_stream_s,
            log_budget_bytes=self.log_budget_bytes,
            max_log_bytes_per_tenant=_or(self.max_log_bytes_per_tenant, log_bytes),
            max_retained_per_tenant=_or(self.max_retained_streams_per_tenant, retained),
        )


def _or(value: int | None, default: int) -> int:
    """``value``, or ``default`` where it was left unset."""
    return default if value is None else value
