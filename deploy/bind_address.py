"""Which addresses the cluster's sockets may bind: rules written as allow-lists.

A deny-list of wildcard spellings ("0.0.0.0", "::", "*") misses the others the C library accepts:
"0", "0x0", "0.0" and "000.0.0.0" all bind every interface (inet_aton's legacy forms). So an
internal address is accepted only when it is an IP literal in its canonical form (Python's
`ipaddress`, which refuses the legacy forms) naming one interface, or a DNS name whose last label
starts with a letter (RFC 1123/3696: a name never ends in a number, which is what makes "0x0" an
address and not a name).
"""

from __future__ import annotations

import ipaddress
import re

_HOSTNAME = re.compile(r"(?=.{1,253}$)([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.)*[A-Za-z]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host.strip().removeprefix("[").removesuffix("]"))
    except ValueError:
        return None


def is_one_interface(host: str) -> bool:
    """`host` names one interface: a canonical unicast IP literal, or a DNS name (never a wildcard)."""
    ip = _ip(host)
    if ip is not None:
        return not (ip.is_unspecified or ip.is_multicast)
    return _HOSTNAME.fullmatch(host) is not None


def is_loopback(host: str) -> bool:
    """Only this machine can connect: a loopback IP literal, or "localhost"."""
    ip = _ip(host)
    return ip.is_loopback if ip is not None else host.strip().lower() == "localhost"
