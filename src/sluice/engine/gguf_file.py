"""The GGUF container (llama.cpp's model file): its metadata and its tensors, read lazily.

Layout (GGUF version 2 and 3, little-endian; ggml's ``docs/gguf.md``)::

    "GGUF" u32:version u64:num_tensors u64:num_metadata
    num_metadata x (string:key u32:value_type value)
    num_tensors  x (string:name u32:num_dims u64[num_dims]:dims u32:ggml_type u64:offset)
    padding to general.alignment (default 32), then the tensor data

A string is a u64 byte count and UTF-8 bytes; an array is ``u32:element_type u64:count`` and
its elements. ``dims`` are innermost first (ggml order), so a ``[rows, cols]`` matrix is
stored as ``dims = (cols, rows)``.

The ``gguf`` package supplies the vocabulary of the format (value and quantization types,
block sizes) and the dequantization kernels. It also has a reader (``GGUFReader``), which this
module does not use: it makes a NumPy view per array element, and a 49,152-token vocabulary
(three arrays of ~49,000 entries) took it 9-11 s to open on a 2-core machine; this reader
parses the same file in well under a second and maps the tensor data without reading it.

Divergences, each deliberate:

1. Version 1 files (32-bit counts, 2023) and big-endian files are refused, not read.
2. Unknown value types are refused (the format has no length to skip them by).
"""

from __future__ import annotations

import contextlib
import mmap
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, quants

__all__ = ["GGUFError", "GGUFFile", "GGUFTensor", "MetadataValue"]

_MAGIC = b"GGUF"
_SUPPORTED_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
# Refuse a header that claims more entries than any real file has (a corrupt or hostile file
# would otherwise make us allocate for billions): llama.cpp's own limits are of this order.
MAX_METADATA_ENTRIES = 1 << 16
MAX_TENSORS = 1 << 20
MAX_ARRAY_LENGTH = 1 << 26

_SCALARS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}

MetadataValue = int | float | bool | str | list[int] | list[float] | list[bool] | list[str]


class GGUFError(ValueError):
    """A file that is not a GGUF this reader can use; the message says why."""


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor's entry: ``shape`` in PyTorch order (outermost first)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: GGMLQuantizationType
    offset: int  # from the start of the file
    num_bytes: int


class _Cursor:
    """Reads little-endian values from a buffer, with the file name in every error."""

    def __init__(self, buffer: mmap.mmap, path: Path) -> None:
        self.buffer = buffer
        self.path = path
        self.pos = 0

    def take(self, fmt: str) -> int | float:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buffer):
            raise GGUFError(f"{self.path}: truncated at byte {self.pos}")
        (value,) = struct.unpack_from(fmt, self.buffer, self.pos)
        self.pos += size
        return value  # type: ignore[no-any-return]

    def count(self, limit: int, what: str) -> int:
        value = int(self.take("<Q"))
        if value > limit:
            raise GGUFError(f"{self.path}: {value} {what} (at most {limit} accepted)")
        return value

    def string(self) -> str:
        size = self.count(len(self.buffer), "bytes in a string")
        end = self.pos + size
        if end > len(self.buffer):
            raise GGUFError(f"{self.path}: truncated string at byte {self.pos}")
        raw = self.buffer[self.pos : end]
        self.pos = end
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise GGUFError(f"{self.path}: a string is not UTF-8: {exc}") from exc

    def value_type(self) -> GGUFValueType:
        code = int(self.take("<I"))
        try:
            return GGUFValueType(code)
        except ValueError:
            raise GGUFError(f"{self.path}: unknown metadata value type {code}") from None

    def value(self, kind: GGUFValueType) -> MetadataValue:
        if kind == GGUFValueType.STRING:
            return self.string()
        if kind == GGUFValueType.BOOL:
            return bool(self.take("<B"))
        if kind == GGUFValueType.ARRAY:
            element = self.value_type()
            length = self.count(MAX_ARRAY_LENGTH, "array elements")
            if element == GGUFValueType.ARRAY:
                raise GGUFError(f"{self.path}: nested arrays are not supported")
            if element in _SCALARS:  # one NumPy read instead of a Python loop
                dtype = np.dtype(_SCALARS[element])
                end = self.pos + length * dtype.itemsize
                if end > len(self.buffer):
                    raise GGUFError(f"{self.path}: truncated array at byte {self.pos}")
                values = np.frombuffer(self.buffer, dtype, length, self.pos).tolist()
                self.pos = end
                return values  # type: ignore[no-any-return]
            return [self.value(element) for _ in range(length)]  # type: ignore[return-value]
        return self.take(_SCALARS[kind])


