"""Sluice: the last mile for LLM inference.

Token streams that start fast, survive dropped connections (``Last-Event-ID``), stop the
model the moment nobody wants the rest, and never let one slow client hurt the others.
"""

__all__ = ["__version__"]

__version__ = "0.1.0"
