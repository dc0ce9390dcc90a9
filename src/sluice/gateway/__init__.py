"""The gateway: the ASGI application (routes, validation, the SSE fast path)."""

from sluice.gateway.app import create_app
from sluice.gateway.settings import Settings

__all__ = ["Settings", "create_app"]
