"""Who is calling, and may they touch this stream: API keys, tenants and resume tokens.

- **API keys** map to tenants. Only SHA-256 digests of keys are held; a presented key is
  hashed and compared with every stored digest in constant time (no early exit), so the
  answer's timing says nothing about which digest came close. Keys come from a TOML file
  (:func:`load_key_file`) and/or ``SLUICE_API_KEYS`` (:func:`parse_key_list`).
- **Anonymous mode** (explicit): a caller without a key is tenant ``"anonymous"``. With no
  keys configured at all, presented keys are ignored (SDKs insist on sending one), so every
  caller is ``"anonymous"``. With keys configured, a presented key that matches none is
  refused even in anonymous mode: a mistyped key fails loudly instead of silently becoming
  anonymous.
- **Admin keys**: a key file entry with ``admin = true`` may also use the admin endpoints
  (``/v1/admin/...``, :meth:`Auth.is_admin`). With no keys configured at all (anonymous
  mode), the admin endpoints answer loopback callers only.
- **Resume tokens** are capabilities for one stream: ``<expiry>.<mac>``, where ``mac`` is
  HMAC-SHA256 (server secret) over the stream id and the expiry (unix seconds). They travel
  in URLs (``?token=``) because EventSource cannot set headers; they carry no tenant and
  grant read, cancel, drop and describe of that one stream until they expire.

A stream that the caller may not touch is answered exactly like a stream that does not
exist (:class:`~sluice.errors.StreamNotFoundError`), so ids of other tenants' streams
cannot be probed: :meth:`Auth.find` does the same work for an unknown id as for another
tenant's (the tenant comparison and the token's MAC), so the time of the answer does not
tell them apart either.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import secrets
import time
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from sluice.errors import ConfigError, StreamNotFoundError
from sluice.gateway.errors import AuthenticationError
from sluice.streams.hub import Stream

__all__ = [
    "ANONYMOUS",
    "DEFAULT_TOKEN_TTL_S",
    "MAX_TOKEN_TTL_S",
    "MIN_SECRET_BYTES",
    "RESUME_TOKEN_HEADER",
    "TOKEN_PARAM",
    "ApiKey",
    "Auth",
    "Caller",
    "ResumeTokens",
    "hash_key",
    "load_key_file",
    "parse_key_list",
    "presented_token",
]

ANONYMOUS = "anonymous"
# Where a resume token is presented: the query (EventSource cannot set headers) or a header.
TOKEN_PARAM = "token"
RESUME_TOKEN_HEADER = "X-Sluice-Resume-Token"
_RESUME_TOKEN_HEADER_BYTES = RESUME_TOKEN_HEADER.lower().encode("ascii")
# A resume token outlives a typical stream and its reconnects, but not a working day.
DEFAULT_TOKEN_TTL_S = 3600.0
MAX_TOKEN_TTL_S = 24 * 3600.0
# HMAC-SHA256 keys shorter than this are guessable; 32 random bytes are made when none is set.
MIN_SECRET_BYTES = 16
# Longer tokens are not ours: refused before any work (an expiry of 12 digits, a 43-char MAC).
_MAX_TOKEN_CHARS = 64
_TENANT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}")
_SHA256_HEX = re.compile(r"[0-9a-fA-F]{64}")
_TOKEN_CONTEXT = b"sluice-resume-token-v1"


def hash_key(key: str) -> bytes:
    """The SHA-256 digest under which an API key is stored."""
    return hashlib.sha256(key.encode("utf-8")).digest()


@dataclass(frozen=True, slots=True)
class ApiKey:
    """One API key, by digest, and the tenant it belongs to."""

    tenant: str
    key_sha256: bytes
    admin: bool = False  # may use the admin endpoints

    def __post_init__(self) -> None:
        if not _TENANT.fullmatch(self.tenant):
            raise ConfigError(
                f"tenant {self.tenant[:80]!r}: 1-64 characters of letters, digits, '._@-', "
                "starting with a letter or digit"
            )
        if self.tenant == ANONYMOUS:
            raise ConfigError(f"tenant {ANONYMOUS!r} is reserved for callers without a key")
        if len(self.key_sha256) != hashlib.sha256().digest_size:
            raise ConfigError(f"tenant {self.tenant!r}: key digest is not SHA-256")


def parse_key_list(text: str) -> tuple[ApiKey, ...]:
    """``SLUICE_API_KEYS``: ``tenant1:key1,tenant2:key2`` (whitespace around items ignored)."""
    keys = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        tenant, sep, key = item.partition(":")
        if not sep or not key:
            raise ConfigError(f"API key list: expected 'tenant:key', got {tenant[:40]!r}...")
        keys.append(ApiKey(tenant.strip(), hash_key(key)))
    return tuple(keys)


def load_key_file(path: Path, environ: Mapping[str, str]) -> tuple[ApiKey, ...]:
    """A TOML file of ``[[key]]`` tables: ``tenant`` and one of ``key_sha256`` (hex digest of
    the key) or ``key_env`` (the name of an environment variable holding the key); and
    ``admin = true`` for a key that may use the admin endpoints."""
    try:
        with path.open("rb") as file:
            document = tomllib.load(file)
    except OSError as exc:
        raise ConfigError(f"{path}: {exc.strerror or exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not TOML: {exc}") from exc
    tables = document.get("key", [])
    if not isinstance(tables, list):
        raise ConfigError(f"{path}: 'key' must be an array of tables ([[key]])")
    keys = []
    for number, table in enumerate(tables, start=1):
        where = f"{path}: key {number}"
        if not isinstance(table, dict):
            raise ConfigError(f"{where}: not a table")
        unknown = set(table) - {"tenant", "key_sha256", "key_env", "admin"}
        if unknown:
            raise ConfigError(f"{where}: unknown fields {', '.join(sorted(unknown))}")
        tenant = table.get("tenant")
        if not isinstance(tenant, str):
            raise ConfigError(f"{where}: 'tenant' (a string) is required")
        digest_hex, env_name = table.get("key_sha256"), table.get("key_env")
        if (digest_hex is None) == (env_name is None):
            raise ConfigError(f"{where}: give exactly one of 'key_sha256' and 'key_env'")
        if digest_hex is not None:
            if not isinstance(digest_hex, str) or not _SHA256_HEX.fullmatch(digest_hex):
                raise ConfigError(f"{where}: 'key_sha256' must be 64 hex digits")
            digest = bytes.fromhex(digest_hex)
        else:
            if not isinstance(env_name, str):
                raise ConfigError(f"{where}: 'key_env' must be a string")
            key = environ.get(env_name)
            if not key:
                raise ConfigError(f"{where}: environment variable {env_name} is unset or empty")
            digest = hash_key(key)
        admin = table.get("admin", False)
        if not isinstance(admin, bool):
            raise ConfigError(f"{where}: 'admin' must be true or false")
        keys.append(ApiKey(tenant, digest, admin))
    return tuple(keys)


class ResumeTokens:
    """Mints and checks resume tokens: ``<expiry>.<base64url HMAC-SHA256>``."""

    __slots__ = ("_secret", "ttl_s")

    def __init__(self, secret: bytes, ttl_s: float = DEFAULT_TOKEN_TTL_S) -> None:
        if len(secret) < MIN_SECRET_BYTES:
            raise ConfigError(f"token secret: at least {MIN_SECRET_BYTES} bytes, got {len(secret)}")
        if not 0 < ttl_s <= MAX_TOKEN_TTL_S:
            raise ConfigError(f"token TTL must be in (0, {MAX_TOKEN_TTL_S:g}] s, got {ttl_s:g}")
        self._secret = secret
        self.ttl_s = ttl_s

    @classmethod
    def random(cls, ttl_s: float = DEFAULT_TOKEN_TTL_S) -> ResumeTokens:
        """Tokens under a fresh secret: valid only for this process's lifetime."""
        return cls(secrets.token_bytes(32), ttl_s)

    def _mac(self, stream_id: str, expires: int) -> str:
        message = b"\0".join((_TOKEN_CONTEXT, stream_id.encode("ascii"), b"%d" % expires))
        digest = hmac.digest(self._secret, message, "sha256")
        return base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")

    def mint(self, stream_id: str, *, expires_at: float | None = None) -> str:
        """A token for ``stream_id``, expiring ``ttl_s`` from now (or at ``expires_at``)."""
        expires = int(time.time() + self.ttl_s if expires_at is None else expires_at)
        return f"{expires}.{self._mac(stream_id, expires)}"

    def valid(self, token: str, stream_id: str, *, now: float | None = None) -> bool:
        """Whether ``token`` grants access to ``stream_id`` now."""
        if len(token) > _MAX_TOKEN_CHARS or not token.isascii() or not stream_id.isascii():
            return False
        expiry_text, dot, mac = token.partition(".")
        if not dot or not expiry_text.isdigit() or len(expiry_text) > 12:
            return False
        expires = int(expiry_text)
        if not hmac.compare_digest(mac, self._mac(stream_id, expires)):
            return False
        now = time.time() if now is None else now
        # Bounded both ways: a token minted under a longer TTL (or a clock far ahead) is out.
        return now < expires <= now + MAX_TOKEN_TTL_S + 60


