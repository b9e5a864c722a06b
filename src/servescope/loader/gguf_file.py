"""A GGUF file's metadata and tensor table, read in one pass with `struct`.

gguf-py's GGUFReader builds a numpy memmap view for every part of every metadata field: for the
embedded SmolLM2 file (a 49,152-entry vocabulary and its merges) that is a quarter of a million views
and seconds of every start-up on a 2-core machine. This reader parses the same header with
`struct.unpack_from` over one memory map, in a fraction of that, and hands out the tensors exactly
as GGUFReader lays them out (the same numpy dtype and shape per GGML type, views of the map), so
`gguf.quants.dequantize` and our packed-block loader take them unchanged. Big-endian files go to
GGUFReader (they are rare; it byte-swaps).

Format (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md): magic "GGUF", uint32 version (2, 3),
uint64 tensor count, uint64 key/value count, the key/values, the tensor infos, then the tensor data at
the next multiple of `general.alignment` (default 32).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

# GGUF value types: struct format of the scalars; 8 = string, 9 = array
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9
# GGML types that GGUFReader hands out as arrays of their element type; the rest as bytes per row
_ELEMENT_TYPES = {GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
                  GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
                  GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
                  GGMLQuantizationType.I64: np.int64}


@dataclass
class TensorInfo:
    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray  # dims innermost first, as the file (and GGUFReader) list them
    n_bytes: int
    data_offset: int
    data: np.ndarray  # a view of the memory-mapped file


class GGUFFile:
    """`fields`: metadata key -> Python value (str, int, float, bool, or a list of them);
    `tensors`: TensorInfo in file order. Raises ValueError on a malformed or truncated file."""

    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as f:
            self._map = (np.memmap(f, dtype=np.uint8, mode="r") if os.fstat(f.fileno()).st_size
                         else np.zeros(0, np.uint8))
        buf = memoryview(self._map) if self._map.size else memoryview(b"")
        self.fields: dict[str, Any] = {}
        self.tensors: list[TensorInfo] = []
        try:
            self._parse(buf)
        except struct.error as e:  # a read past the end: the header itself is cut short
            raise ValueError(f"truncated or malformed GGUF header ({e})") from None

    def _parse(self, buf: memoryview) -> None:
        if len(buf) < 24 or bytes(buf[:4]) != b"GGUF":
            raise ValueError("no GGUF magic at the start of the file")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise ValueError(f"unsupported GGUF version {version}")
        pos = 24
        for _ in range(n_kv):
            key, pos = _string(buf, pos)
            (vtype,), pos = struct.unpack_from("<I", buf, pos), pos + 4
            self.fields[key], pos = _value(buf, pos, vtype)
        infos, names = [], set()
        for _ in range(n_tensors):
            name, pos = _string(buf, pos)
            if name in names:
                raise ValueError(f"duplicated tensor {name}")
            names.add(name)
            (n_dims,), pos = struct.unpack_from("<I", buf, pos), pos + 4
            dims = np.frombuffer(buf, dtype="<u8", count=n_dims, offset=pos).astype(np.int64)
            pos += 8 * n_dims
            ggml_type, offset = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            infos.append((name, dims, GGMLQuantizationType(ggml_type), offset))
        align = int(self.fields.get("general.alignment", 32))
        start = pos + (-pos % align)
        for name, dims, ggml_type, offset in infos:
            n_elems = int(np.prod(dims))
            block, type_size = GGML_QUANT_SIZES[ggml_type]
            n_bytes = n_elems * type_size // block
            begin = start + int(offset)
            if begin + n_bytes > len(buf):
                raise ValueError(f"truncated file: tensor {name} needs bytes {begin}..{begin + n_bytes}, the file has "
                                 f"{len(buf)}")
            np_dims = tuple(reversed(dims.tolist()))
            raw = self._map[begin:begin + n_bytes]
            if ggml_type in _ELEMENT_TYPES:
                data = raw.view(_ELEMENT_TYPES[ggml_type]).reshape(np_dims)
            else:
                data = raw.reshape(quant_shape_to_byte_shape(np_dims, ggml_type))
            self.tensors.append(TensorInfo(name, ggml_type, dims, n_bytes, begin, data))


def read_gguf(path: str):
    """GGUFFile(path), or gguf-py's GGUFReader wrapped to the same interface for a big-endian file."""
    with open(path, "rb") as f:
        head = f.read(8)
    if len(head) == 8 and head[:4] == b"GGUF" and struct.unpack("<I", head[4:])[0] > 0xFFFF:
        return _ReaderFile(path)  # a version that reads as > 65535 is a byte-swapped (big-endian) file
    return GGUFFile(path)


class _ReaderFile:
    """gguf-py's GGUFReader behind GGUFFile's interface."""

    def __init__(self, path: str):
        reader = gguf.GGUFReader(path)
        self.path = path
        self.fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
        self.tensors = [TensorInfo(t.name, t.tensor_type, t.shape, int(t.n_bytes), int(t.data_offset), t.data)
                        for t in reader.tensors]


def _string(buf: memoryview, pos: int) -> tuple:
    (n,) = struct.unpack_from("<Q", buf, pos)
    end = pos + 8 + n
    if end > len(buf):
        raise ValueError("string runs past the end of the file")
    return str(buf[pos + 8:end], "utf-8"), end


def _value(buf: memoryview, pos: int, vtype: int) -> tuple:
    if vtype in _SCALARS:
        fmt = "<" + _SCALARS[vtype]
        return struct.unpack_from(fmt, buf, pos)[0], pos + struct.calcsize(fmt)
    if vtype == _STRING:
        return _string(buf, pos)
    if vtype == _ARRAY:
        item_type, count = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if item_type in _NUMPY:
            dt = np.dtype(_NUMPY[item_type]).newbyteorder("<")
            if pos + count * dt.itemsize > len(buf):
                raise ValueError("array runs past the end of the file")
            return np.frombuffer(buf, dtype=dt, count=count, offset=pos).tolist(), pos + count * dt.itemsize
        items = []
        for _ in range(count):
            item, pos = _value(buf, pos, item_type)
            items.append(item)
        return items, pos
    raise ValueError(f"unknown GGUF value type {vtype}")


def f32_value(v) -> float:
    """A float32 metadata value as the shortest decimal that round-trips (1e-05, not 9.9999997e-06)."""
    return float(repr(np.float32(v)).removeprefix("np.float32(").removesuffix(")"))
