"""Who may touch what, beyond scopes (issue 17).

Scopes (`services.tokens.authorize`) say which kind of operation a token may call; this module says
which objects it may call it on:

* Run ownership (Kubernetes RBAC's owner vs admin): every token may read every run (a team
  dashboard), but only the token that submitted a run may cancel, resume or delete it; `admin` may
  act on any run.
* Host binding: a worker token acts as one host (its `hosts` is a name) or a family of hosts (a
  `prefix*`). It may register and heartbeat only such hosts, and report only for process rows of the
  current attempt that the scheduler placed on such a host.
"""

from __future__ import annotations

import re
from collections.abc import Collection

from server.errors import ForbiddenError, InvalidInputError
from server.models import ApiToken, Run

# A host binding: a host name (the HostName pattern) or a non-empty prefix of one followed by `*`.
HOST_BINDING = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,126}\*?$")


def is_admin(token: ApiToken) -> bool:
    return "admin" in token.scope_set


def may_act_on_run(scopes: Collection[str], token_id: int, run: Run) -> bool:
    """Whether the token with `token_id` and `scopes` may cancel, resume or delete `run`: it submitted
    the run, or it is an admin. Takes the token's parts, not the row, so the dashboard (which knows its
    viewer by id and scopes) asks this same rule."""
    return "admin" in scopes or (run.owner_token_id is not None and run.owner_token_id == token_id)


def check_may_act_on_run(scopes: Collection[str], token_id: int, run: Run, action: str) -> None:
    """403 RUN_NOT_OWNED unless the token submitted `run` or is an admin."""
    if not may_act_on_run(scopes, token_id, run):
        raise ForbiddenError(f"run {run.id} was submitted by another token; only it or an admin may {action} it",
                             code="RUN_NOT_OWNED", details={"run_id": run.id, "action": action})


def check_run_owner(token: ApiToken, run: Run, action: str) -> None:
    check_may_act_on_run(token.scope_set, token.id, run, action)


def check_host_binding(value: str | None, scopes: set[str] | frozenset[str]) -> str | None:
    """Validate the `hosts` of a new token: required for worker tokens, refused for any other."""
    if "worker" in scopes and "admin" not in scopes:
        if not value:
            raise InvalidInputError.for_field("hosts", "a worker token must be bound to a host name or a name "
                                                       "prefix ending in '*' (e.g. tpu-vm-3 or tpu-vm-*)",
                                              code="HOSTS_REQUIRED")
        if not HOST_BINDING.match(value):
            raise InvalidInputError.for_field("hosts", f"{value!r} is neither a host name nor a prefix ending in '*'")
        return value
    if value:
        raise InvalidInputError.for_field("hosts", "only worker tokens are bound to hosts")
    return None


def may_act_as_host(token: ApiToken, host_name: str) -> bool:
    """Admins act as any host (operators clean up by hand); a worker token only as its bound hosts."""
    if is_admin(token):
        return True
    binding = token.hosts
    if not binding:
        return False
    if binding.endswith("*"):
        return host_name.startswith(binding[:-1])
    return host_name == binding


def check_host(token: ApiToken, host_name: str) -> None:
    if not may_act_as_host(token, host_name):
        raise ForbiddenError(f"this token may not act as host {host_name!r} (it is bound to {token.hosts or 'no host'})",
                             code="HOST_NOT_BOUND", details={"host": host_name, "token_hosts": token.hosts})
