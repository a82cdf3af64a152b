"""Figures written for people: bytes as KiB/MiB/GiB, seconds as ms/s/min/h, rates with
thousands separators, fractions as percents, and no float with more digits than a
reader can use (``3363856.0`` bytes is "3.2 MiB")."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

MIB = 2 ** 20
_BINARY_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
_DECIMAL_PREFIXES = ((15, "P"), (12, "T"), (9, "G"), (6, "M"), (3, "k"))


def _short(x: float) -> str:
    """``x`` (>= 0, < 1000) with three significant digits at most: 3.21, 68.3, 441."""
    if x >= 99.95:
        return f"{x:.0f}"
    return f"{x:.1f}" if x >= 9.995 else f"{x:.2f}".rstrip("0").rstrip(".")


def format_bytes(n: float) -> str:
    """``3363856`` -> "3.2 MiB", ``1.5e9`` -> "1.4 GiB" (binary units, as memory is)."""
    size, unit = abs(float(n)), 0
    while size >= 1000 and unit < len(_BINARY_UNITS) - 1:
        size, unit = size / 1024, unit + 1
    sign = "-" if n < 0 else ""
    text = f"{size:.0f}" if unit == 0 else (f"{size:.1f}" if size < 100 else f"{size:.0f}")
    return f"{sign}{text} {_BINARY_UNITS[unit]}"


def format_mib(mib: float) -> str:
    """A figure recorded in MiB (``mem_peak_mb``, ``memory_mb``), as :func:`format_bytes`."""
    return format_bytes(mib * MIB)


def format_seconds(s: float) -> str:
    """``0.85`` -> "850 ms", ``2.43`` -> "2.4 s", ``245`` -> "4 min 05 s",
    ``3790`` -> "1 h 03 min"."""
    if s < 0.9995e-3:
        return f"{_short(max(s, 0.0) * 1e6)} µs"
    if s < 0.9995:
        return f"{_short(s * 1e3)} ms"
    if s < 59.95:
        return f"{s:.1f} s"
    if s < 3599.5:
        minutes, secs = divmod(round(s), 60)
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(round(s / 60), 60)
    return f"{hours} h {minutes:02d} min"


def format_si(x: float, unit: str) -> str:
    """Decimal prefixes, three significant digits: ``4.38e10, "FLOP/s"`` ->
    "43.8 GFLOP/s"."""
    sign, size = "-" if x < 0 else "", abs(x)
    for power, prefix in _DECIMAL_PREFIXES:
        if size >= 0.9995 * 10 ** power:
            return f"{sign}{_short(size / 10 ** power)} {prefix}{unit}"
    return f"{sign}{_short(size)} {unit}"


def format_rate(x: float, unit: str) -> str:
    """``7634.5, "tokens/s"`` -> "7,635 tokens/s"; below 100, three significant digits."""
    return f"{x:,.0f} {unit}" if abs(x) >= 99.95 else f"{_short(abs(x))} {unit}"


def format_percent(fraction: float) -> str:
    """``0.7648`` -> "76.5%"."""
    return f"{fraction * 100:.1f}%"


def format_count(n: float) -> str:
    """An integer count with thousands separators: ``840960`` -> "840,960"."""
    return f"{round(n):,}"


def format_loss(x: float) -> str:
    return f"{x:.4f}" if math.isfinite(x) else str(x)


def format_number(x: Any) -> str:
    """Any JSON number for a reader: integers grouped, other floats to four
    significant digits (thousands and above to the unit)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return str(x)
    if isinstance(x, int) or (math.isfinite(x) and x.is_integer() and abs(x) < 1e15):
        return format_count(x)
    if not math.isfinite(x):
        return str(x)
    return f"{x:,.0f}" if abs(x) >= 999.95 else f"{x:.4g}"


# A summary key's unit, read from how it ends (disttrain's naming convention).
_BY_SUFFIX = (("_bytes_per_step", format_bytes), ("_bytes", format_bytes),
              ("_mb", format_mib), ("_per_s", lambda x: format_rate(x, "/s")),
              ("_s", format_seconds), ("_ratio", lambda x: f"{x:.3g}×"),
              ("_loss", format_loss))


def format_value(key: str, value: Any) -> str:
    """A summary value disttrain has no dedicated card for: its unit from the key's
    ending, a dict as "part value" pairs, a list joined (long ones as a range)."""
    if value is None:
        return "–"
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, Mapping):
        # the parts take the whole's unit: memory_bytes {"params": ...} are bytes
        return ", ".join(f"{humanise(k).lower()} {format_value(key, v)}"
                         for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return _format_list(key, list(value))
    for suffix, fmt in _BY_SUFFIX:
        if key.endswith(suffix) and isinstance(value, (int, float)) and math.isfinite(value):
            return fmt(value)
    return format_number(value)


def _format_list(key: str, values: list[Any]) -> str:
    if len(values) <= 8:
        return ", ".join(format_value(key, v) for v in values)
    numbers = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if len(numbers) < len(values):
        return f"{len(values)} values"
    return (f"{len(values)} values, {format_value(key, min(numbers))} to "
            f"{format_value(key, max(numbers))}")


def humanise(key: str) -> str:
    """``fed_clients_per_round`` -> "Fed clients per round"."""
    text = str(key).replace("_", " ").strip()
    return text[:1].upper() + text[1:]
