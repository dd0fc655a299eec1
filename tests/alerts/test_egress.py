"""Where channels may connect (alerts.channels.egress): non-public destinations refused at save and
at send, allow-lists, the send pinned to the checked address, redirects not followed."""

from __future__ import annotations

import ipaddress
import socket

import pytest

from alerts.channels import base, egress
from alerts.channels.egress import AllowList, parse_allow_list, refused_kind
from alerts.models import Channel

pytestmark = pytest.mark.django_db

CHANNELS = "/api/v1/alert-channels"
NOTHING_ALLOWED = AllowList((), frozenset())


@pytest.mark.parametrize("address, kind", [
    ("127.0.0.1", "loopback"), ("127.8.9.10", "loopback"), ("::1", "loopback"),
    ("10.1.2.3", "private"), ("172.16.0.1", "private"), ("192.168.1.1", "private"), ("fd00::1", "private"),
    ("169.254.169.254", "link-local"), ("fe80::1", "link-local"),
    ("224.0.0.1", "multicast"), ("ff02::1", "multicast"),
    ("0.0.0.0", "unspecified"), ("::", "unspecified"),
    ("240.0.0.1", "private"), ("100.64.0.1", "non-public"),
    ("::ffff:127.0.0.1", "loopback"), ("::ffff:169.254.169.254", "link-local"),
    ("2002:7f00:1::", "loopback"),  # 6to4 of 127.0.0.1
    ("64:ff9b::a00:1", "private"),  # NAT64 of 10.0.0.1
    ("2001:0:4136:e378:8000:63bf:3fff:fdd2", "private"),  # Teredo
    ("1.1.1.1", None), ("2606:4700:4700::1111", None), ("64:ff9b::101:101", None),
])
def test_every_kind_of_non_public_address_is_refused(address, kind):
    assert refused_kind(ipaddress.ip_address(address), NOTHING_ALLOWED) == kind


def test_an_allow_listed_network_covers_its_addresses_and_their_mapped_forms():
    allowed = parse_allow_list(["127.0.0.1/32", "10.20.0.0/16"])
    assert refused_kind(ipaddress.ip_address("127.0.0.1"), allowed) is None
    assert refused_kind(ipaddress.ip_address("::ffff:127.0.0.1"), allowed) is None
    assert refused_kind(ipaddress.ip_address("10.20.3.4"), allowed) is None
    assert refused_kind(ipaddress.ip_address("10.21.0.1"), allowed) == "private"
    assert refused_kind(ipaddress.ip_address("127.0.0.2"), allowed) == "loopback"


def test_a_bad_allow_list_entry_fails_the_system_check(settings):
    from alerts.checks import alert_egress_and_secrets

    with pytest.raises(ValueError, match="neither"):
        parse_allow_list(["10.0.0.0/8", "http://x/"])
    settings.NIGHTWATCH = {**settings.NIGHTWATCH, "ALERTS": {**settings.NIGHTWATCH["ALERTS"],
                                                             "ALLOWED_NETWORKS": ["10.0.0.0/33"]}}
    assert [c.id for c in alert_egress_and_secrets()] == ["nightwatch.alerts.E007"]


@pytest.mark.parametrize("url", [
    "https://127.0.0.1/hook", "http://127.0.0.1:8080/hook", "https://10.0.0.5/x", "https://169.254.169.254/latest",
    "https://[::1]/x", "https://[::ffff:127.0.0.1]/x", "https://localhost/x", "https://LOCALHOST./x",
    "https://2130706433/x", "https://0177.0.0.1/x", "https://0x7f.1/x", "https://0/x",
])
def test_a_channel_aimed_at_the_control_planes_own_network_is_refused_naming_the_url(cast, api, url):
    for kind, extra in (("webhook", {}), ("pagerduty", {"secret": "R" * 20})):
        answer = api(cast.tokens["operator"]).post(CHANNELS, {"name": "x", "kind": kind, "url": url, **extra},
                                                   format="json")
        assert answer.status_code == 400, answer.content
        [error] = answer.json()["errors"]
        assert error["field"] == "url" and "may not reach" in error["reason"]
    assert not Channel.objects.exists()


