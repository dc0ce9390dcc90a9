"""A model alias as a backend: each stream goes to a version, and says how it went.

:class:`AliasBackend` is registered in the hub under the alias's public name, so the
hub's one model lookup resolves an alias like any served model, and every transport and
dialect serves it unchanged. Its ``generate`` asks :class:`~sluice.rollout.controller.Rollouts`
which version the request's routing key goes to and wraps that version's generation in a
:class:`RoutedGeneration`, which

- names the version (``model_version``: the ``X-Sluice-Model-Version`` header, OpenAI's
  ``system_fingerprint``, the metrics' ``model_version`` label read it);
- reports one :class:`~sluice.rollout.analysis.Outcome` when the stream ends: failed (the
  backend raised), cancelled (aborted before its end: the client cancelled or left, or the
  server stopped it), or finished, with its time to first token (from ``generate``, which
  the hub calls as it creates the stream) and its mean gap between token deltas.

A stream the backend refused at ``start()`` for capacity, or for a bad request, is not an
outcome of the version: it is not reported. A resumed stream is the same stream, on the
version that started it. Clients see only the public name: the hub's ``Started`` event
and every dialect carry the stream's model, the alias.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Mapping

from sluice.backends.base import Backend, Delta, Generation, GenerationRequest
from sluice.backends.words import WordsBackend
from sluice.errors import BadRequestError, CapacityError, ConfigError
from sluice.events import Usage
from sluice.rollout.analysis import Outcome
from sluice.rollout.config import ModelsConfig
from sluice.rollout.controller import Rollouts

__all__ = ["AliasBackend", "RoutedGeneration", "alias_backends"]

_WORDS = "words"


class RoutedGeneration:
    """One version's generation, timed and reported once (see the module doc)."""

    __slots__ = (
        "_created",
        "_first_s",
        "_inner",
        "_last_s",
        "_num_gaps",
        "_report",
        "_reported",
        "canary",
        "model_version",
    )

    def __init__(
        self,
        inner: Generation,
        version: str,
        *,
        canary: bool,
        report: Callable[[Outcome], None],
    ) -> None:
        self._inner = inner
        self.model_version = version
        self.canary = canary
        self._report = report
        self._reported = False
        self._created = time.monotonic()
        self._first_s: float | None = None  # since creation
        self._last_s = 0.0
        self._num_gaps = 0

    async def start(self) -> None:
        try:
            await self._inner.start()
        except (CapacityError, BadRequestError):
            self._reported = True  # a refusal, not an outcome of this version
            raise
        except Exception:
            self._end(failed=True)
            raise

    def __aiter__(self) -> AsyncIterator[Delta]:
        return self._run()

    async def _run(self) -> AsyncIterator[Delta]:
        try:
            async for delta in self._inner:
                if delta.events:
                    now = time.monotonic() - self._created
                    if self._first_s is None:
                        self._first_s = now
                    else:
                        self._num_gaps += 1
                    self._last_s = now
                yield delta
        except Exception:
            self._end(failed=True)
            raise
        self._end()

    async def abort(self) -> None:
        self._end(cancelled=True)  # a no-op after the end was reported
        await self._inner.abort()

    def usage(self) -> Usage:
        return self._inner.usage()

    def _end(self, *, failed: bool = False, cancelled: bool = False) -> None:
        if self._reported:
            return
        self._reported = True
        first = self._first_s
        itl = (
            (self._last_s - first) / self._num_gaps
            if first is not None and self._num_gaps
            else None
        )
        self._report(Outcome(self.canary, failed, cancelled, first, itl))


class AliasBackend:
    """Serves a model alias by routing each stream to one of its versions' backends."""

    def __init__(self, alias: str, versions: Mapping[str, Backend], rollouts: Rollouts) -> None:
        self._alias = alias
        self._versions = dict(versions)
        self._rollouts = rollouts
        rollout = rollouts.get(alias)
        self._canary = None if rollout.alias.canary is None else rollout.alias.canary.name

    @property
    def model(self) -> str:
        return self._alias

    def generate(self, request: GenerationRequest) -> RoutedGeneration:
        version = self._rollouts.choose(self._alias, request.routing_key)
        inner = self._versions[version.name].generate(request)
        return RoutedGeneration(
            inner,
            version.name,
            canary=version.name == self._canary,
            report=self._observe,
        )

    def _observe(self, outcome: Outcome) -> None:
        self._rollouts.observe(self._alias, outcome)

    async def aclose(self) -> None:
        """Nothing of its own to close: served models are closed by the hub, and a
        version's ``words`` backend holds nothing."""


def alias_backends(
    config: ModelsConfig, served: Mapping[str, Backend], rollouts: Rollouts
) -> dict[str, AliasBackend]:
    """A backend per alias of ``config``, over the ``served`` backends its versions name.

    A version of model ``words`` gets a :class:`~sluice.backends.words.WordsBackend` of its
    own (with its fault options); any other model must be served. Raises
    :class:`~sluice.errors.ConfigError` for an alias named like a served model, or a
    version whose model is not served.
    """
    aliases: dict[str, AliasBackend] = {}
    for alias in config.aliases:
        if alias.name in served or alias.name == _WORDS:
            raise ConfigError(f"alias {alias.name!r} has the name of a served model")
        versions: dict[str, Backend] = {}
        for version in alias.versions:
            if version.model == _WORDS:
                versions[version.name] = WordsBackend(
                    alias.name,
                    fault_error_rate=version.fault_error_rate,
                    fault_latency_ms=version.fault_latency_ms,
                    interval_ms=version.interval_ms,
                )
            elif version.model in served:
                versions[version.name] = served[version.model]
            else:
                known = ", ".join([*served, _WORDS])
                raise ConfigError(
                    f"alias {alias.name!r}, version {version.name!r}: model "
                    f"{version.model!r} is not served; served: {known}"
                )
        aliases[alias.name] = AliasBackend(alias.name, versions, rollouts)
    return aliases
