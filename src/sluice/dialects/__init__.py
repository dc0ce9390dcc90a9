"""Dialects: pure functions from neutral events to wire payloads."""
