"""Transports: delivery of a reader's records to one client connection (no business logic)."""
