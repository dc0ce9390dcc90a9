"""The LiteLLM proxy as the peer hop of ``proxy_overhead.py``: its virtualenv, config, command.

LiteLLM pins its own ``openai`` and dozens of other packages, so it gets its own
virtualenv, ``.venv-litellm/`` at the repository root (ignored by git), made from PyPI by
:func:`ensure_venv`: ``scripts/setup.sh --test`` runs ``python bench/litellm_peer.py``,
and the benchmark calls it too when the virtualenv is missing or holds another version.
It takes 1.5-3 minutes and 750 MB on a 2-vCPU machine.

The pin, :data:`LITELLM_REQUIREMENT`: ``litellm[proxy]==1.106.12``, the newest release
whose ``proxy`` extra installs from PyPI as this was written. 1.108.0 to 1.110.2 pin
``litellm-proxy``, ``litellm-proxy-extras`` and ``litellm-enterprise`` releases that the
index does not serve, so ``pip install 'litellm[proxy]'`` of those fails; and 1.107.0 was
a compromised release (withdrawn). The proxy code itself is the same package either way.

How it is run (:func:`proxy`): ``litellm --config <tmp>/config.yaml --host 127.0.0.1
--port P`` (uvicorn, one worker, LiteLLM's defaults otherwise), the config naming one
model routed as ``openai/<model>`` to the same upstream the Sluice hop fronts, a master
key (LiteLLM refuses to start without one), and no database (``DATABASE_URL`` unset).
``LITELLM_LOCAL_MODEL_COST_MAP=True`` and its siblings keep it from fetching its cost map
and other tables from the internet at start; ``LITELLM_LOG=ERROR`` keeps its uvicorn from
logging every request (Sluice runs at ``--log-level warning``); ``--telemetry False`` is
passed (a no-op in this release, which has no telemetry). Its start takes 15-60 s.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from peers import BENCH_DIR, HOST, ServerProcess

__all__ = [
    "LITELLM_REQUIREMENT",
    "LITELLM_VERSION",
    "VENV",
    "LiteLLMProxy",
    "ensure_venv",
    "installed_version",
    "proxy",
]

LITELLM_VERSION = "1.106.12"
LITELLM_REQUIREMENT = f"litellm[proxy]=={LITELLM_VERSION}"
VENV = BENCH_DIR.parent / ".venv-litellm"
# pip's own timeouts bound each download; this bounds the whole install.
_INSTALL_TIMEOUT_S = 900
# LiteLLM imports hundreds of modules before it listens.
_READY_TIMEOUT_S = 180.0
# Each keeps LiteLLM from fetching a table from the internet (it falls back to the copy
# in its package after retries otherwise, slowly, and logs warnings).
_LOCAL_TABLES = (
    "LITELLM_LOCAL_MODEL_COST_MAP",
    "LITELLM_LOCAL_ANTHROPIC_BETA_HEADERS",
    "LITELLM_LOCAL_AUTOROUTER_PRESETS",
    "LITELLM_LOCAL_BLOG_POSTS",
    "LITELLM_LOCAL_POLICY_TEMPLATES",
)
# What of the benchmark's environment must not reach LiteLLM: a database (it would use it),
# our servers' PYTHONPATH (the snapshot of src/), and a master key of someone else's.
_UNSET = (
    "DATABASE_URL",
    "DIRECT_URL",
    "DATABASE_URL_READ_REPLICA",
    "PYTHONPATH",
    "LITELLM_MASTER_KEY",
    "LITELLM_CONFIG_PATH",
)


def _python() -> Path:
    return VENV / "bin" / "python"


def installed_version() -> str | None:
    """The litellm version in :data:`VENV`, or None when there is none."""
    if not _python().exists():
        return None
    done = subprocess.run(
        [str(_python()), "-c", "import importlib.metadata as m; print(m.version('litellm'))"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if done.returncode != 0:
        return None
    return done.stdout.strip() or None


def ensure_venv(say: Callable[[str], object] = print) -> Path:
    """The ``litellm`` command of :data:`VENV`, installing :data:`LITELLM_REQUIREMENT` first
    when the virtualenv is missing or holds another version. Raises RuntimeError (with
    pip's output) when the install fails."""
    if installed_version() != LITELLM_VERSION:
        say(f"litellm_peer: installing {LITELLM_REQUIREMENT} into {VENV} (1.5-3 minutes)")
        steps = [
            [sys.executable, "-m", "venv", "--clear", str(VENV)],
            [
                str(_python()),
                "-m",
                "pip",
                "install",
                "-q",
                "--disable-pip-version-check",
                LITELLM_REQUIREMENT,
            ],
        ]
        for step in steps:
            done = subprocess.run(step, capture_output=True, text=True, timeout=_INSTALL_TIMEOUT_S)
            if done.returncode != 0:
                raise RuntimeError(
                    f"{' '.join(step)} failed ({done.returncode}):\n{done.stdout}{done.stderr}"
                )
        if installed_version() != LITELLM_VERSION:
            raise RuntimeError(f"{VENV} holds litellm {installed_version()} after the install")
    return VENV / "bin" / "litellm"


def write_config(directory: Path, upstream_base: str, model: str, master_key: str) -> Path:
    """A config.yaml routing ``model`` to the OpenAI-compatible ``upstream_base``."""
    path = directory / "config.yaml"
    path.write_text(
        "model_list:\n"
        f"  - model_name: {model}\n"
        "    litellm_params:\n"
        f"      model: openai/{model}\n"
        f"      api_base: {upstream_base}\n"
        "      api_key: sk-bench-upstream\n"
        "general_settings:\n"
        f"  master_key: {master_key}\n"
    )
    return path


class LiteLLMProxy(ServerProcess):
    """A LiteLLM proxy process; ``master_key`` is what its clients send as a Bearer key."""

    master_key: str


def proxy(
    litellm: Path, directory: Path, port: int, upstream_base: str, model: str
) -> LiteLLMProxy:
    """The (unstarted) LiteLLM proxy in front of ``upstream_base``, its files in
    ``directory``."""
    master_key = "sk-bench-" + secrets.token_hex(16)
    config = write_config(directory, upstream_base, model, master_key)
    command = [
        str(litellm),
        "--config",
        str(config),
        "--host",
        HOST,
        "--port",
        str(port),
        "--telemetry",
        "False",
    ]
    env = dict.fromkeys(_LOCAL_TABLES, "True")
    env |= {
        "LITELLM_LOG": "ERROR",
        "LITELLM_DONT_SHOW_FEEDBACK_BOX": "true",
        "NO_COLOR": "1",
        "HOME": os.environ.get("HOME", str(directory)),
    }
    server = LiteLLMProxy(
        "litellm",
        command,
        port,
        "/health/liveliness",
        directory / "litellm.log",
        env,
        ready_timeout_s=_READY_TIMEOUT_S,
        cwd=directory,
        unset_env=_UNSET,
    )
    server.master_key = master_key
    return server


if __name__ == "__main__":
    print(f"litellm_peer: {ensure_venv()} ({LITELLM_REQUIREMENT})")
