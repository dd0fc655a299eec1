"""Create or update a person and give them a role: ``nightwatch_user alice --role oncall``."""

from __future__ import annotations

import os

from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.core.management.base import BaseCommand, CommandError
from django.db import transaction

from core.roles import ROLE_PERMISSIONS, ensure_roles


class Command(BaseCommand):
    help = "Create or update a user with a role (viewer, operator, oncall)."

    def add_arguments(self, parser):
        parser.add_argument("username")
        parser.add_argument("--role", required=True, choices=sorted(ROLE_PERMISSIONS))
        parser.add_argument("--email", default="")
        parser.add_argument("--password-env", metavar="VAR",
                            help="Read the password from this environment variable (never from argv).")
        parser.add_argument("--staff", action="store_true", help="May log in to the admin site.")

    @transaction.atomic
    def handle(self, username, role, email, password_env, staff, **options):
        ensure_roles()
        password = None
        if password_env:
            password = os.environ.get(password_env)
            if not password:
                raise CommandError(f"environment variable {password_env} is empty or unset")
        user, created = get_user_model().objects.get_or_create(username=username, defaults={"email": email})
        if password:
            user.set_password(password)
        elif created:
            user.set_unusable_password()
        user.is_staff = staff or user.is_staff
        user.save()
        user.groups.remove(*Group.objects.filter(name__in=ROLE_PERMISSIONS))
        user.groups.add(Group.objects.get(name=role))
        self.stdout.write(f"{'created' if created else 'updated'} {username} with role {role}")
