"""Bandwidths, latencies and sizes as people write them, parsed in one place.

Inside ``whatif.topology`` every quantity has one unit, named in the variable: bandwidths in
bytes per microsecond (``bandwidth_bytes_per_us``; 1 GB/s = 1000 bytes/us, 10 Gbps = 1250
bytes/us), latencies and durations in microseconds (``latency_us``), sizes in bytes. Text from a
YAML file or a command line becomes those units here and nowhere else.

Bandwidths need a unit, because a bare ``10`` could be bits or bytes, per second or per
microsecond. A lowercase ``b`` means bits and an uppercase ``B`` bytes (``10Gbps``, ``10 Gb/s``
and ``1.25GB/s`` are the same); ``25GbE`` is 25 Gbps of Ethernet. Prefixes are decimal (``k``,
``M``, ``G``, ``T``, in either case, since nobody means milli-bits) unless written binary
(``GiB/s``). Latencies take ``ns``, ``us``, ``µs``, ``ms`` or ``s``; a bare ``0`` is fine. Sizes
take ``B``, ``KB``, ``MB``, ``GB``, ``TB`` or ``KiB``... ``TiB``; a plain number is bytes.
"""

from __future__ import annotations

import difflib
import math
import re
from typing import Union

Number = Union[int, float]


class TopologyError(ValueError):
    """A cluster or unit description that cannot be used; ``str`` is one line naming the key."""

    def __init__(self, key: str, message: str):
        self.key = key
        self.message = message
        super().__init__(f"{key}: {message}" if key else message)


BYTES_PER_US_PER_GBPS = 1e9 / 8 / 1e6  # 125 bytes/us in 1 Gbit/s
BYTES_PER_US_PER_GBYTE_PER_S = 1e9 / 1e6  # 1000 bytes/us in 1 GB/s


def gbps(gigabits_per_s: float) -> float:
    """Bytes per microsecond in ``gigabits_per_s`` Gbit/s."""
    return gigabits_per_s * BYTES_PER_US_PER_GBPS


def mbps(megabits_per_s: float) -> float:
    """Bytes per microsecond in ``megabits_per_s`` Mbit/s."""
    return megabits_per_s * BYTES_PER_US_PER_GBPS / 1e3


def gigabytes_per_s(gigabytes: float) -> float:
    """Bytes per microsecond in ``gigabytes`` GB/s."""
    return gigabytes * BYTES_PER_US_PER_GBYTE_PER_S


def as_gbps(bandwidth_bytes_per_us: float) -> float:
    """Gbit/s in ``bandwidth_bytes_per_us``."""
    return bandwidth_bytes_per_us / BYTES_PER_US_PER_GBPS


def as_gigabytes_per_s(bandwidth_bytes_per_us: float) -> float:
    """GB/s in ``bandwidth_bytes_per_us``."""
    return bandwidth_bytes_per_us / BYTES_PER_US_PER_GBYTE_PER_S


_NUMBER = r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?"
_QUANTITY = re.compile(rf"^\s*({_NUMBER})\s*(.*?)\s*$")
_DECIMAL = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_BINARY = {"ki": 2.0**10, "mi": 2.0**20, "gi": 2.0**30, "ti": 2.0**40}
_RATE = re.compile(r"^(?P<prefix>[kKmMgGtT]i?)?(?P<base>[bB]its?|[bB]ytes?|b|B)(?P<per>ps|PS|Ps|/s|/sec)$")
_SIZE = re.compile(r"^(?P<prefix>[kKmMgGtT]i?)?(?P<base>[bB]its?|[bB]ytes?|b|B)$")
_ETHERNET = {"gbe": 1e9, "gige": 1e9, "ge": 1e9, "mbe": 1e6}
_TIME_US = {"ns": 1e-3, "us": 1.0, "µs": 1.0, "μs": 1.0, "usec": 1.0, "ms": 1e3, "msec": 1e3, "s": 1e6, "sec": 1e6}

_BANDWIDTH_UNITS = ["bps", "Kbps", "Mbps", "Gbps", "Tbps", "Gb/s", "B/s", "KB/s", "MB/s", "GB/s", "TB/s", "GiB/s", "GbE"]
_SIZE_UNITS = ["B", "KB", "MB", "GB", "TB", "KiB", "MiB", "GiB", "TiB"]


def _split(value, key: str, example: str) -> tuple[float, str]:
    """The number and the unit text of ``value`` (a string or a number)."""
    if isinstance(value, bool):
        raise TopologyError(key, f"expected a quantity like {example}, got {value!r}")
    if isinstance(value, (int, float)):
        number, unit = float(value), ""
    elif isinstance(value, str):
        match = _QUANTITY.match(value)
        if not match:
            raise TopologyError(key, f"{value!r} is not a number with a unit; write e.g. {example}")
        number, unit = float(match.group(1)), match.group(2).replace(" ", "")
    else:
        raise TopologyError(key, f"expected a quantity like {example}, got {type(value).__name__} {value!r}")
    if not math.isfinite(number):
        raise TopologyError(key, f"{value!r} is not a finite number")
    return number, unit