def test_moving_an_existing_channel_to_loopback_is_refused(cast, api):
    channel = Channel.objects.create(name="h", kind="webhook", url="https://93.184.216.34/x", secret="a" * 20)
    answer = api(cast.tokens["operator"]).patch(f"{CHANNELS}/{channel.pk}", {"url": "http://127.0.0.1:9/x"},
                                                format="json")
    assert answer.status_code == 400 and answer.json()["errors"][0]["field"] == "url"
    channel.refresh_from_db()
    assert channel.url == "https://93.184.216.34/x"


def fake_dns(monkeypatch, answers: list[str]) -> list[str]:
    """getaddrinfo answers ``answers`` in turn (a name whose DNS record changes); returns the
    names looked up."""
    asked, real = [], socket.getaddrinfo

    def getaddrinfo(host, port, *args, **kwargs):
        if host != "hooks.example":
            return real(host, port, *args, **kwargs)
        asked.append(host)
        address = answers[min(len(asked), len(answers)) - 1]
        return [(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (address, port))]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return asked


def test_a_name_that_rebinds_to_loopback_after_saving_is_refused_at_send(cast, api, receiver, monkeypatch):
    """Public when the channel is saved, loopback when it sends: nothing reaches the receiver."""
    port = receiver.server.server_address[1]
    asked = fake_dns(monkeypatch, ["93.184.216.34", "127.0.0.1"])
    created = api(cast.tokens["operator"]).post(CHANNELS, {"name": "h", "kind": "webhook",
                                                           "url": f"http://hooks.example:{port}/hook"},
                                                format="json")
    assert created.status_code == 201, created.content
    outcome = base.post_json(f"http://hooks.example:{port}/hook", b"{}", {})
    assert not outcome.ok and outcome.permanent and outcome.error.startswith("RefusedDestination: ")
    assert "127.0.0.1" not in outcome.error
    assert len(asked) == 2 and receiver.requests == []


def test_the_send_connects_to_the_address_it_checked(receiver, monkeypatch, alert_settings):
    """Resolved once: a second lookup (which could answer something else) never happens."""
    port = receiver.server.server_address[1]
    asked = fake_dns(monkeypatch, ["127.0.0.1", "169.254.169.254"])
    outcome = base.post_json(f"http://hooks.example:{port}/hook", b'{"a":1}', {"X-Test": "1"})
    assert outcome.ok and outcome.status_code == 200
    assert len(asked) == 1
    [got] = receiver.at("/hook")
    assert got.body == b'{"a":1}' and got.headers["Host"] == f"hooks.example:{port}"


def test_an_allow_listed_host_name_may_resolve_anywhere(receiver, settings):
    settings.NIGHTWATCH = {**settings.NIGHTWATCH, "ALERTS": {**settings.NIGHTWATCH["ALERTS"],
                                                             "ALLOWED_NETWORKS": ["LocalHost"]}}
    port = receiver.server.server_address[1]
    assert egress.destination_problem(f"http://localhost:{port}/hook") is None
    assert not base.post_json(f"http://127.0.0.1:{port}/hook", b"{}", {}).ok  # the name, not the address


def test_a_redirect_is_not_followed_and_the_answer_is_not_kept(receiver, alert_settings):
    receiver.statuses = [302, 500]
    first = base.post_json(receiver.url("/hook"), b"{}", {})
    assert (first.ok, first.status_code, first.permanent, first.error) == (False, 302, True, "HTTP 302")
    second = base.post_json(receiver.url("/hook"), b"{}", {})
    assert (second.ok, second.status_code, second.permanent, second.error) == (False, 500, False, "HTTP 500")
    assert len(receiver.requests) == 2


def test_a_connection_error_is_reported_by_its_class(alert_settings):
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    outcome = base.post_json(f"http://127.0.0.1:{port}/x", b"{}", {})
    assert not outcome.ok and not outcome.permanent
    assert outcome.error == "ConnectionRefusedError: Connection refused"
