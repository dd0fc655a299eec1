"""OpenAPI description of Nightwatch's bearer tokens (loaded by drf-spectacular)."""

from drf_spectacular.extensions import OpenApiAuthenticationExtension


class BearerTokenScheme(OpenApiAuthenticationExtension):
    target_class = "controlplane.auth.TokenAuthentication"
    name = "bearerToken"

    def get_security_definition(self, auto_schema):
        return {
            "type": "http",
            "scheme": "bearer",
            "description": "An API token (`nw_…`) with scope viewer, ci, operator, oncall, agent or bootstrap. "
            "Issue one with `manage.py nightwatch_token issue`.",
        }