class GGUFFile:
    """An open GGUF file: ``metadata`` (key -> value) and ``tensors`` (name -> entry).

    The tensor data is memory-mapped; :meth:`dequantize` reads one tensor as float32.
    Use as a context manager, or call :meth:`close`.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            with self.path.open("rb") as file:
                self._buffer = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as exc:  # ValueError: an empty file cannot be mapped
            raise GGUFError(f"{self.path}: cannot map the file: {exc}") from exc
        try:
            self.version, self.metadata, self.tensors = self._parse()
        except BaseException:
            self._buffer.close()
            raise

    def _parse(self) -> tuple[int, dict[str, MetadataValue], dict[str, GGUFTensor]]:
        cursor = _Cursor(self._buffer, self.path)
        if self._buffer[:4] != _MAGIC:
            raise GGUFError(f"{self.path}: not a GGUF file (no 'GGUF' magic)")
        cursor.pos = 4
        version = int(cursor.take("<I"))
        if version not in _SUPPORTED_VERSIONS:
            hint = " (a big-endian file?)" if version > 0xFFFF else ""
            raise GGUFError(f"{self.path}: GGUF version {version} is not supported{hint}")
        num_tensors = cursor.count(MAX_TENSORS, "tensors")
        num_entries = cursor.count(MAX_METADATA_ENTRIES, "metadata entries")
        metadata: dict[str, MetadataValue] = {}
        for _ in range(num_entries):
            key = cursor.string()
            metadata[key] = cursor.value(cursor.value_type())
        entries = []
        for _ in range(num_tensors):
            name = cursor.string()
            num_dims = int(cursor.take("<I"))
            if not 1 <= num_dims <= 4:
                raise GGUFError(f"{self.path}: tensor {name!r} has {num_dims} dimensions")
            dims = tuple(int(cursor.take("<Q")) for _ in range(num_dims))
            code = int(cursor.take("<I"))
            offset = int(cursor.take("<Q"))
            try:
                ggml_type = GGMLQuantizationType(code)
            except ValueError:
                raise GGUFError(f"{self.path}: tensor {name!r} has unknown type {code}") from None
            entries.append((name, dims, ggml_type, offset))
        alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise GGUFError(f"{self.path}: general.alignment {alignment!r} is not a power of 2")
        data_start = -(-cursor.pos // alignment) * alignment
        tensors: dict[str, GGUFTensor] = {}
        for name, dims, ggml_type, offset in entries:
            block_size, type_size = GGML_QUANT_SIZES[ggml_type]
            num_elements = int(np.prod(dims))
            if dims[0] % block_size:
                raise GGUFError(
                    f"{self.path}: tensor {name!r} rows of {dims[0]} do not fill "
                    f"{ggml_type.name} blocks of {block_size}"
                )
            num_bytes = num_elements // block_size * type_size
            start = data_start + offset
            if start + num_bytes > len(self._buffer):
                raise GGUFError(f"{self.path}: tensor {name!r} runs past the end of the file")
            tensors[name] = GGUFTensor(name, dims[::-1], ggml_type, start, num_bytes)
        return version, metadata, tensors

    def dequantize(self, name: str) -> np.ndarray:
        """Tensor ``name`` as a new, writable float32 array of its shape."""
        tensor = self.tensors[name]
        raw = np.frombuffer(self._buffer, np.uint8, tensor.num_bytes, tensor.offset)
        rows = raw.reshape(*tensor.shape[:-1], -1)  # each row: whole blocks of bytes
        try:
            values = quants.dequantize(rows, tensor.ggml_type)
        except NotImplementedError as exc:
            raise GGUFError(
                f"{self.path}: tensor {name!r}: {tensor.ggml_type.name} cannot be dequantized"
            ) from exc
        return np.array(values, dtype=np.float32).reshape(tensor.shape)

    def __iter__(self) -> Iterator[GGUFTensor]:
        return iter(self.tensors.values())

    def close(self) -> None:
        # BufferError: an array still views the map; it closes when that array is freed.
        with contextlib.suppress(BufferError):
            self._buffer.close()

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
