"""Which requests the native HTTP/1.1 path answers itself (``sluice serve``'s fast path):
every SSE read and every registered dialect's ``POST``, so a dialect added to the registry
is on the fast path with no edit to the gateway or the transport."""

from __future__ import annotations

import pytest

from sluice.dialects.base import ApiDialect
from sluice.dialects.registry import API_DIALECTS
from sluice.gateway.app import create_app


@pytest.mark.parametrize("speaker", API_DIALECTS, ids=lambda d: d.name)
def test_every_registered_dialects_post_is_answered_on_the_native_path(
    speaker: ApiDialect,
) -> None:
    opener = create_app().opener
    path = speaker.path
    route = opener.route("POST", path)
    assert route is not None
    assert route.takes_body
    assert opener.route("GET", path) is None  # the ASGI app answers its 405


def test_the_sse_reads_are_answered_on_the_native_path_and_nothing_else_is() -> None:
    opener = create_app().opener
    for path in ("/v1/streams/str_abc/events", "/v1/demo/words"):
        route = opener.route("GET", path)
        assert route is not None
        assert not route.takes_body
    for method, path in [("POST", "/v1/streams"), ("GET", "/v1/models"), ("GET", "/")]:
        assert opener.route(method, path) is None
