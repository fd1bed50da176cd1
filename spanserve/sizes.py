"""Byte sizes as people write them: the one parser every option that takes a size uses."""
from __future__ import annotations

import re

_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_size(text: str) -> int:
    """Bytes from '1073741824', '512MiB', '2G', '1.5GB' (SI without i, binary with i)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*", text.lower())
    if m is None:
        raise ValueError(f"not a size: {text!r}; use bytes or a unit like 512MiB or 2GB")
    return int(float(m.group(1)) * _UNITS[m.group(2) or ""])
