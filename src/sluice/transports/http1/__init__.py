"""The native HTTP/1.1 path of ``sluice serve``: callback-driven answers, bounded heads.

:mod:`~sluice.transports.http1.writer` (sans-IO response bytes),
:mod:`~sluice.transports.http1.deadline` (read deadlines),
:mod:`~sluice.transports.http1.opener` (the seam the application implements),
:mod:`~sluice.transports.http1.protocol` (our connection logic) and
:mod:`~sluice.transports.http1.uvicorn_adapter` (the only module that touches uvicorn's
internals).
"""
