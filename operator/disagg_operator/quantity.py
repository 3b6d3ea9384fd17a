"""Kubernetes quantities ("40Gi", "500M", "1073741824") in bytes, and bytes as a quantity."""

import math
import re

GI = 2**30
MI = 2**20

_SUFFIXES = {"Ki": 2**10, "Mi": MI, "Gi": GI, "Ti": 2**40, "Pi": 2**50, "k": 10**3, "M": 10**6, "G": 10**9}
_SUFFIXES |= {"T": 10**12, "P": 10**15, "": 1}
_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|k|M|G|T|P|)$")


def to_bytes(quantity: str) -> int:
    """A Kubernetes storage quantity ("40Gi", "500G", "1073741824") in bytes."""
    m = _QUANTITY.match(str(quantity))
    if not m:
        raise ValueError(f"not a storage quantity: {quantity!r}")
    return math.ceil(float(m.group(1)) * _SUFFIXES[m.group(2)])


def mebibytes(n: int) -> str:
    """`n` bytes as a quantity, rounded up to a whole MiB (in Gi when that is whole)."""
    mi = math.ceil(n / MI)
    return f"{mi // 1024}Gi" if mi % 1024 == 0 else f"{mi}Mi"
