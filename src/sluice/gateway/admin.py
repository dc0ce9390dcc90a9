"""The admin endpoints of model aliases' rollouts, and the dashboard page.

- ``GET /v1/admin/rollouts``: every alias's rollout (state, weights, per-version recent
  latencies and error rates, the evidence, the last decision and its reason, the kept
  decisions); ``{"rollouts": []}`` without ``--models-config``.
- ``POST /v1/admin/rollouts/{alias}`` with ``{"action": "start" | "pause" | "promote" |
  "rollback", "reason": "..."}``: the decision and the rollout after it; an action the
  rollout's state does not allow is a ``409`` naming the state, an unknown alias a ``404``.
- ``GET /dashboard``: the page that plots them (:mod:`sluice.web`); it holds no data, the
  admin endpoints do.

Every decision is counted in the metrics (``sluice_rollout_decisions_total``, and the
weights in ``sluice_rollout_weight_percent``).

Only admins: a key of an ``admin = true`` entry of the auth config, or, when no keys are
configured (anonymous mode), a caller on a loopback address. Anyone else gets a ``403``
(a ``401`` when keys are configured and none was sent).
"""

from __future__ import annotations

import ipaddress
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response

from sluice.errors import BadRequestError, SluiceError
from sluice.gateway.auth import Auth
from sluice.gateway.errors import error_response, response_for
from sluice.gateway.requests import read_json_body
from sluice.observability.metrics import Metrics

if TYPE_CHECKING:  # the rollout package (scipy) loads only with --models-config
    from sluice.rollout.controller import Rollouts
    from sluice.rollout.state import Decision

__all__ = ["AdminApi"]

# An admin body is an action and a short reason.
_MAX_ADMIN_BODY_BYTES = 4096
_MAX_REASON_CHARS = 500


class AdminApi:
    """The rollout endpoints over one :class:`~sluice.rollout.controller.Rollouts`."""

    def __init__(
        self, rollouts: Rollouts | None, auth: Auth, dashboard_html: str, metrics: Metrics
    ) -> None:
        self._rollouts = rollouts
        self._auth = auth
        self._dashboard_html = dashboard_html
        if rollouts is not None:
            _count_decisions(rollouts, metrics)

    def _refusal(self, request: Request) -> Response | None:
        """``None`` for an admin; else the ``401``/``403`` to answer."""
        client = request.scope.get("client")
        loopback = client is not None and _is_loopback(client[0])
        headers = request.scope["headers"]
        if self._auth.is_admin(headers, loopback=loopback):
            return None
        if self._auth.num_keys == 0:
            return error_response(403, "forbidden", "admin endpoints answer loopback callers only")
        try:
            self._auth.caller(headers)  # a wrong key is a 401, as everywhere
        except SluiceError as exc:
            return response_for(exc)
        if not any(name in (b"authorization", b"x-api-key") for name, _ in headers):
            return error_response(401, "invalid_api_key", "admin endpoints need an admin key")
        return error_response(403, "forbidden", "this API key is not an admin key")

    async def rollouts(self, request: Request) -> Response:
        refusal = self._refusal(request)
        if refusal is not None:
            return refusal
        described = [] if self._rollouts is None else self._rollouts.describe()
        return JSONResponse({"rollouts": described}, headers={"Cache-Control": "no-store"})

    async def act(self, request: Request) -> Response:
        refusal = self._refusal(request)
        if refusal is not None:
            return refusal
        alias: str = request.path_params["alias"]
        rollouts = self._rollouts
        if rollouts is None or alias not in rollouts.names:
            return error_response(404, "alias_not_found", f"no model alias {alias[:80]!r}")
        try:
            payload = await read_json_body(request.scope, request.receive, _MAX_ADMIN_BODY_BYTES)
            action, reason = _parse_action(payload)
            decision = rollouts.act(alias, action, reason)
        except SluiceError as exc:
            return response_for(exc)
        body = {"decision": decision.describe(), "rollout": rollouts.get(alias).describe()}
        return JSONResponse(body)

    async def dashboard(self, request: Request) -> Response:
        return HTMLResponse(self._dashboard_html, headers={"Cache-Control": "no-cache"})


def _count_decisions(rollouts: Rollouts, metrics: Metrics) -> None:
    """Every decision becomes metrics; the weight gauges start at the config's."""

    def decided(alias: str, decision: Decision) -> None:
        weights = rollouts.get(alias).weights()
        metrics.rollout_decided(alias, decision.action.value, decision.by, weights)

    for alias in rollouts.names:
        for version, weight in rollouts.get(alias).weights().items():
            metrics.rollout_weight.labels(alias, version).set(weight)
    rollouts.on_decision = decided


def _parse_action(payload: object) -> tuple[str, str]:
    if not isinstance(payload, dict):
        raise BadRequestError('the body must be a JSON object: {"action": "..."}')
    unknown = set(payload) - {"action", "reason"}
    if unknown:
        raise BadRequestError(f"unknown fields: {', '.join(sorted(unknown))}")
    action = payload.get("action")
    reason = payload.get("reason", "")
    if not isinstance(action, str):
        raise BadRequestError("'action' must be one of start, pause, promote, rollback")
    if not isinstance(reason, str) or len(reason) > _MAX_REASON_CHARS:
        raise BadRequestError(f"'reason' must be a string of at most {_MAX_REASON_CHARS} chars")
    return action, reason


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
