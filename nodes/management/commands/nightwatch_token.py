"""Issue, list, rotate and revoke API tokens. The raw token is printed once and never stored.

In the nodes app because an agent token names its node and a bootstrap token may name the node it
re-registers; people's and pipelines' tokens need only core, which nodes sits on."""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError
from django.db import transaction

from core.models import ApiToken, Scope
from nodes.models import Node
from nodes.services import issue_bootstrap_token


class Command(BaseCommand):
    help = "Manage API tokens: issue, list, rotate, revoke."

    def add_arguments(self, parser):
        sub = parser.add_subparsers(dest="action", required=True)
        issue = sub.add_parser("issue", help="Issue a token and print it once.")
        issue.add_argument("--name", required=True)
        # Job tokens are minted by launches only, bound to one generation.
        issue.add_argument("--scope", required=True, choices=[s for s in Scope.values if s != Scope.JOB])
        issue.add_argument("--user", help="Owner (required for viewer, ci, operator and oncall scopes).")
        issue.add_argument("--node", help="Node hostname (required for the agent scope; for the bootstrap scope: "
                                          "approve re-registering that existing node).")
        issue.add_argument("--hostname", help="Bootstrap scope: the only new host the token may register.")
        sub.add_parser("list", help="List tokens (never their values).")
        rotate = sub.add_parser("rotate", help="Revoke a token and issue its replacement.")
        rotate.add_argument("--name", required=True)
        revoke = sub.add_parser("revoke", help="Revoke a token.")
        revoke.add_argument("--name", required=True)

    def handle(self, action, **options):
        getattr(self, f"_{action}")(**options)

    @transaction.atomic
    def _issue(self, name, scope, user=None, node=None, hostname=None, **_):
        if scope == Scope.BOOTSTRAP:
            return self._issue_bootstrap(name, node, hostname)
        if hostname:
            raise CommandError("--hostname binds bootstrap tokens only")
        owner = node_row = None
        if scope in (Scope.VIEWER, Scope.CI, Scope.OPERATOR, Scope.ONCALL):
            if not user:
                raise CommandError(f"--user is required for scope {scope}: a token never outranks its owner")
            owner = get_user_model().objects.filter(username=user).first()
            if owner is None:
                raise CommandError(f"no user named {user!r}; create one with nightwatch_user")
        if scope == Scope.AGENT:
            node_row = Node.objects.filter(hostname=node).first() if node else None
            if node_row is None:
                raise CommandError("--node must name a registered node for scope agent")
        _, raw = ApiToken.issue(name=name, scope=scope, user=owner, node=node_row)
        self.stdout.write(raw)

    def _issue_bootstrap(self, name, node, hostname):
        """Single use, expiring after NIGHTWATCH["BOOTSTRAP_TOKEN_TTL_S"]; ``--node`` is the operator's
        approval to replace that node's agent (a re-imaged machine), audited on the node."""
        if node and hostname:
            raise CommandError("give --node (an existing node) or --hostname (a new host), not both")
        node_row = None
        if node:
            node_row = Node.objects.filter(hostname=node).first()
            if node_row is None:
                raise CommandError(f"no node named {node!r}; for a new host use --hostname")
        token, raw = issue_bootstrap_token(name=name, actor="system:nightwatch_token", hostname=hostname or "",
                                           node=node_row)
        self.stdout.write(raw)
        self.stderr.write(f"expires {token.expires_at:%Y-%m-%d %H:%M:%S %Z}; registers "
                          f"{repr(token.hostname) if token.hostname else 'any new host'}, once")

    def _list(self, **_):
        for token in ApiToken.objects.select_related("user", "node").order_by("name"):
            state = "revoked" if token.revoked_at else "active"
            owner = token.user.username if token.user else (token.node.hostname if token.node else "-")
            self.stdout.write(f"{token.name}\t{token.scope}\t{token.prefix}…\t{owner}\t{state}")

    def _active(self, name) -> ApiToken:
        token = ApiToken.objects.usable().filter(name=name).first()
        if token is None:
            raise CommandError(f"no active token named {name!r}")
        return token

    @transaction.atomic
    def _rotate(self, name, **_):
        old = self._active(name)
        if old.scope == Scope.JOB:
            raise CommandError("a job token is never rotated: it dies with its generation")
        old.revoke()
        _, raw = old.successor()  # every binding and the expiry kept
        self.stdout.write(raw)

    def _revoke(self, name, **_):
        self._active(name).revoke()
        self.stdout.write(f"revoked {name}")
