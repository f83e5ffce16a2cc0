"""Bearer tokens: admin calls need the admin token; generation needs the API token when one is set.

An operator may open control calls (pause, resume, abort, weight loads) to callers without a token
(`--control-auth none`): RL frameworks send none, and a deployment on a trusted network (a NetworkPolicy that
limits who reaches the pod) may choose that. The default stays the admin token.
"""

from __future__ import annotations

import hmac


class AuthError(Exception):
    """`missing` (no or wrong credentials: 401 / UNAUTHENTICATED) or disabled admin (403 / PERMISSION_DENIED)."""

    def __init__(self, message: str, *, denied: bool = False) -> None:
        super().__init__(message)
        self.denied = denied


def bearer(value: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header value, or None."""
    if not value:
        return None
    scheme, _, token = value.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


def _matches(token: str | None, expected: str | None) -> bool:
    return token is not None and expected is not None and hmac.compare_digest(token.encode(), expected.encode())


CONTROL_AUTH = ("token", "none")


def check_control_auth(value: str | None) -> str:
    value = (value or "token").lower()
    if value not in CONTROL_AUTH:
        raise ValueError(f"control auth must be one of {list(CONTROL_AUTH)}, got {value!r}")
    return value


class Auth:
    def __init__(self, admin_token: str | None = None, api_token: str | None = None,
                 control_auth: str = "token") -> None:
        self.admin_token = admin_token or None
        self.api_token = api_token or None
        self.control_auth = check_control_auth(control_auth)

    @property
    def control_open(self) -> bool:
        """Control calls need no token (the operator chose --control-auth none)."""
        return self.control_auth == "none"

    def check_admin(self, authorization: str | None) -> None:
        if self.control_open:
            return
        if self.admin_token is None:
            raise AuthError("admin calls are disabled: start the server with --admin-token "
                            "(or SPECROLL_ADMIN_TOKEN)", denied=True)
        token = bearer(authorization)
        if token is None:
            raise AuthError("this call needs the admin token: send 'Authorization: Bearer <admin token>'")
        if not _matches(token, self.admin_token):
            raise AuthError("the bearer token is not the admin token")

    def is_admin(self, authorization: str | None) -> bool:
        return self.control_open or _matches(bearer(authorization), self.admin_token)

    def check_api(self, authorization: str | None) -> None:
        if self.api_token is None:
            return
        token = bearer(authorization)
        if token is None:
            raise AuthError("generation needs a token: send 'Authorization: Bearer <api token>'")
        if not (_matches(token, self.api_token) or _matches(token, self.admin_token)):
            raise AuthError("the bearer token is not valid for generation")
