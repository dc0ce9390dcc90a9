"""The embedded engine in a child process: ``sluice serve --engine-process``.

In one process, the engine thread and the event loop take turns on one GIL: each of a
step's hundreds of torch calls gives it up and must win it back from a loop that renders
SSE. :class:`ProcessEngine` runs the engine in a child process of its own and drives it
from the server's loop with the API of :class:`~sluice.engine.driver.AsyncEngine`
(``add_request``, ``abort``, ``call``, streams of :class:`RequestOutput`), so
:class:`~sluice.backends.engine.EngineBackend` serves it unchanged: the prompt is made,
admitted and predicted in the server, the tokens are sampled and detokenized in the child.

Wire: one Unix socket pair; a message is a 4-byte big-endian length and a pickle (both
ends are this program, started by it). Commands go one way (``add``, ``abort``, ``call``;
closing the socket stops the child); the child answers each that asks, and sends ONE
message per step with every request's output (and the step's :class:`StepStats`), not one
per token, as vLLM's engine core does. An abort is handled between steps, as in-process: the blocks are free when the
current step ends.

Lifecycle: :func:`start_child` spawns ``python -m sluice.engine_process.child FD`` and waits
(bounded) for it to load the model and say what it serves (:class:`EngineInfo`). The child
ignores SIGINT and SIGTERM (the server drains first) and exits when its socket reaches
end of file: when the server closes it, or when the server dies, however. When the child
dies under the server, every live stream ends with :class:`EngineClosedError` (the backend
makes it a retryable error), new requests are refused with
:class:`~sluice.errors.CapacityError` (``503`` + ``Retry-After``) until a new child has
loaded the model, and one is started at once (again after :data:`RESTART_BACKOFF_S`
while starts fail).

Modules: :mod:`~sluice.engine_process.wire` (what crosses the socket),
:mod:`~sluice.engine_process.driver` (the server's side), :mod:`~sluice.engine_process.child`
(the child's), :mod:`~sluice.engine_process.replicas` (several children as one engine:
``--engine-replicas``).
"""

from sluice.engine_process.driver import EngineChild, ProcessEngine, start_child
from sluice.engine_process.replicas import EngineReplicas
from sluice.engine_process.wire import MAX_MESSAGE_BYTES, EngineInfo, EngineSpec

__all__ = [
    "MAX_MESSAGE_BYTES",
    "EngineChild",
    "EngineInfo",
    "EngineReplicas",
    "EngineSpec",
    "ProcessEngine",
    "start_child",
]
