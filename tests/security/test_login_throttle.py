"""Finding 9: no login throttling on ``/login/`` and ``/admin/login/`` (40 wrong passwords, then
the right one logged in).

Against the real server, with clients behind the trusted proxy: 40 wrong passwords for one user on
each form, then the right password is refused (429) while the lock lasts, from any address; another
user from another address signs in; one address guessing many user names is locked out too, and a
peer that is not a trusted proxy cannot dodge that by writing ``X-Forwarded-For``.
"""

from __future__ import annotations

import pytest

from tests.security.loopback import PROXY, TRUSTING_THE_PROXY, Peer

# A limit of 5 instead of 10: each failure below the limit is a real password hash on a busy machine.
LIMIT = 5
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300),
              pytest.mark.parametrize("cluster", [{**TRUSTING_THE_PROXY, "NIGHTWATCH_LOGIN_FAILURE_LIMIT": str(LIMIT)}],
                                      indirect=True, ids=["trusting-the-proxy"])]


#: form, the guessed account, someone else, and the network the clients of this form come from (the
#: first form's guesser is locked out by address afterwards, so the second one's comes from elsewhere)
FORMS = [("/login/", "alice", "bob", "198.51.100"), ("/admin/login/", "root", "admin2", "192.0.2")]


@pytest.fixture
def people(transactional_db):
    from django.contrib.auth.models import User

    for name in ("alice", "bob", "carol", "root", "admin2"):
        User.objects.create_user(name, password=f"{name}-password-1", is_staff=name in ("root", "admin2"))


def signed_in(answer) -> bool:
    return answer.status == 302 and any(c.startswith("sessionid=") for c in answer.headers.get_all("Set-Cookie") or [])


def test_forty_wrong_passwords_lock_the_account(cluster, people):
    for form, victim, other, net in FORMS:
        proxy = Peer(cluster.url, source=PROXY)
        try:
            answers = [proxy.sign_in(form, victim, f"guess-{n}", client=f"{net}.1").status for n in range(40)]
            assert answers == [200] * (LIMIT - 1) + [429] * (40 - LIMIT + 1), form
            locked = proxy.sign_in(form, victim, f"{victim}-password-1", client=f"{net}.1")
            assert locked.status == 429 and "Sign-in locked" in locked.text, form
            # The account is what is being guessed: locked from every address.
            assert proxy.sign_in(form, victim, f"{victim}-password-1", client=f"{net}.2").status == 429, form
            # Someone else, from elsewhere behind the same proxy, is not.
            assert signed_in(Peer(cluster.url, source=PROXY).sign_in(form, other, f"{other}-password-1",
                                                                      client=f"{net}.3")), form
        finally:
            proxy.close()


def test_one_address_guessing_user_names_is_locked_out(cluster, people):
    proxy, direct = Peer(cluster.url, source=PROXY), Peer(cluster.url)
    try:
        answers = [proxy.sign_in("/login/", f"user-{n}", "guess", client="198.51.100.9").status for n in range(LIMIT)]
        assert answers == [200] * (LIMIT - 1) + [429]
        assert proxy.sign_in("/login/", "carol", "carol-password-1", client="198.51.100.9").status == 429
        assert signed_in(Peer(cluster.url, source=PROXY).sign_in("/login/", "carol", "carol-password-1",
                                                                  client="198.51.100.10"))
        # From an untrusted peer, a new X-Forwarded-For per try is ignored: the peer's own address counts.
        answers = [direct.sign_in("/login/", f"other-{n}", "guess", client=f"203.0.113.{n}").status
                   for n in range(LIMIT)]
        assert answers == [200] * (LIMIT - 1) + [429]
        assert direct.sign_in("/login/", "bob", "bob-password-1", client="203.0.113.200").status == 429
    finally:
        proxy.close()
        direct.close()