@dataclass(frozen=True, slots=True)
class Caller:
    """Who a request comes from: a tenant (``None``: no key, so only ``token`` may open a
    stream) and the resume token it presented, if any."""

    tenant: str | None
    token: str | None = None


class Auth:
    """The server's keys, anonymous mode and resume tokens; one per app."""

    __slots__ = ("_admin_digests", "_digests", "_tenants", "allow_anonymous", "tokens")

    def __init__(
        self, keys: Sequence[ApiKey], *, allow_anonymous: bool, tokens: ResumeTokens
    ) -> None:
        seen: dict[bytes, str] = {}
        for key in keys:
            if seen.setdefault(key.key_sha256, key.tenant) != key.tenant:
                raise ConfigError(
                    f"one API key is given to tenants {seen[key.key_sha256]!r} and {key.tenant!r}"
                )
        if not keys and not allow_anonymous:
            raise ConfigError(
                "no API keys configured and anonymous access is off: nobody could use this server"
            )
        self._digests = tuple(seen)
        self._tenants = tuple(seen.values())
        self._admin_digests = tuple(key.key_sha256 for key in keys if key.admin)
        self.allow_anonymous = allow_anonymous
        self.tokens = tokens

    @classmethod
    def anonymous(cls) -> Auth:
        """No keys: every caller is tenant ``"anonymous"`` (what tests and demos run)."""
        return cls((), allow_anonymous=True, tokens=ResumeTokens.random())

    @property
    def num_keys(self) -> int:
        return len(self._digests)

    def _tenant_for(self, key: str) -> str | None:
        digest = hash_key(key)
        found: str | None = None
        for stored, tenant in zip(self._digests, self._tenants, strict=True):
            if hmac.compare_digest(stored, digest):  # every digest is compared: no early exit
                found = tenant
        return found

    def caller(self, headers: Sequence[tuple[bytes, bytes]], token: str | None = None) -> Caller:
        """The caller of a request with these (lower-cased ASGI) headers.

        The key is ``Authorization: Bearer <key>`` or, as Anthropic clients send it,
        ``x-api-key: <key>``. Raises :class:`AuthenticationError` for a key that matches
        none, and for no key at all unless anonymous mode is on or ``token`` is given.
        """
        key = _presented_key(headers)
        if not self._digests:
            return Caller(ANONYMOUS, token)  # anonymous-only: keys are ignored
        if key is not None:
            tenant = self._tenant_for(key)
            if tenant is None:
                raise AuthenticationError("invalid API key")
            return Caller(tenant, token)
        if self.allow_anonymous:
            return Caller(ANONYMOUS, token)
        if token is not None:
            return Caller(None, token)
        raise AuthenticationError(
            "missing API key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')"
        )

    def is_admin(self, headers: Sequence[tuple[bytes, bytes]], *, loopback: bool) -> bool:
        """Whether a request may use the admin endpoints: it presents an ``admin = true``
        key, or no keys are configured and it comes from a ``loopback`` address."""
        if not self._digests:
            return loopback
        key = _presented_key(headers)
        if key is None:
            return False
        digest = hash_key(key)
        found = False
        for stored in self._admin_digests:  # every digest is compared: no early exit
            found |= hmac.compare_digest(stored, digest)
        return found

    def creator(self, headers: Sequence[tuple[bytes, bytes]]) -> str:
        """The tenant a new stream belongs to (a token does not let anyone create)."""
        tenant = self.caller(headers).tenant
        if tenant is None:  # pragma: no cover - caller() raises without a key or a token
            raise AuthenticationError("missing API key")
        return tenant

    def check(self, stream: Stream, caller: Caller) -> Stream:
        """``stream`` if ``caller`` may touch it; else the very error an unknown id gets."""
        if self._grants(stream.id, stream.tenant, caller):
            return stream
        raise StreamNotFoundError(stream.id)

    def find(self, lookup: Callable[[str], Stream], stream_id: str, caller: Caller) -> Stream:
        """The stream ``lookup`` (raising :class:`StreamNotFoundError`) gives for
        ``stream_id``, if ``caller`` may touch it.

        An unknown id is checked as though it belonged to nobody (``caller``'s tenant and
        token are compared all the same), so it is refused after the same work as another
        tenant's stream: only the stream's existence differs, and it is not observable.
        """
        try:
            stream = lookup(stream_id)
        except StreamNotFoundError:
            self._grants(stream_id, None, caller)  # the work a foreign stream costs
            raise
        return self.check(stream, caller)

    def _grants(self, stream_id: str, owner: str | None, caller: Caller) -> bool:
        """Whether ``caller`` may touch the stream ``stream_id`` of tenant ``owner``
        (``None``: an unknown stream, which nobody may touch)."""
        known = owner is not None
        tenant = caller.tenant
        if tenant is not None and hmac.compare_digest(tenant, owner or tenant) and known:
            return True
        token = caller.token
        return token is not None and self.tokens.valid(token, stream_id) and known


def _presented_key(headers: Sequence[tuple[bytes, bytes]]) -> str | None:
    api_key: str | None = None
    for name, value in headers:
        if name == b"authorization":
            scheme, _, credentials = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer" and credentials.strip():
                return credentials.strip()
        elif name == b"x-api-key" and value.strip():
            api_key = value.decode("latin-1").strip()
    return api_key


def presented_token(headers: Sequence[tuple[bytes, bytes]], query_token: str | None) -> str | None:
    """The resume token of a request: ``?token=`` first, then the header."""
    if query_token:
        return query_token
    for name, value in headers:
        if name == _RESUME_TOKEN_HEADER_BYTES and value:
            return value.decode("latin-1")
    return None
