"""Where an alert channel may connect, and connecting only there.

A channel's URL is chosen by an operator, but the request leaves from inside the control plane's
network: to loopback, RFC 1918, link-local (cloud metadata at 169.254.169.254) or any other
non-public address, it would be server-side request forgery. So:

1. the host is resolved, and *every* address it resolves to must be public — unless the host, or
   the network the address is in, is allow-listed (``NIGHTWATCH['ALERTS']['ALLOWED_NETWORKS']``);
2. IPv4 hidden inside IPv6 (mapped ``::ffff:a.b.c.d``, 6to4, NAT64) is judged as the IPv4 it
   carries; decimal, octal and hex spellings (``2130706433``, ``0177.0.0.1``) are resolved by the
   same ``getaddrinfo`` that connects, so they are judged as what they are;
3. the check runs when a channel is saved and again at every send, and the send connects to the
   very address that was checked (a DNS answer that changes between check and connect — DNS
   rebinding — cannot redirect it);
4. redirects are not followed, and nothing of the receiver's answer but its status is kept.
"""

from __future__ import annotations

import http.client
import ipaddress
import socket
import ssl
import urllib.parse
from dataclasses import dataclass

from django.conf import settings

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

#: Well-known prefix of NAT64 (RFC 6052): the last 32 bits are the IPv4 destination.
NAT64_PREFIX = ipaddress.IPv6Network("64:ff9b::/96")


class RefusedDestination(Exception):
    """The host resolves to an address a channel may not reach (the message says which kind, not
    the address: an operator learns nothing about the internal network from it)."""


@dataclass(frozen=True)
class AllowList:
    networks: tuple[IPNetwork, ...]
    hosts: frozenset[str]


def parse_allow_list(entries: list[str]) -> AllowList:
    """CIDRs (or single addresses) and host names; raises ValueError naming a bad entry."""
    networks, hosts = [], set()
    for entry in entries:
        try:
            networks.append(ipaddress.ip_network(entry, strict=False))
            continue
        except ValueError:
            pass
        name = entry.lower().rstrip(".")
        if not name or any(ch in name for ch in "/:@ ") or len(name) > 253:
            raise ValueError(f"{entry!r} is neither a network (CIDR) nor a host name")
        hosts.add(name)
    return AllowList(tuple(networks), frozenset(hosts))


def allow_list() -> AllowList:
    return parse_allow_list(settings.NIGHTWATCH["ALERTS"]["ALLOWED_NETWORKS"])


def _judged_as(address: IPAddress) -> list[IPAddress]:
    """The addresses ``address`` stands for. An IPv4-mapped or NAT64 address is the IPv4 it carries
    (the IPv6 prefix itself is "reserved", and DNS64 hands out NAT64 addresses for public hosts);
    a 6to4 or Teredo address is judged as itself and as the IPv4 inside."""
    if address.version == 4:
        return [address]
    if address.ipv4_mapped:
        return [address.ipv4_mapped]
    if address in NAT64_PREFIX:
        return [ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)]
    inside = [address.sixtofour, *(address.teredo or ())]
    return [a for a in inside if a is not None] + [address]


def _kind_of(address: IPAddress) -> str | None:
    """Why ``address`` is not a public unicast address, or None when it is."""
    checks = [("unspecified", address.is_unspecified), ("loopback", address.is_loopback),
              ("link-local", address.is_link_local), ("multicast", address.is_multicast),
              ("private", address.is_private), ("reserved", address.is_reserved),
              ("site-local", getattr(address, "is_site_local", False)), ("non-public", not address.is_global)]
    return next((kind for kind, hit in checks if hit), None)


def refused_kind(address: IPAddress, allowed: AllowList) -> str | None:
    """The kind of non-public address ``address`` is (or carries), unless it (or the IPv4 it
    carries) is in an allow-listed network."""
    candidates = _judged_as(address)
    if any(c in net for c in candidates for net in allowed.networks if net.version == c.version):
        return None
    return next((kind for kind in map(_kind_of, candidates) if kind), None)


def resolve(host: str, port: int) -> list[tuple[int, tuple]]:
    """Every (family, sockaddr) ``host`` resolves to, each checked; raises RefusedDestination when
    any one is refused (a name with one public and one private address could be steered to the
    private one), socket.gaierror when it does not resolve."""
    allowed, name = allow_list(), host.lower().rstrip(".")  # "localhost." is "localhost"
    infos = socket.getaddrinfo(name, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    if not infos:
        raise socket.gaierror(socket.EAI_NONAME, "no address")
    if name in allowed.hosts:
        return [(family, sockaddr) for family, _, _, _, sockaddr in infos]
    for _, _, _, _, sockaddr in infos:
        kind = refused_kind(ipaddress.ip_address(sockaddr[0].split("%", 1)[0]), allowed)
        if kind:
            raise RefusedDestination(f"the host resolves to a {kind} address, which alert channels may not "
                                     f"reach (allow-list it in NIGHTWATCH_ALERT_ALLOWED_NETWORKS if intended)")
    return [(family, sockaddr) for family, _, _, _, sockaddr in infos]


def destination_problem(url: str) -> str | None:
    """Why a channel may not be saved with ``url`` (a well-formed http(s) URL), or None. A name that
    does not resolve now is accepted: the check at send time is the one that counts."""
    parts = urllib.parse.urlsplit(url)
    try:
        resolve(parts.hostname, parts.port or default_port(parts.scheme))
    except RefusedDestination as exc:
        return str(exc)
    except (OSError, UnicodeError, ValueError):
        return None
    return None


def default_port(scheme: str) -> int:
    return 443 if scheme == "https" else 80


def _connect(addresses: list[tuple[int, tuple]], timeout: float) -> socket.socket:
    """A TCP connection to the first checked address that answers."""
    error: OSError = OSError("no address to connect to")
    for family, sockaddr in addresses:
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(sockaddr)
            return sock
        except OSError as exc:
            sock.close()
            error = exc
    raise error


class _PinnedHTTPConnection(http.client.HTTPConnection):
    """Connects to the addresses checked, not to whatever the name resolves to by then."""

    def __init__(self, host: str, port: int, *, addresses, timeout: float):
        super().__init__(host, port, timeout=timeout)
        self.addresses = addresses

    def connect(self) -> None:
        self.sock = _connect(self.addresses, self.timeout)


class _PinnedHTTPSConnection(http.client.HTTPSConnection):
    """As above, with TLS verified against the host name of the URL (not the address)."""

    def __init__(self, host: str, port: int, *, addresses, timeout: float):
        super().__init__(host, port, timeout=timeout, context=ssl.create_default_context())
        self.addresses = addresses

    def connect(self) -> None:
        self.sock = self._context.wrap_socket(_connect(self.addresses, self.timeout), server_hostname=self.host)


def post(url: str, body: bytes, headers: dict[str, str], *, timeout: float) -> int:
    """POST ``body`` to ``url`` through a checked, pinned connection; returns the HTTP status and
    nothing else of the answer. Raises RefusedDestination, OSError or http.client.HTTPException."""
    parts = urllib.parse.urlsplit(url)
    port = parts.port or default_port(parts.scheme)
    addresses = resolve(parts.hostname, port)
    connection_class = _PinnedHTTPSConnection if parts.scheme == "https" else _PinnedHTTPConnection
    connection = connection_class(parts.hostname, port, addresses=addresses, timeout=timeout)
    target = urllib.parse.urlunsplit(("", "", parts.path or "/", parts.query, ""))
    try:
        connection.request("POST", target, body=body, headers=headers)
        return connection.getresponse().status
    finally:
        connection.close()
