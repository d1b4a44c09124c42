"""A GGUF file as llama.cpp writes it: header, metadata, and every tensor memory-mapped, with each
tensor's values exactly as the `gguf` package's reference dequantization gives them.

Why not `mx.load`: MLX reads GGUF natively but dequantizes Q4_K wrongly (Qwen2.5-Coder's
`blk.0.attn_q.weight` was off by up to 1.90 where its largest value is 2.09), and its result
depends on a library we cannot check per type. Why not `gguf.GGUFReader`: it builds a numpy view
per metadata string, 18 s for a 151K-token vocabulary. This reader parses the header with
`struct` (~0.3 s for the same file), memory-maps the tensor data, and dequantizes one tensor at
a time with `gguf.quants.dequantize`, the package's own reference for every block type, so a
weight equals it bit for bit by construction (tests/engine/test_gguf_types.py checks every type
on tensors the package wrote, and on the shipped files).

A type the package cannot dequantize is a `GGUFError` naming the tensor and its type, at open,
before any weight is read.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# GGUF value types (gguf.constants.GGUFValueType): fixed-width scalars, string, array
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9
# plain element types: their bytes are the values
_PLAIN = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
          "I32": np.int32, "I64": np.int64}


class GGUFError(ValueError):
    """A GGUF file this loader cannot read, with the reason (one line)."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the file: its shape in numpy order (rows first), block type and bytes."""

    name: str
    shape: tuple[int, ...]
    type_name: str  # gguf.GGMLQuantizationType name: F32, Q4_K, ...
    type_id: int
    offset: int  # absolute, in the file
    nbytes: int


def _block_info(type_id: int) -> tuple[str, int, int]:
    """(name, values per block, bytes per block) of a ggml type, from the gguf package's table."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        kind = GGMLQuantizationType(type_id)
    except ValueError:
        raise GGUFError(f"unknown ggml tensor type {type_id}") from None
    block, size = GGML_QUANT_SIZES[kind]
    return kind.name, block, size


def readable(type_name: str) -> bool:
    """Whether the gguf package dequantizes this type (or its bytes are the values)."""
    if type_name in _PLAIN:
        return True
    from gguf import quants
    from gguf.constants import GGMLQuantizationType

    traits = getattr(quants, "_type_traits", {})
    return GGMLQuantizationType[type_name] in traits


class _Cursor:
    """Little-endian reads from the header bytes."""

    def __init__(self, data: memoryview) -> None:
        self.data = data
        self.at = 0

    def take(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.data, self.at)[0]
        self.at += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.take("<Q")
        raw = bytes(self.data[self.at : self.at + length])
        self.at += length
        return raw.decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.take("<I"), self.take("<Q")
            if item in _NUMPY:  # one numpy view for a whole numeric array
                width = np.dtype(_NUMPY[item]).itemsize
                values = np.frombuffer(self.data, dtype=_NUMPY[item], count=count, offset=self.at).copy()
                self.at += width * count
                return values
            return [self.value(item) for _ in range(count)]
        if kind not in _SCALARS:
            raise GGUFError(f"unknown GGUF value type {kind}")
        return self.take(_SCALARS[kind])


class GGUFFile:
    """An open GGUF file: `metadata` (key -> value; numeric arrays as numpy), `tensors` (name ->
    TensorInfo, in file order), and `values(name)`, a tensor's float32 values."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            with open(self.path, "rb") as handle:
                self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as error:
            raise GGUFError(f"cannot read {self.path}: {error}") from error
        try:
            self._parse(memoryview(self._map))
        except struct.error as error:
            raise GGUFError(f"{self.path.name}: truncated GGUF header ({error})") from None

    def _parse(self, data: memoryview) -> None:
        if bytes(data[:4]) != MAGIC:
            raise GGUFError(f"{self.path.name} is not a GGUF file")
        cursor = _Cursor(data)
        cursor.at = 4
        version = cursor.take("<I")
        if version not in (2, 3):
            raise GGUFError(f"{self.path.name}: GGUF version {version} is not supported (2 and 3 are)")
        tensor_count, kv_count = cursor.take("<Q"), cursor.take("<Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key = cursor.string()
            self.metadata[key] = cursor.value(cursor.take("<I"))
        infos = []
        for _ in range(tensor_count):
            name = cursor.string()
            dims = [cursor.take("<Q") for _ in range(cursor.take("<I"))]
            type_id, offset = cursor.take("<I"), cursor.take("<Q")
            infos.append((name, tuple(reversed(dims)), type_id, offset))
        alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        start = -(-cursor.at // alignment) * alignment
        self.tensors: dict[str, TensorInfo] = {}
        for name, shape, type_id, offset in infos:
            type_name, block, size = _block_info(type_id)
            count = int(np.prod(shape)) if shape else 1
            if shape and shape[-1] % block:
                raise GGUFError(f"{name}: {shape[-1]} columns are not whole {type_name} blocks of {block}")
            nbytes = count // block * size
            if start + offset + nbytes > len(data):
                raise GGUFError(f"{self.path.name}: tensor {name} runs past the end of the file (truncated?)")
            self.tensors[name] = TensorInfo(name, shape, type_name, type_id, start + offset, nbytes)

    def check_readable(self) -> None:
        """A GGUFError naming the first tensor whose type cannot be read here, if any."""
        for info in self.tensors.values():
            if not readable(info.type_name):
                raise GGUFError(f"tensor {info.name} is stored as {info.type_name}, a GGUF type this loader "
                                "cannot read (the gguf package has no dequantization for it)")

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as stored (uint8, memory-mapped: nothing is copied)."""
        info = self.tensors[name]
        return np.frombuffer(self._map, dtype=np.uint8, count=info.nbytes, offset=info.offset)

    def values(self, name: str) -> np.ndarray:
        """The tensor as float32 in numpy shape: its bytes widened for plain types, else the gguf
        package's reference dequantization of its blocks."""
        info = self.tensors[name]
        raw = self.raw(name)
        if info.type_name in _PLAIN:
            return raw.view(_PLAIN[info.type_name]).reshape(info.shape).astype(np.float32)
        if not readable(info.type_name):
            raise GGUFError(f"tensor {name} is stored as {info.type_name}, a GGUF type this loader cannot read")
        from gguf.constants import GGMLQuantizationType
        from gguf.quants import dequantize

        rows = raw.reshape(-1, raw.shape[0] // max(1, int(np.prod(info.shape[:-1]))))
        return np.asarray(dequantize(rows, GGMLQuantizationType(info.type_id)), dtype=np.float32).reshape(info.shape)

    def type_counts(self) -> dict[str, int]:
        """How many tensors of each type the file holds (for messages and model listings)."""
        counts: dict[str, int] = {}
        for info in self.tensors.values():
            counts[info.type_name] = counts.get(info.type_name, 0) + 1
        return counts
