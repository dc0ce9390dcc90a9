"""Which ``Host`` names a server answers: its defence against DNS rebinding.

A server that serves callers without a key trusts whoever can connect to it. On loopback
that is any web page its operator opens: a page on a name its author controls re-points the
name at 127.0.0.1 once loaded (DNS rebinding), and the browser then sends the page's
requests here as same-origin ones and lets it read the answers. The browser still names the
page's host in ``Host``, so such a server answers only loopback names.

Decisions:

1. Loopback names are ``localhost`` and every name under it (RFC 6761 section 6.3: they
   are loopback, and browsers never ask DNS for them), IPv4 literals in 127.0.0.0/8 and the
   IPv6 literal ``[::1]`` (RFC 3986 section 3.2.2 brackets), with any port or none,
   case-insensitively, with or without one trailing dot (a fully qualified name).
2. A request without ``Host`` is served: browsers always send one, so its absence is no
   rebinding. A request with several is refused unless every one is allowed.
3. The refusal is ``421 Misdirected Request`` (RFC 9110 section 15.5.20): the server will
   not answer for the authority the request names. ``403`` would say the caller lacks a
   permission, which no key or token could change. EventSource treats it as final.
4. Operators behind a proxy that passes on another ``Host`` add names
   (``--allowed-host``): an exact name or address, ``.example.com`` for that domain and
   every name under it, or ``*`` for any ``Host``.
5. By default the names are restricted only while callers without a key are served
   (:meth:`HostPolicy.by_mode`); with every caller keyed, a rebound page has no key.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from sluice.errors import ConfigError
from sluice.gateway.errors import MisdirectedRequestError
from sluice.transports.asgi import Scope

__all__ = ["ANY_HOST", "HostPolicy", "host_name", "is_loopback_name", "parse_allowed_host"]

ANY_HOST = "*"
_HOST_HEADER = b"host"
_NAME = re.compile(r"\.?[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?(\.[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?)*")
_PORT = re.compile(r"[0-9]{0,5}")


def host_name(value: str) -> str | None:
    """The name or address in a ``Host`` value, lower-cased, without port or trailing dot
    (IPv6 literals keep their brackets); ``None`` for a value that is not an authority."""
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        if end < 0:
            return None
        name, rest = value[: end + 1], value[end + 1 :]
    else:
        name, colon, port = value.partition(":")
        rest = colon + port
    if rest and (not rest.startswith(":") or not _PORT.fullmatch(rest[1:])):
        return None
    if name.endswith(".") and not name.endswith(".."):
        name = name[:-1]
    return name or None


def is_loopback_name(name: str) -> bool:
    """Whether ``name`` (as :func:`host_name` gives it) always means this machine."""
    if name == "localhost" or name.endswith(".localhost"):
        return True
    address = name[1:-1] if name.startswith("[") and name.endswith("]") else name
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    if ip.version == 6 and not name.startswith("["):
        return False  # a bare IPv6 address is not a valid Host
    return ip.is_loopback


def parse_allowed_host(text: str) -> str:
    """An ``--allowed-host`` value, normalised; raises :class:`ConfigError` when it is not
    ``*``, a host name (``.`` first for a domain and the names under it) or an address."""
    if text == ANY_HOST:
        return text
    lowered = text.strip().lower()
    if lowered.endswith(".") and len(lowered) > 1:
        lowered = lowered[:-1]
    if lowered.startswith("[") and lowered.endswith("]"):
        try:
            ipaddress.IPv6Address(lowered[1:-1])
        except ValueError:
            pass
        else:
            return lowered
    elif _NAME.fullmatch(lowered):
        return lowered
    else:
        try:
            return f"[{ipaddress.IPv6Address(lowered)}]"  # unbracketed IPv6: as Host sends it
        except ValueError:
            pass
    raise ConfigError(
        f"allowed host {text[:80]!r}: give a host name (.example.com for a domain and the "
        "names under it), an IP address without port, or '*'"
    )


@dataclass(frozen=True, slots=True)
class HostPolicy:
    """The ``Host`` names a server answers: loopback ones, plus ``names`` and the names
    under ``domains``; or any name when ``any_host``."""

    names: frozenset[str] = frozenset()
    domains: tuple[str, ...] = ()  # each starts with "."
    any_host: bool = False

    @classmethod
    def of(cls, allowed: Iterable[str]) -> HostPolicy:
        """Loopback names and ``allowed`` (``--allowed-host`` values; ``*`` for any)."""
        normalised = [parse_allowed_host(text) for text in allowed]
        if ANY_HOST in normalised:
            return cls(any_host=True)
        names = frozenset(name for name in normalised if not name.startswith("."))
        domains = tuple(name for name in normalised if name.startswith("."))
        return cls(names, domains)

    @classmethod
    def by_mode(cls, allowed: Sequence[str] | None, *, keyless_callers: bool) -> HostPolicy:
        """``allowed`` if given (``Settings.allowed_hosts``); else loopback names only while
        callers without a key are served, and any name when every caller needs one."""
        if allowed is not None:
            return cls.of(allowed)
        return cls() if keyless_callers else cls(any_host=True)

    def allows(self, value: str) -> bool:
        """Whether a request whose ``Host`` is ``value`` is answered."""
        if self.any_host:
            return True
        name = host_name(value)
        if name is None:
            return False
        if is_loopback_name(name) or name in self.names:
            return True
        return any(name.endswith(domain) or name == domain[1:] for domain in self.domains)

    def check(self, scope: Scope) -> None:
        """Raise :class:`MisdirectedRequestError` unless every ``Host`` of the request is
        allowed."""
        if self.any_host:
            return
        for name, value in scope["headers"]:
            if name == _HOST_HEADER and not self.allows(value.decode("latin-1")):
                shown = value.decode("latin-1")[:80]
                raise MisdirectedRequestError(
                    f"this server does not answer for Host {shown!r}: it answers loopback "
                    "names (localhost, 127.0.0.1, [::1]) and those named by --allowed-host"
                )
