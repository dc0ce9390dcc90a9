"""Backends: where tokens come from (the seam between the hub and a model)."""

from sluice.backends.base import Backend, Delta, Generation, GenerationRequest

__all__ = ["Backend", "Delta", "Generation", "GenerationRequest"]
