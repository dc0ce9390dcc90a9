"""Builds and loads the engine's C kernels (``*.c`` beside this module) through ctypes.

The first process that needs a kernel compiles it with the C compiler (``$CC``, else
``cc``) for this CPU (``-march=native``) with OpenMP, into ``$SLUICE_KERNEL_CACHE``
(default ``~/.cache/sluice/kernels``), under a name that hashes the sources, the flags, the
compiler and the CPU; later processes load that file. The OpenMP runtime a kernel links is
torch's own ``libgomp`` when torch ships one, so both share one thread pool. When there is
no compiler, or the build fails, :func:`load_kernel` says so once in the log and returns
None: the callers keep their torch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from importlib import resources
from pathlib import Path

import torch

__all__ = ["NativeKernelError", "build_kernel", "check_status", "load_kernel"]

log = logging.getLogger(__name__)

_FLAGS = (
    "-O3",
    "-march=native",
    "-fno-math-errno",
    "-fassociative-math",
    "-fno-signed-zeros",
    "-fno-trapping-math",
    "-fopenmp",
    "-shared",
    "-fPIC",
)
_BUILD_TIMEOUT_S = 120.0
# The kernels' status bits (paged_attention.c); anything else non-zero: sizes that do not fit.
_BAD_BLOCK, _NO_MEMORY = 1, 4


class NativeKernelError(ValueError):
    """A kernel refused a call: a block id outside the cache, or sizes that do not fit."""


def check_status(status: int, *, num_blocks: int, what: str, refused: Exception) -> None:
    """Raise what a kernel's ``status`` says (``what`` ran; ``refused`` for sizes that do
    not fit); nothing for 0."""
    if status == 0:
        return
    if status == _BAD_BLOCK:
        raise NativeKernelError(f"a block table names a block outside [0, {num_blocks})")
    if status == _NO_MEMORY:
        raise MemoryError(f"{what}: no memory for its scratch")
    raise refused


def load_kernel(name: str) -> ctypes.CDLL | None:
    """The kernel ``name`` (``name.c`` beside this module), built if need be; None when
    ``SLUICE_NATIVE_KERNELS=0`` turns the kernels off (read on every call), or when it
    cannot be built or loaded (logged once)."""
    if os.environ.get("SLUICE_NATIVE_KERNELS", "1") == "0":
        return None
    return _built_kernel(name)


@functools.cache
def _built_kernel(name: str) -> ctypes.CDLL | None:
    cache_dir = Path(
        os.environ.get("SLUICE_KERNEL_CACHE") or Path.home() / ".cache" / "sluice" / "kernels"
    )
    try:
        return ctypes.CDLL(str(build_kernel(cache_dir, os.environ.get("CC") or "cc", name)))
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("C kernel %s unavailable, using the torch path: %s", name, exc)
        return None


def _openmp_flags() -> list[str]:
    """Link torch's own libgomp when it ships one: one OpenMP runtime in the process."""
    torch_lib = Path(torch.__file__).parent / "lib"
    if (torch_lib / "libgomp.so.1").exists():
        return [f"-L{torch_lib}", "-l:libgomp.so.1", f"-Wl,-rpath,{torch_lib}"]
    return []


def _cpu_signature() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    lines = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


def build_kernel(cache_dir: Path, compiler: str, name: str) -> Path:
    """Kernel ``name``'s shared library in ``cache_dir``, compiled with ``compiler`` unless a
    build of the same sources, flags, compiler and CPU is there already. Raises
    :class:`OSError` when there is no such compiler, no such kernel, or the build fails."""
    package = resources.files("sluice.engine.models")
    sources = {
        entry.name: entry.read_bytes() for entry in package.iterdir() if entry.name.endswith(".c")
    }
    if f"{name}.c" not in sources:
        raise OSError(f"no kernel source {name}.c")
    compiler_path = shutil.which(compiler)
    if compiler_path is None:
        raise OSError(f"no C compiler {compiler!r} on PATH")
    version = subprocess.run(
        [compiler_path, "--version"], capture_output=True, check=True, timeout=30
    ).stdout
    flags = [*_FLAGS, *_openmp_flags(), "-lm"]
    digest = hashlib.sha256(
        b"\0".join(
            [
                *(key.encode() + b"\0" + sources[key] for key in sorted(sources)),
                " ".join(flags).encode(),
                version,
                _cpu_signature().encode(),
            ]
        )
    ).hexdigest()[:16]
    target = cache_dir / f"{name}-{digest}.so"
    if target.exists():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir) as scratch:
        for source_name, text in sources.items():  # a kernel may #include another's source
            (Path(scratch) / source_name).write_bytes(text)
        built = Path(scratch) / target.name
        result = subprocess.run(
            [
                compiler_path,
                *_FLAGS,
                str(Path(scratch) / f"{name}.c"),
                "-o",
                str(built),
                *_openmp_flags(),
                "-lm",
            ],
            capture_output=True,
            timeout=_BUILD_TIMEOUT_S,
        )
        if result.returncode != 0:
            raise OSError(
                f"{compiler} failed ({result.returncode}): "
                f"{result.stderr.decode(errors='replace')[-2000:]}"
            )
        os.replace(built, target)  # atomic: a concurrent build's file is as good
    log.info("built the C kernel %s: %s", name, target)
    return target
