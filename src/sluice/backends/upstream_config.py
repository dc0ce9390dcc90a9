"""Which upstream servers to proxy: command-line flags or a TOML file, as
:class:`UpstreamSpec` values that build :class:`~sluice.backends.upstream.UpstreamBackend`.

A config file lists one table per served model::

    [[upstream]]
    name = "llama3"                        # served under this name
    base_url = "http://127.0.0.1:8001/v1"  # the OpenAI-compatible API root
    model = "meta-llama/Llama-3.1-8B"      # the name upstream (default: name)
    api_key_env = "VLLM_API_KEY"           # the key, read from this variable (optional)
    connect_timeout_s = 5.0
    read_timeout_s = 60.0

Keys live in the environment, never in the file. Unknown keys are an error (a typo must not
silently change nothing).
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import httpx

from sluice.backends.upstream import UpstreamBackend
from sluice.errors import ConfigError

__all__ = ["UpstreamSpec", "list_upstream_models", "load_upstream_config"]

_KEYS = {"name", "base_url", "model", "api_key_env", "connect_timeout_s", "read_timeout_s"}


@dataclass(frozen=True, slots=True)
class UpstreamSpec:
    """One proxied model."""

    name: str
    base_url: str
    model: str | None = None
    api_key: str | None = None
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 60.0

    def backend(self) -> UpstreamBackend:
        return UpstreamBackend(
            self.name,
            self.base_url,
            api_key=self.api_key,
            upstream_model=self.model,
            connect_timeout_s=self.connect_timeout_s,
            read_timeout_s=self.read_timeout_s,
        )


def load_upstream_config(path: Path, environ: Mapping[str, str] = os.environ) -> list[UpstreamSpec]:
    """The upstreams of a TOML config file; :class:`ConfigError` says what is wrong."""
    try:
        config = tomllib.loads(path.read_text("utf-8"))
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    tables = config.get("upstream")
    if not isinstance(tables, list) or not tables:
        raise ConfigError(f"{path}: no [[upstream]] tables")
    specs: list[UpstreamSpec] = []
    for i, table in enumerate(tables):
        where = f"{path}: upstream #{i + 1}"
        unknown = set(table) - _KEYS
        if unknown:
            raise ConfigError(f"{where}: unknown keys {sorted(unknown)}")
        for key in ("name", "base_url"):
            if not isinstance(table.get(key), str) or not table[key]:
                raise ConfigError(f"{where}: {key} must be a non-empty string")
        api_key = None
        if "api_key_env" in table:
            api_key = environ.get(str(table["api_key_env"]))
            if api_key is None:
                raise ConfigError(f"{where}: environment variable {table['api_key_env']} unset")
        timeouts = {}
        for key in ("connect_timeout_s", "read_timeout_s"):
            if key in table:
                value = table[key]
                if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
                    raise ConfigError(f"{where}: {key} must be a positive number")
                timeouts[key] = float(value)
        model = table.get("model")
        if model is not None and not isinstance(model, str):
            raise ConfigError(f"{where}: model must be a string")
        specs.append(UpstreamSpec(table["name"], table["base_url"], model, api_key, **timeouts))
    names = [spec.name for spec in specs]
    if len(set(names)) != len(names):
        raise ConfigError(f"{path}: model names served twice: {names}")
    return specs


def list_upstream_models(base_url: str, api_key: str | None, timeout_s: float = 10.0) -> list[str]:
    """The model ids ``GET {base_url}/models`` lists (start-up only: it blocks)."""
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    url = f"{base_url.rstrip('/')}/models"
    try:
        response = httpx.get(url, headers=headers, timeout=timeout_s)
        response.raise_for_status()
        ids = [str(entry["id"]) for entry in response.json()["data"]]
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(
            f"cannot list the models of {url} ({exc}); name one with --upstream-model"
        ) from exc
    if not ids:
        raise ConfigError(f"{url} lists no models; name one with --upstream-model")
    return ids
