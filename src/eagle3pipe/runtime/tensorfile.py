"""The one reader of safetensors headers: tensor names, dtypes and shapes without loading a
tensor, whatever the file's size (8 bytes little-endian header length, then a JSON object),
checked as safetensors itself checks it before reading any tensor (safetensors/src/tensor.rs,
Metadata::validate) and against the file's size (a truncated file is an error).
"""
from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

from eagle3pipe.errors import Error

# bytes per element of each safetensors dtype name
SAFETENSORS_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4, "I16": 2,
                     "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1,
                     "F8_E5M2": 1}
MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit on the JSON header
REREAD = "re-download or re-save the file"


@dataclass(frozen=True)
class Header:
    raw: bytes  # the 8-byte length and the JSON header as stored (what a fingerprint hashes)
    tensors: dict[str, tuple[str, tuple[int, ...]]]  # name -> (dtype, shape)
    data_bytes: int  # the data section's length


def read_header(path: str | Path, *, error: type[Error] = Error, fix: str = REREAD) -> Header:
    """The header of the safetensors file `path`; every defect raises `error` naming the file
    (and the tensor) with `fix`."""
    try:
        size = Path(path).stat().st_size
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) != 8:
                raise error(f"{path}: not a safetensors file (shorter than 8 bytes)", fix)
            (n,) = struct.unpack("<Q", head)
            if n > min(MAX_HEADER_BYTES, size - 8):
                raise error(f"{path}: not a safetensors file (header length {n}, file size "
                            f"{size}: corrupt or truncated)", fix)
            raw = fh.read(n)
    except OSError as e:
        raise error(f"{path}: cannot read it ({e.strerror})", fix) from None
    try:
        meta = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise error(f"{path}: not a safetensors file (header: not UTF-8 at byte "
                    f"{8 + e.start})", fix) from None
    except (ValueError, RecursionError) as e:
        raise error(f"{path}: not a safetensors file (header: {e})", fix) from None
    tensors, end = _entries(meta, path, error, fix)
    if 8 + n + end > size:
        raise error(f"{path}: truncated: its header puts tensor data up to byte {8 + n + end}, "
                    f"the file has {size}", fix)
    if 8 + n + end < size:
        raise error(f"{path}: {size - 8 - n - end} bytes after the last tensor's data "
                    "(safetensors refuses such a file)", fix)
    return Header(head + raw, tensors, end)


def _entries(meta, path, error, fix) -> tuple[dict[str, tuple[str, tuple[int, ...]]], int]:
    """({tensor: (dtype, shape)}, bytes of tensor data) of a parsed header: known dtypes, shapes
    of non-negative integers, [begin, end] offsets that hold exactly shape x dtype bytes and
    tile the data section from byte 0 without gap or overlap, string __metadata__."""
    def bad(what: str) -> Error:
        return error(f"{path}: not a safetensors file (header: {what})", fix)

    def naturals(v) -> bool:
        return isinstance(v, list) and all(
            isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v)

    if not isinstance(meta, dict):
        kind = {list: "array", str: "string", int: "number", float: "number"}.get(type(meta))
        raise bad(f"a JSON {kind or 'value'}, not an object")
    extra = meta.get("__metadata__", {})
    if not isinstance(extra, dict) or not all(isinstance(v, str) for v in extra.values()):
        raise bad(f"__metadata__ {json.dumps(extra)[:60]} is not a map of strings")
    out, spans = {}, []
    for name, v in meta.items():
        if name == "__metadata__":
            continue
        if not isinstance(v, dict) or not {"dtype", "shape", "data_offsets"} <= set(v):
            raise bad(f"tensor {name}: {json.dumps(v)[:60]} lacks dtype, shape or data_offsets")
        dt, shape, offsets = v["dtype"], v["shape"], v["data_offsets"]
        if dt not in SAFETENSORS_BYTES:
            raise bad(f"tensor {name}: dtype {dt!r} is not one of {', '.join(SAFETENSORS_BYTES)}")
        if not naturals(shape):
            raise bad(f"tensor {name}: shape {json.dumps(shape)[:40]} is not a list of "
                      "non-negative integers")
        if not naturals(offsets) or len(offsets) != 2 or offsets[0] > offsets[1]:
            raise bad(f"tensor {name}: data_offsets {json.dumps(offsets)[:40]} are not "
                      "[begin, end] with 0 <= begin <= end")
        need = math.prod(shape) * SAFETENSORS_BYTES[dt]
        if offsets[1] - offsets[0] != need:
            raise bad(f"tensor {name}: data_offsets {offsets} hold {offsets[1] - offsets[0]} "
                      f"bytes, its shape {shape} in {dt} needs {need}")
        out[name] = (dt, tuple(shape))
        spans.append((offsets[0], offsets[1], name))
    end = 0
    for begin, stop, name in sorted(spans):
        if begin != end:
            raise bad(f"tensor {name}: its data starts at byte {begin} of the data section, "
                      f"the previous tensor's ends at {end} (a gap or an overlap)")
        end = stop
    return out, end
