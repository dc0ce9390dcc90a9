"""The rollout state file: every alias's rollout, kept across restarts.

One JSON object, ``{"format": 1, "rollouts": {alias: record}}`` (a record is
:meth:`~sluice.rollout.state.Rollout.record`). It is written atomically: to a temporary
file in the same directory, flushed and ``fsync``-ed, then renamed over the old one
(``os.replace``), so a crash leaves the old file or the new one, never half of one.

A missing file is an empty state. A file that is not ours (bad JSON, another format) is a
:class:`~sluice.errors.ConfigError` at start-up: the server does not silently forget a
rollback. Records are bounded by :data:`~sluice.rollout.state.MAX_DECISIONS` per alias,
and a file past :data:`MAX_STATE_BYTES` is refused rather than read.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Final

from sluice.errors import ConfigError

__all__ = ["FORMAT", "MAX_STATE_BYTES", "StateFile"]

FORMAT: Final = 1
# A few aliases of 200 decisions each are tens of KiB; anything this large is not ours.
MAX_STATE_BYTES: Final = 16 * 1024 * 1024


class StateFile:
    """Reads and atomically writes the rollout records at ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def load(self) -> dict[str, dict[str, object]]:
        """The records by alias; empty when the file does not exist."""
        try:
            with self.path.open("rb") as file:
                data = file.read(MAX_STATE_BYTES + 1)
        except FileNotFoundError:
            return {}
        except OSError as exc:
            raise ConfigError(f"{self.path}: {exc.strerror or exc}") from exc
        if len(data) > MAX_STATE_BYTES:
            raise ConfigError(f"{self.path}: larger than {MAX_STATE_BYTES} bytes")
        try:
            document = json.loads(data)
        except ValueError as exc:
            raise ConfigError(f"{self.path}: not a rollout state file: {exc}") from exc
        if not isinstance(document, dict) or document.get("format") != FORMAT:
            raise ConfigError(f"{self.path}: not a rollout state file of format {FORMAT}")
        rollouts = document.get("rollouts")
        if not isinstance(rollouts, dict) or not all(
            isinstance(record, dict) for record in rollouts.values()
        ):
            raise ConfigError(f"{self.path}: 'rollouts' must map aliases to objects")
        return rollouts

    def save(self, records: Mapping[str, Mapping[str, object]]) -> None:
        """Replace the file with ``records``, atomically."""
        payload = json.dumps({"format": FORMAT, "rollouts": records}, separators=(",", ":"))
        directory = self.path.parent
        descriptor, temporary = tempfile.mkstemp(
            prefix=f".{self.path.name}.", suffix=".tmp", dir=directory
        )
        try:
            with os.fdopen(descriptor, "w", encoding="utf-8") as file:
                file.write(payload)
                file.flush()
                os.fsync(file.fileno())
            os.replace(temporary, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise
        # The rename itself is durable once the directory is synced.
        with contextlib.suppress(OSError):
            directory_fd = os.open(directory, os.O_RDONLY)
            try:
                os.fsync(directory_fd)
            finally:
                os.close(directory_fd)