def _prefix_factor(prefix: str) -> float:
    prefix = (prefix or "").lower()
    return _BINARY[prefix] if prefix.endswith("i") else _DECIMAL[prefix]


def _is_bits(base: str) -> bool:
    return base == "b" or base.lower().startswith("bit")


def _unknown_unit(key: str, value, unit: str, known: list, example: str) -> TopologyError:
    close = difflib.get_close_matches(unit, known, n=3, cutoff=0.5)
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    return TopologyError(key, f"unknown unit {unit!r} in {str(value)!r}{hint}; write e.g. {example}")


def parse_bandwidth(value, key: str = "bandwidth") -> float:
    """Bytes per microsecond in a bandwidth such as ``10Gbps``, ``25GbE`` or ``12.5 GB/s``."""
    example = "10Gbps"
    number, unit = _split(value, key, example)
    if not unit:
        raise TopologyError(key, f"{str(value)!r} has no unit; write e.g. {number:g}Gbps")
    if unit.lower() in _ETHERNET:
        bits_per_s = number * _ETHERNET[unit.lower()]
        bytes_per_s = bits_per_s / 8
    else:
        match = _RATE.match(unit)
        if not match:
            raise _unknown_unit(key, value, unit, _BANDWIDTH_UNITS, example)
        per_s = number * _prefix_factor(match.group("prefix"))
        bytes_per_s = per_s / 8 if _is_bits(match.group("base")) else per_s
    if bytes_per_s <= 0:
        raise TopologyError(key, f"bandwidth must be positive, got {str(value)!r}")
    return bytes_per_s / 1e6


def parse_latency(value, key: str = "latency") -> float:
    """Microseconds in a duration such as ``5us``, ``5 µs``, ``2.5 ms``, ``100ns`` or ``0`` (a
    link's latency, Horovod's cycle time or its loop's time per cycle)."""
    number, unit = _split(value, key, "5us")
    if not unit:
        if number != 0:
            raise TopologyError(key, f"{str(value)!r} has no unit; write e.g. {number:g}us")
        return 0.0
    factor = _TIME_US.get(unit) or _TIME_US.get(unit.lower())
    if factor is None:
        raise _unknown_unit(key, value, unit, ["ns", "us", "µs", "ms", "s"], "5us")
    if number < 0:
        raise TopologyError(key, f"a duration must not be negative, got {str(value)!r}")
    return number * factor


def parse_size(value, key: str = "size") -> float:
    """Bytes in a size such as ``25MB``, ``64 MiB`` or ``1.5 GB``; a plain number is bytes."""
    number, unit = _split(value, key, "25MB")
    if unit:
        match = _SIZE.match(unit)
        if not match:
            raise _unknown_unit(key, value, unit, _SIZE_UNITS, "25MB")
        number *= _prefix_factor(match.group("prefix"))
        if _is_bits(match.group("base")):
            number /= 8
    if number < 0:
        raise TopologyError(key, f"size must not be negative, got {str(value)!r}")
    return number


def parse_fraction(value, key: str = "efficiency") -> float:
    """A number in (0, 1], written as ``0.9`` or ``90%``."""
    text = value.strip() if isinstance(value, str) else None
    try:
        if isinstance(value, bool):
            raise ValueError
        number = float(text[:-1]) / 100 if text is not None and text.endswith("%") else float(value)
    except (TypeError, ValueError):
        raise TopologyError(key, f"expected a fraction in (0, 1] such as 0.9 or 90%, got {value!r}") from None
    if not (0 < number <= 1):
        raise TopologyError(key, f"must be in (0, 1], got {value!r}")
    return number


def format_bandwidth(bandwidth_bytes_per_us: float) -> str:
    """``'12.5 GB/s (100 Gbps)'`` for a bandwidth in bytes per microsecond."""
    return f"{as_gigabytes_per_s(bandwidth_bytes_per_us):.4g} GB/s ({as_gbps(bandwidth_bytes_per_us):.4g} Gbps)"


def format_duration(duration_us: float) -> str:
    """``'3.4 us'``, ``'12.1 ms'`` or ``'2.5 s'``."""
    if abs(duration_us) >= 1e6:
        return f"{duration_us / 1e6:.4g} s"
    if abs(duration_us) >= 1e3:
        return f"{duration_us / 1e3:.4g} ms"
    return f"{duration_us:.4g} us"


def format_size(nbytes: float) -> str:
    """``'100 MB'`` (decimal prefixes, as bandwidths use)."""
    for factor, unit in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "KB")):
        if abs(nbytes) >= factor:
            return f"{nbytes / factor:.4g} {unit}"
    return f"{nbytes:.4g} B"
