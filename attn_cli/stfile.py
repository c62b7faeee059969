"""The safetensors container, read and written without torch.

Layout (https://github.com/huggingface/safetensors): 8-byte little-endian header length N, N bytes
of JSON {name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {str: str}}, then the
tensor bytes. We need three things the library does not offer: header validation with errors that
say what is wrong with which file, memory-mapped numpy views (data files larger than memory), and a
streaming writer whose memory does not grow with the data (`attn binarize`).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import AttnError
from .files import atomic_output, check_readable
from .formats import FORMAT_DESCRIPTIONS, FORMAT_VERSIONS

NUMPY_DTYPES = {"U8": np.uint8, "I32": np.int32, "I64": np.int64, "F32": np.float32,
                "F16": np.float16, "BF16": None, "I8": np.int8, "I16": np.int16,
                "F64": np.float64, "BOOL": np.bool_, "U16": np.uint16, "U32": np.uint32,
                "U64": np.uint64}
DTYPE_NAMES = {np.dtype(v): k for k, v in NUMPY_DTYPES.items() if v is not None}
MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True)
class Header:
    tensors: dict[str, dict]  # name -> {"dtype", "shape", "data_offsets"}
    metadata: dict[str, str]
    data_start: int  # file offset of the first tensor byte


def read_header(path: str | os.PathLike, what: str = "file") -> Header:
    """Parse and check a safetensors header: every tensor must lie inside the file."""
    path = check_readable(path, what)
    size = path.stat().st_size
    if size == 0:
        raise AttnError(f"{what} {path} is empty")
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise AttnError(f"{what} {path} is not a safetensors file (only {size} bytes)")
        (header_size,) = struct.unpack("<Q", prefix)
        if header_size > min(MAX_HEADER_BYTES, size - 8):
            raise AttnError(f"{what} {path} is not a safetensors file, or is truncated "
                            f"(header of {header_size} bytes in a {size}-byte file)")
        try:
            header = json.loads(handle.read(header_size))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise AttnError(f"{what} {path} is not a safetensors file (unreadable header)") \
                from None
    if not isinstance(header, dict):
        raise AttnError(f"{what} {path} is not a safetensors file (unreadable header)")
    metadata = header.pop("__metadata__", None) or {}
    data_start = 8 + header_size
    for name, entry in header.items():
        try:
            begin, end = entry["data_offsets"]
            count = int(np.prod(entry["shape"], dtype=np.int64))
            itemsize = 2 if entry["dtype"] == "BF16" else np.dtype(
                NUMPY_DTYPES[entry["dtype"]]).itemsize
        except (KeyError, TypeError, ValueError):
            raise AttnError(f"{what} {path} is corrupt (bad entry for tensor {name!r})") from None
        if end - begin != count * itemsize or begin < 0:
            raise AttnError(f"{what} {path} is corrupt (tensor {name!r} has the wrong size)")
        if data_start + end > size:
            raise AttnError(f"{what} {path} is truncated ({size} bytes, tensor {name!r} "
                            f"needs {data_start + end})")
    return Header(tensors=header, metadata=metadata, data_start=data_start)


def read_attn_header(path: str | os.PathLike, expected: str, what: str,
                     remedy: str = "") -> Header:
    """`read_header`, then the check that the file is of the attn format `expected`
    (formats.FORMAT_DESCRIPTIONS) in the version this attn reads: what every attn file goes
    through. A file of another kind is named as what it is; `remedy` ends the message."""
    header = read_header(path, what)
    description = FORMAT_DESCRIPTIONS[expected]
    found = header.metadata.get("format")
    if found != expected:
        kind = FORMAT_DESCRIPTIONS.get(found)
        detail = (f"is {kind}, not {description}" if kind else
                  f"is not {description} (no attn metadata)" if found is None else
                  f"is not {description} (its format is {found!r})")
        raise AttnError(f"{what} {path} {detail}{remedy}")
    version = header.metadata.get("format_version")
    if version != FORMAT_VERSIONS[expected]:
        raise AttnError(f"{what} {path} has format version {version}; this attn reads version "
                        f"{FORMAT_VERSIONS[expected]}{remedy}")
    return header


def memmap_tensor(path: str | os.PathLike, header: Header, name: str) -> np.ndarray:
    """A read-only, memory-mapped view of one tensor (nothing is read until it is touched)."""
    entry = header.tensors[name]
    begin, end = entry["data_offsets"]
    if NUMPY_DTYPES.get(entry["dtype"]) is None:  # bf16 and unknown names: numpy cannot map them
        raise AttnError(f"{path}: tensor {name!r} is {entry['dtype']}, which cannot be mapped "
                        "(attn data files hold integers)")
    dtype = np.dtype(NUMPY_DTYPES[entry["dtype"]]).newbyteorder("<")
    if end == begin:
        return np.zeros(entry["shape"], dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=header.data_start + begin,
                     shape=tuple(entry["shape"]))


@dataclass(frozen=True)
class TensorSource:
    """A tensor to write: raw little-endian bytes in a file (streamed) or in memory."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    file: Path | None = None
    data: bytes | None = None

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


def write_streaming(path: str | os.PathLike, tensors: list[TensorSource],
                    metadata: dict[str, str]) -> None:
    """Write a safetensors file atomically, copying each tensor's bytes from its source in
    fixed-size blocks. Tensors are laid out in the given order; put 8-byte dtypes first so that
    every tensor stays aligned for memory mapping."""
    header: dict = {"__metadata__": metadata}
    offset = 0
    for tensor in tensors:
        header[tensor.name] = {"dtype": DTYPE_NAMES[np.dtype(tensor.dtype)],
                               "shape": list(tensor.shape),
                               "data_offsets": [offset, offset + tensor.nbytes]}
        offset += tensor.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-(8 + len(encoded)) % 8)  # pad so the data starts 8-byte aligned
    with atomic_output(path) as out:
        out.write(struct.pack("<Q", len(encoded)))
        out.write(encoded)
        for tensor in tensors:
            if tensor.file is not None:
                with open(tensor.file, "rb") as source:
                    shutil.copyfileobj(source, out, 1 << 20)
            else:
                out.write(tensor.data)
