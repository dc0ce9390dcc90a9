"""Gateway settings: one frozen dataclass, validated when built."""

from __future__ import annotations

from dataclasses import dataclass

from sluice.errors import ConfigError
from sluice.gateway.cors import parse_origin
from sluice.gateway.hosts import parse_allowed_host

__all__ = ["Settings"]


@dataclass(frozen=True, slots=True)
class Settings:
    """Everything the app needs to know; the CLI builds one from its options."""

    # SSE delivery
    heartbeat_interval_s: float = 15.0
    retry_ms: int = 1000
    max_batch_records: int = 512
    send_timeout_s: float = 30.0
    coalesce: bool = True
    # Stream lifecycle
    default_grace_s: float = 15.0
    retention_s: float = 300.0
    max_streams: int = 100_000
    max_streams_per_tenant: int = 1_000
    max_tokens_per_stream: int = 100_000
    max_stream_s: float = 3600.0
    max_log_records: int = 100_000
    max_log_bytes: int = 16 * 1024 * 1024
    # Input bounds
    max_body_bytes: int = 1024 * 1024
    max_prompt_chars: int = 200_000
    max_interval_ms: float = 60_000.0
    max_tokens_limit: int = 1_000_000
    # Request heads: all header lines (name, value, ": " and CRLF) answer 431 above this,
    # the request target (path and query) 414 (common proxy defaults: nginx 8 KiB lines).
    max_header_bytes: int = 16 * 1024
    max_url_bytes: int = 8 * 1024
    # Which model a request gets when it names none.
    default_model: str = "words"
    # Web origins other than the server's own that may call it (``"*"``: any). ``None``:
    # none while callers without a key are served, any when every caller needs a key
    # (see sluice.gateway.cors).
    cors_allow_origins: tuple[str, ...] | None = None
    # Host names answered besides loopback ones (``".example.com"``: a domain and the
    # names under it; ``"*"``: any). ``None``: loopback names only while callers without
    # a key are served, any when every caller needs a key (see sluice.gateway.hosts).
    allowed_hosts: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        positive = {
            "heartbeat_interval_s": self.heartbeat_interval_s,
            "max_batch_records": self.max_batch_records,
            "max_streams": self.max_streams,
            "max_streams_per_tenant": self.max_streams_per_tenant,
            "max_tokens_per_stream": self.max_tokens_per_stream,
            "max_stream_s": self.max_stream_s,
            "send_timeout_s": self.send_timeout_s,
            "max_log_records": self.max_log_records,
            "max_log_bytes": self.max_log_bytes,
            "max_body_bytes": self.max_body_bytes,
            "max_prompt_chars": self.max_prompt_chars,
            "max_tokens_limit": self.max_tokens_limit,
            "max_header_bytes": self.max_header_bytes,
            "max_url_bytes": self.max_url_bytes,
        }
        for name, value in positive.items():
            if value <= 0:
                raise ConfigError(f"{name} must be positive, got {value!r}")
        non_negative = {
            "retry_ms": self.retry_ms,
            "default_grace_s": self.default_grace_s,
            "retention_s": self.retention_s,
            "max_interval_ms": self.max_interval_ms,
        }
        for name, value in non_negative.items():
            if value < 0:
                raise ConfigError(f"{name} must not be negative, got {value!r}")
        for origin in self.cors_allow_origins or ():
            parse_origin(origin)
        for host in self.allowed_hosts or ():
            parse_allowed_host(host)
