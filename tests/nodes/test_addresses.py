"""``nodes.addresses``: what a node may register as the address peers and the control plane reach."""

from __future__ import annotations

import pytest

from nodes.addresses import address_problem


@pytest.mark.parametrize("address", ["10.0.0.9", "127.0.0.1", "fd00::1", "::1", "gpu-01", "GPU-01",
                                     "gpu-01.dc1.example.com", "1gpu", "a" * 63 + ".example.com"])
def test_ip_addresses_and_dns_host_names_are_accepted(address):
    assert address_problem(address) is None


@pytest.mark.parametrize(("address", "says"), [
    ("", "empty"),
    ("10.0.0.9:29500", "not an IP address"),  # a port
    ("gpu-01:29500", "not an IP address"),
    ("http://gpu-01", "not an IP address"),  # a scheme
    ("[fd00::1]", "not an IP address"),  # brackets are URL syntax, not an address
    ("gpu 01", "not a DNS host name"),
    (" gpu-01", "not a DNS host name"),
    ("gpu-01\n", "not a DNS host name"),
    ("gpu-01/x", "not a DNS host name"),
    ("-gpu", "not a DNS host name"),
    ("gpu-", "not a DNS host name"),
    ("gpu_01", "not a DNS host name"),
    ("gpu..example.com", "not a DNS host name"),
    ("gpu-01.", "not a DNS host name"),
    ("a" * 64, "not a DNS host name"),
    (".".join(["a" * 63] * 4), "not a DNS host name"),  # 255 characters
    ("gpü-01", "not a DNS host name"),
    ("1.2.3", "not an IP address"),  # all digits: never a host name, and not a whole IPv4 address
    ("999.0.0.1", "not an IP address"),
    ("0.0.0.0", "not an address peers can connect to"),
    ("::", "not an address peers can connect to"),
    ("224.0.0.1", "not an address peers can connect to"),
    ("fe80::1%eth0", "zone index"),
])
def test_anything_else_is_refused_with_the_reason(address, says):
    assert says in address_problem(address)
