"""The browser-facing rules in-process: Host names, CORS origins, JSON media types."""

from __future__ import annotations

import pytest

from sluice.errors import ConfigError
from sluice.gateway.cors import CorsPolicy, parse_origin
from sluice.gateway.errors import UnsupportedMediaTypeError
from sluice.gateway.hosts import HostPolicy, host_name, parse_allowed_host
from sluice.gateway.requests import check_json_media_type


@pytest.mark.parametrize(
    ("value", "name"),
    [
        ("localhost", "localhost"),
        ("LocalHost:8000", "localhost"),
        ("localhost.:80", "localhost"),
        ("localhost:", "localhost"),
        ("[::1]:8000", "[::1]"),
        ("127.0.0.1", "127.0.0.1"),
        ("a:b", None),
        ("::1", None),
        ("[::1", None),
        ("[::1]x", None),
        ("host:123456", None),
        ("", None),
    ],
)
def test_host_values_are_cut_to_their_name(value: str, name: str | None) -> None:
    assert host_name(value) == name


def test_the_default_policy_answers_only_loopback_names() -> None:
    policy = HostPolicy.by_mode(None, keyless_callers=True)
    for value in (
        "localhost",
        "app.localhost:3",
        "127.0.0.1:80",
        "127.255.0.9",
        "[::1]",
        "[0:0:0:0:0:0:0:1]:8",
    ):
        assert policy.allows(value), value
    for value in (
        "evil.example",
        "localhost.evil",
        "127.0.0.1.nip.io",
        "0.0.0.0",
        "[::]",
        "10.0.0.1",
        "[::ffff:7f00:1]x",
        "localhost:http",
    ):
        assert not policy.allows(value), value
    assert HostPolicy.by_mode(None, keyless_callers=False).allows("evil.example")


def test_allowed_hosts_add_names_and_domains() -> None:
    policy = HostPolicy.of(["Sluice.Example.", ".corp.example", "192.168.1.5", "::2"])
    for value in (
        "sluice.example:443",
        "corp.example",
        "a.b.corp.example",
        "192.168.1.5:80",
        "[::2]",
        "localhost",
    ):
        assert policy.allows(value), value
    for value in ("xsluice.example", "corp.example.evil", "evilcorp.example", "192.168.1.6"):
        assert not policy.allows(value), value
    assert HostPolicy.of(["*"]).allows("anything")
    for bad in ("", "host:80", "http://host", "a/b", "a b", "[::1"):
        with pytest.raises(ConfigError):
            parse_allowed_host(bad)


def test_cors_origins_are_what_browsers_send() -> None:
    assert parse_origin("HTTP://App.Example:3000") == "http://app.example:3000"
    assert parse_origin("http://[::1]:8000") == "http://[::1]:8000"
    for bad in ("app.example", "http://app.example/", "http://app.example/x", "null", ""):
        with pytest.raises(ConfigError):
            parse_origin(bad)
    same_origin = CorsPolicy.by_mode(None, keyless_callers=True)
    assert same_origin.response_headers([(b"origin", b"http://a.example")]) == []
    named = CorsPolicy.of(["http://a.example"])
    headers = dict(named.response_headers([(b"origin", b"http://A.example")]))
    assert headers[b"access-control-allow-origin"] == b"http://A.example"
    assert named.response_headers([(b"origin", b"http://b.example")]) == [(b"vary", b"Origin")]
    keyed = CorsPolicy.by_mode(None, keyless_callers=False)
    assert dict(keyed.response_headers([]))[b"access-control-allow-origin"] == b"*"


@pytest.mark.parametrize(
    "value",
    [
        b"application/json",
        b"APPLICATION/JSON ; charset=UTF-8",
        b'application/json;charset="utf-8"',
        b"application/problem+json",
        b"application/json; foo=bar",
    ],
)
def test_json_media_types_are_accepted(value: bytes) -> None:
    check_json_media_type([(b"content-type", value)])


@pytest.mark.parametrize(
    "value",
    [
        None,
        b"",
        b"text/plain",
        b"text/json",
        b"application/jsonx",
        b"application/x-json",
        b"application/json; charset=utf-16",
        b"multipart/form-data",
        b"json",
    ],
)
def test_other_media_types_are_refused(value: bytes | None) -> None:
    headers = [] if value is None else [(b"content-type", value)]
    with pytest.raises(UnsupportedMediaTypeError):
        check_json_media_type(headers)
