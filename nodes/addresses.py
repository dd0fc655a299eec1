"""Is a node's address one that peers and the control plane can reach? Pure: no I/O, no Django.

The address goes into every launch as the rendezvous host (``MASTER_ADDR``) and into the
bandwidth probe's peer list; a value with a port, a scheme or a space leaves every job placed on
the node pending, so registration refuses it rather than storing it.
"""

from __future__ import annotations

import ipaddress
import re

#: One RFC 1123 label: letters, digits and inner hyphens, 1 to 63 characters.
_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")
MAX_HOSTNAME = 253


def address_problem(value: str) -> str | None:
    """Why ``value`` is not an IP address (v4 or v6) or a DNS host name, or None when it is one."""
    if not value:
        return "is empty: give the node's IP address or DNS host name"
    if ":" in value or value.replace(".", "").isdigit():
        return _ip_problem(value)
    return _hostname_problem(value)


def _ip_problem(value: str) -> str | None:
    try:
        ip = ipaddress.ip_address(value)
    except ValueError:
        return (f"{value!r} is not an IP address (a bare address: no port, no brackets, no scheme) "
                "nor a DNS host name")
    if ip.is_unspecified or ip.is_multicast:
        return f"{value!r} is not an address peers can connect to"
    if isinstance(ip, ipaddress.IPv6Address) and ip.scope_id:
        return f"{value!r} names an interface of the node itself (zone index): peers cannot use it"
    return None


def _hostname_problem(value: str) -> str | None:
    labels = value.split(".")
    if len(value) > MAX_HOSTNAME or not all(_LABEL.fullmatch(label) for label in labels):
        return (f"{value!r} is not a DNS host name (letters, digits and hyphens in dot-separated labels of "
                "at most 63 characters; no port, scheme, path or spaces) nor an IP address")
    return None
