"""The auth rules in-process: key lists and files, callers in each mode, resume tokens."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from sluice.errors import ConfigError, StreamNotFoundError
from sluice.gateway.auth import (
    ANONYMOUS,
    ApiKey,
    Auth,
    Caller,
    ResumeTokens,
    hash_key,
    load_key_file,
    parse_key_list,
    presented_token,
)
from sluice.gateway.errors import AuthenticationError
from sluice.streams.hub import Stream

SECRET = b"sixteen-or-more-bytes"


def stream(stream_id: str = "str_abc", tenant: str = "a") -> Stream:
    return Stream(id=stream_id, model="words", resumable=True, grace_s=1, created=0, tenant=tenant)


def test_key_list_parses_tenants_and_hashes_keys() -> None:
    keys = parse_key_list(" a:k1 , b:k:2,")
    assert keys == (ApiKey("a", hash_key("k1")), ApiKey("b", hash_key("k:2")))
    for bad in ("a", "a:", ":k", "anonymous:k", "bad tenant:k"):
        with pytest.raises(ConfigError):
            parse_key_list(bad)


def test_key_file_takes_digests_or_environment_variables(tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    digest = hashlib.sha256(b"k1").hexdigest()
    path.write_text(
        f'[[key]]\ntenant = "a"\nkey_sha256 = "{digest}"\n'
        '[[key]]\ntenant = "b"\nkey_env = "KEY_B"\n'
    )
    keys = load_key_file(path, {"KEY_B": "k2"})
    assert keys == (ApiKey("a", hash_key("k1")), ApiKey("b", hash_key("k2")))
    with pytest.raises(ConfigError, match="KEY_B"):
        load_key_file(path, {})
    for body in (
        '[[key]]\ntenant = "a"\n',  # neither
        f'[[key]]\ntenant = "a"\nkey_sha256 = "{digest}"\nkey_env = "X"\n',  # both
        '[[key]]\ntenant = "a"\nkey_sha256 = "beef"\n',  # not a digest
        '[[key]]\ntenant = "a"\nkey = "plaintext"\n',  # unknown field
        "key = 1\n",
        "not toml [",
    ):
        path.write_text(body)
        with pytest.raises(ConfigError):
            load_key_file(path, {"X": "x"})


def test_one_key_for_two_tenants_and_no_keys_without_anonymous_are_refused() -> None:
    tokens = ResumeTokens(SECRET)
    with pytest.raises(ConfigError):
        Auth(parse_key_list("a:k,b:k"), allow_anonymous=False, tokens=tokens)
    with pytest.raises(ConfigError):
        Auth((), allow_anonymous=False, tokens=tokens)


def test_callers_with_keys_configured() -> None:
    auth = Auth(parse_key_list("a:k1,b:k2"), allow_anonymous=False, tokens=ResumeTokens(SECRET))
    assert auth.caller([(b"authorization", b"Bearer k1")]) == Caller("a")
    assert auth.caller([(b"authorization", b"bearer  k2 ")]) == Caller("b")
    assert auth.caller([(b"x-api-key", b"k2")]) == Caller("b")
    assert auth.caller([], "tok") == Caller(None, "tok")  # only the token may open streams
    for headers in ([], [(b"authorization", b"Bearer nope")], [(b"x-api-key", b"nope")]):
        with pytest.raises(AuthenticationError):
            auth.caller(headers)
    with pytest.raises(AuthenticationError):
        auth.caller([(b"authorization", b"Bearer nope")], "tok")


def test_anonymous_modes() -> None:
    tokens = ResumeTokens(SECRET)
    only = Auth((), allow_anonymous=True, tokens=tokens)
    assert only.caller([(b"authorization", b"Bearer anything")]) == Caller(ANONYMOUS)
    mixed = Auth(parse_key_list("a:k1"), allow_anonymous=True, tokens=tokens)
    assert mixed.caller([]) == Caller(ANONYMOUS)
    assert mixed.caller([(b"x-api-key", b"k1")]) == Caller("a")
    with pytest.raises(AuthenticationError):  # a mistyped key is not silently anonymous
        mixed.caller([(b"x-api-key", b"k0")])


def test_access_needs_the_tenant_or_a_valid_token_else_it_is_not_found() -> None:
    tokens = ResumeTokens(SECRET)
    auth = Auth(parse_key_list("a:k1,b:k2"), allow_anonymous=False, tokens=tokens)
    mine = stream()
    assert auth.check(mine, Caller("a")) is mine
    assert auth.check(mine, Caller("b", tokens.mint(mine.id))) is mine
    assert auth.check(mine, Caller(None, tokens.mint(mine.id))) is mine
    for caller in (Caller("b"), Caller(None, tokens.mint("str_other")), Caller(ANONYMOUS)):
        with pytest.raises(StreamNotFoundError) as refused:
            auth.check(mine, caller)
        assert str(refused.value) == str(StreamNotFoundError(mine.id))


def test_tokens_expire_and_bind_stream_secret_and_expiry() -> None:
    tokens = ResumeTokens(SECRET, ttl_s=60)
    token = tokens.mint("str_abc")
    expiry, _, mac = token.partition(".")
    assert tokens.valid(token, "str_abc")
    assert not tokens.valid(token, "str_abd")
    assert not tokens.valid(token, "str_abc", now=int(expiry))  # expired at its expiry
    assert not tokens.valid(f"{int(expiry) + 60}.{mac}", "str_abc")
    assert not ResumeTokens(b"another-secret-of-16").valid(token, "str_abc")
    assert not tokens.valid(tokens.mint("str_abc", expires_at=10**10), "str_abc")  # too far
    for junk in ("", ".", "x.y", "1.", f"{expiry}.", "9" * 100, "é.é", "1.é"):
        assert not tokens.valid(junk, "str_abc")
    with pytest.raises(ConfigError):
        ResumeTokens(b"short")
    for ttl_s in (0, -1, 2 * 24 * 3600):
        with pytest.raises(ConfigError):
            ResumeTokens(SECRET, ttl_s=ttl_s)


def test_the_query_token_wins_over_the_header() -> None:
    headers = [(b"x-sluice-resume-token", b"from-header")]
    assert presented_token(headers, "from-query") == "from-query"
    assert presented_token(headers, None) == "from-header"
    assert presented_token([], "") is None


class _CountingTokens(ResumeTokens):
    """Resume tokens that count the MACs they compute (the work a check costs)."""

    __slots__ = ("num_macs",)

    def __init__(self, secret: bytes) -> None:
        super().__init__(secret)
        self.num_macs = 0

    def _mac(self, stream_id: str, expires: int) -> str:
        self.num_macs += 1
        return super()._mac(stream_id, expires)


def test_an_unknown_id_costs_the_same_checks_as_another_tenants_stream() -> None:
    """With a token, the refusal of an unknown id and of a foreign one both compute the
    token's MAC, so their timing does not say which ids exist."""
    tokens = _CountingTokens(SECRET)
    auth = Auth(parse_key_list("a:k1,b:k2"), allow_anonymous=False, tokens=tokens)
    foreign = stream("str_foreign", tenant="a")
    streams = {foreign.id: foreign}

    def lookup(stream_id: str) -> Stream:
        if stream_id not in streams:
            raise StreamNotFoundError(stream_id)
        return streams[stream_id]

    wrong_token = tokens.mint("str_somewhere_else")
    answers = []
    for stream_id in ("str_foreign", "str_unknown"):
        tokens.num_macs = 0
        with pytest.raises(StreamNotFoundError) as refused:
            auth.find(lookup, stream_id, Caller("b", wrong_token))
        answers.append((tokens.num_macs, str(refused.value).replace(stream_id, "ID")))
    assert answers[0] == answers[1] == (1, str(StreamNotFoundError("ID")))
    # A valid token for an id that no longer exists opens nothing either.
    with pytest.raises(StreamNotFoundError):
        auth.find(lookup, "str_gone", Caller(None, tokens.mint("str_gone")))
    assert auth.find(lookup, "str_foreign", Caller("a")) is foreign
    assert auth.find(lookup, "str_foreign", Caller("b", tokens.mint("str_foreign"))) is foreign


def test_admin_is_an_admin_key_or_a_loopback_caller_without_keys(tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    path.write_text(
        '[[key]]\ntenant = "ops"\nkey_env = "OPS"\nadmin = true\n'
        '[[key]]\ntenant = "team"\nkey_env = "TEAM"\n'
    )
    keys = load_key_file(path, {"OPS": "ops-key", "TEAM": "team-key"})
    assert [key.admin for key in keys] == [True, False]
    auth = Auth(keys, allow_anonymous=True, tokens=ResumeTokens.random())
    assert auth.is_admin([(b"authorization", b"Bearer ops-key")], loopback=False)
    assert not auth.is_admin([(b"authorization", b"Bearer team-key")], loopback=True)
    assert not auth.is_admin([], loopback=True)  # keys configured: loopback is not enough
    anonymous = Auth.anonymous()
    assert anonymous.is_admin([], loopback=True)
    assert not anonymous.is_admin([(b"authorization", b"Bearer anything")], loopback=False)
    path.write_text('[[key]]\ntenant = "ops"\nkey_env = "OPS"\nadmin = "yes"\n')
    with pytest.raises(ConfigError, match="'admin' must be true or false"):
        load_key_file(path, {"OPS": "ops-key"})
