"""Errors the services raise and the API renders as `{"error": {"code", "message", "details"}}`.

Services raise these instead of HTTP exceptions so they stay usable from the CLI and the workers'
control-plane tasks; each class carries the status code it maps to, and `code` is a stable
machine-readable string (clients switch on it, never on the message).
"""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    status_code = 400
    code = "BAD_REQUEST"

    def __init__(self, message: str, *, code: str | None = None, details: Any = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        self.details = details
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"code": self.code, "message": self.message, "details": self.details}}


class TooManyRequestsError(ApiError):
    status_code = 429
    code = "TOO_MANY_REQUESTS"


class NotFoundError(ApiError):
    status_code = 404
    code = "NOT_FOUND"


class ConflictError(ApiError):
    status_code = 409
    code = "CONFLICT"


class InvalidInputError(ApiError):
    """422 with `details` listing `{"field": "spec.task.path", "message": ...}` entries."""

    status_code = 422
    code = "VALIDATION_ERROR"

    @classmethod
    def for_field(cls, field: str, message: str, *, code: str = "VALIDATION_ERROR") -> "InvalidInputError":
        return cls(f"{field}: {message}", code=code, details=[{"field": field, "message": message}])


class AuthenticationError(ApiError):
    status_code = 401
    code = "AUTH_REQUIRED"

    def __init__(self, message: str, *, code: str | None = None, details: Any = None):
        super().__init__(message, code=code, details=details, headers={"WWW-Authenticate": "Bearer"})


class ForbiddenError(ApiError):
    status_code = 403
    code = "FORBIDDEN"


class UnavailableError(ApiError):
    status_code = 503
    code = "UNAVAILABLE"


class IllegalTransitionError(ConflictError):
    """A run state change the state machine does not allow; raised before anything is written."""

    code = "ILLEGAL_TRANSITION"

    def __init__(self, run_id: int, current: str, target: str, allowed: list[str]):
        super().__init__(
            f"run {run_id} cannot go from {current} to {target}",
            details={"run_id": run_id, "from": current, "to": target, "allowed": allowed},
        )
        self.current = current
        self.target = target
