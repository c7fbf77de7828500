"""Byte sizes, one convention: powers of 1024 with IEC names (KiB, MiB, GiB), both ways, and
the bytes per element of the torch dtype names params.yaml uses."""
from __future__ import annotations

GiB = 1024 ** 3
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
_PARSE = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50}


def human(n: float | None) -> str:
    """'17.8 MiB' for 18,664,448; '-' for None."""
    if n is None:
        return "-"
    for unit in _UNITS:
        if abs(n) < 1024 or unit == _UNITS[-1]:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def parse_size(text: str) -> int:
    """A byte count: 500000000, 500M, 50G, 1.5T, 50GiB (powers of 1024); ValueError otherwise."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = t[-1] if t and t[-1] in _PARSE else ""
    try:
        n = float(t[:len(t) - len(unit)])
    except ValueError:
        n = -1.0
    if not n >= 0:
        raise ValueError(f"{text!r} is not a size (e.g. 500M, 50G)")
    return int(n * _PARSE[unit])
