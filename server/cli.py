"""Control-plane commands, joined to `locojax` through the `locojax.commands` entry point:

  locojax serve                    run the API (embedded: SQLite, migrated at start, admin token on first start)
  locojax token create --scope S   print a new token once (scopes: submit, worker, admin; worker tokens need --hosts NAME or PREFIX*)
  locojax token ls | revoke ID     list tokens (never their secrets) / revoke one
  locojax db upgrade               alembic upgrade head

These talk to the database directly (they are the operator's tools on the control-plane machine);
the REST client for users is `locojax.client`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from locojax.contract import EXIT_FAILED

if TYPE_CHECKING:
    from server.settings import Settings


def get_settings() -> "Settings":
    """The operator's settings, imported when a command runs: `locojax` registers these commands in every
    process it starts, engine hosts included, which need none of pydantic-settings (see locojax/client.py)."""
    from server import settings

    return settings.get_settings()


def _database(settings: Settings):
    from server.db import Database, upgrade_to_head

    if settings.migrate_on_start:
        upgrade_to_head(settings.database_url)
    return Database(settings)


def write_bootstrap_token(settings: Settings, secret: str):
    """Write the first admin token to `<home>/bootstrap-admin-token`, mode 0600 from its creation."""
    import os
    from pathlib import Path

    home = Path(settings.home)
    home.mkdir(parents=True, exist_ok=True)
    path = home / "bootstrap-admin-token"
    path.unlink(missing_ok=True)  # O_EXCL below: never write into a file someone else prepared
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
        handle.write(secret + "\n")
    return path


def serve(
    host: Annotated[str | None, typer.Option(help="bind address (default: LOCOJAX_BIND_HOST or 127.0.0.1)")] = None,
    port: Annotated[int | None, typer.Option(help="port (default: LOCOJAX_PORT or 8000)")] = None,
) -> None:
    """Run the control-plane API with uvicorn."""
    import uvicorn

    from server.app import create_app
    from server.services import tokens

    settings = get_settings()
    db = _database(settings)
    with db.write_session() as session:
        secret = tokens.ensure_admin(session)
    db.dispose()
    if secret:
        # Never to the log (a server's stderr is collected by its supervisor): once, to a file only this
        # user can read; only the token's hash is stored in the database.
        path = write_bootstrap_token(settings, secret)
        typer.echo(f"Created an admin token; it is in {path} (readable by this user only; delete it once read)",
                   err=True)
    uvicorn.run(create_app(settings), host=host or settings.bind_host, port=port or settings.port,
                log_level=settings.log_level, proxy_headers=False, timeout_keep_alive=settings.keep_alive_s)


token_app = typer.Typer(help="Create, list and revoke API tokens (stored hashed).", no_args_is_help=True)


@token_app.command("create")
def token_create(
    scope: Annotated[list[str], typer.Option("--scope", "-s", help="submit, worker or admin; repeat for several")],
    name: Annotated[str | None, typer.Option(help="a label to recognise the token by")] = None,
    expires_in_days: Annotated[float | None, typer.Option(min=0.0, help="expiry; default: never")] = None,
    hosts: Annotated[str | None, typer.Option(help="worker tokens: the host name, or a name prefix ending in '*', "
                                                   "this token may act as")] = None,
) -> None:
    """Create a token and print it once (stdout, nothing else there, so `$(locojax token create ...)` works)."""
    from server.errors import InvalidInputError
    from server.services import tokens

    db = _database(get_settings())
    try:
        with db.write_session() as session:
            row, secret = tokens.create(session, name=name or "-".join(sorted(set(scope))), scopes=scope,
                                        expires_in_s=expires_in_days * 86400 if expires_in_days else None,
                                        hosts=hosts)
            bound = f", hosts: {row.hosts}" if row.hosts else ""
            typer.echo(f"token {row.id} ({row.name}, scopes: {row.scopes}{bound}) created; it is shown only now:",
                       err=True)
    except InvalidInputError as exc:
        raise typer.BadParameter(exc.message, param_hint="--hosts") from None
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--scope") from None
    finally:
        db.dispose()
    typer.echo(secret)


@token_app.command("ls")
def token_list() -> None:
    """List tokens: id, name, prefix, scopes, state."""
    from server.services import tokens

    db = _database(get_settings())
    with db.read_session() as session:
        for row in tokens.list_all(session):
            state = "active" if tokens.is_active(row) else ("revoked" if row.revoked_at else "expired")
            expires = row.expires_at.isoformat(timespec="seconds") if row.expires_at else "never"
            typer.echo(f"{row.id:>4}  {row.name:<24} {row.prefix}…  {row.scopes:<20} {state:<8} expires {expires}")
    db.dispose()


@token_app.command("revoke")
def token_revoke(token_id: int) -> None:
    """Revoke a token by id; requests with it fail with 401 from then on."""
    from server.errors import NotFoundError
    from server.services import tokens

    db = _database(get_settings())
    try:
        with db.write_session() as session:
            tokens.revoke(session, token_id)
    except NotFoundError as exc:
        typer.echo(exc.message, err=True)
        raise typer.Exit(EXIT_FAILED) from None
    finally:
        db.dispose()
    typer.echo(f"token {token_id} revoked")


db_app = typer.Typer(help="Database schema (Alembic).", no_args_is_help=True)


@db_app.command("upgrade")
def db_upgrade() -> None:
    """Apply every migration (alembic upgrade head) to LOCOJAX_DATABASE_URL."""
    from server.db import upgrade_to_head

    upgrade_to_head(get_settings().database_url)
    typer.echo("database schema is at head")


def up(
    hosts: Annotated[int, typer.Option(min=1, max=64, help="local host workers (simulated hosts) to start")] = 2,
    port: Annotated[int | None, typer.Option(help="API and dashboard port (default: LOCOJAX_PORT or 8000)")] = None,
    devices_per_host: Annotated[int, typer.Option(min=1, help="CPU devices each host simulates")] = 1,
    demo: Annotated[bool, typer.Option("--demo", help="submit the demo (SFT warm start, then GRPO on arith)")] = False,
    exit_when_done: Annotated[bool, typer.Option("--exit-when-done", help="with --demo: stop once the demo ends")] = False,
) -> None:
    """Start the embedded control plane: API + dashboard, scheduler and HOSTS local workers, on SQLite
    with no server to install. Ctrl-C stops everything."""
    import signal
    import threading

    from server.embedded import run_demo, start

    settings = get_settings()
    port = port or settings.port
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    typer.echo(f"starting the API and {hosts} host worker(s) (logs: {settings.home / 'logs'}) ...", err=True)
    try:
        plane = start(settings, hosts=hosts, port=port, devices_per_host=devices_per_host)
    except RuntimeError as exc:
        typer.secho(f"locojax up: {exc}; see {settings.home / 'logs'}", fg="red", err=True)
        raise typer.Exit(EXIT_FAILED) from None
    try:
        typer.echo(f"\nLoCoJAX control plane is up\n"
                   f"  dashboard  {plane.url}/\n"
                   f"  API docs   {plane.url}/docs\n"
                   f"  hosts      {', '.join(plane.host_names)}\n"
                   f"  token      {plane.admin_token}\n"
                   f"             (export LOCOJAX_URL={plane.url} LOCOJAX_TOKEN={plane.admin_token})\n"
                   f"Ctrl-C stops everything.\n")
        if demo:
            run_demo(plane, stop, echo=typer.echo)
            if exit_when_done:
                return
        stop.wait()
    finally:
        typer.echo("stopping workers and the API ...", err=True)
        plane.stop()


def register(app: typer.Typer) -> None:
    app.command("up")(up)
    app.command("serve")(serve)
    app.add_typer(token_app, name="token")
    app.add_typer(db_app, name="db")
