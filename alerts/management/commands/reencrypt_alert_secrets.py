"""Rewrite alert channel secrets under the first NIGHTWATCH_SECRETS_KEY (after setting or rotating it)."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from alerts import services


class Command(BaseCommand):
    help = "Re-encrypt every alert channel secret with the first key of NIGHTWATCH_SECRETS_KEY."

    def handle(self, **options):
        rewritten, unreadable = services.reencrypt_secrets()
        self.stdout.write(f"{rewritten} channel secret(s) re-encrypted")
        if unreadable:
            raise CommandError("no configured key opens the secret of: " + ", ".join(unreadable)
                               + " (set those secrets again)")
