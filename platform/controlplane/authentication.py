"""Staff authentication for the REST API that console users cannot use.

A console user signs in with a password and a TOTP code and acts within a role (console.roles). Accepting that
user's password alone (HTTP Basic) or the console's session cookie on the REST API, where staff may do everything,
would bypass both; so these refuse them (the request is then unauthenticated: 401/403 as for anyone). Platform
administrators without a console role authenticate as before.
"""

from __future__ import annotations

from drf_spectacular.authentication import BasicScheme, SessionScheme
from rest_framework.authentication import BasicAuthentication, SessionAuthentication
from rest_framework.exceptions import AuthenticationFailed

from console import access, roles


class NonConsoleSessionAuthentication(SessionAuthentication):
    def authenticate(self, request):
        if request._request.session.get(access.SESSION_FLAG):
            return None
        result = super().authenticate(request)
        if result is not None and roles.has_console_role(result[0]) and not result[0].is_superuser:
            return None
        return result


class NonConsoleBasicAuthentication(BasicAuthentication):
    def authenticate_credentials(self, userid, password, request=None):
        user, auth = super().authenticate_credentials(userid, password, request)
        if roles.has_console_role(user) and not user.is_superuser:
            raise AuthenticationFailed("Console users sign in to the console, not the API.")
        return user, auth


class NonConsoleSessionScheme(SessionScheme):
    """The published schema keeps naming these as the cookie and basic schemes they narrow."""

    target_class = "controlplane.authentication.NonConsoleSessionAuthentication"


class NonConsoleBasicScheme(BasicScheme):
    target_class = "controlplane.authentication.NonConsoleBasicAuthentication"
