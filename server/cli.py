"""Control-plane commands, joined to `locojax` through the `locojax.commands` entry point:

  locojax serve                    run the API (embedded: SQLite, migrated at start, admin token on first start)
  locojax token create --scope S   print a new token once (scopes: submit, worker, admin)
  locojax token ls | revoke ID     list tokens (never their secrets) / revoke one
  locojax db upgrade               alembic upgrade head

These talk to the database directly (they are the operator's tools on the control-plane machine);
the REST client for users is `locojax.client`.
"""

from __future__ import annotations

from typing import Annotated

import typer

from server.settings import Settings, get_settings


def _database(settings: Settings):
    from server.db import Database, upgrade_to_head

    if settings.migrate_on_start:
        upgrade_to_head(settings.database_url)
    return Database(settings)


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
        # Printed once, to the terminal that started the server; only its hash is stored.
        typer.echo(f"Created an admin token (shown once): {secret}\n  export LOCOJAX_TOKEN={secret}", err=True)
    uvicorn.run(create_app(settings), host=host or settings.bind_host, port=port or settings.port,
                log_level=settings.log_level, proxy_headers=False)


token_app = typer.Typer(help="Create, list and revoke API tokens (stored hashed).", no_args_is_help=True)


@token_app.command("create")
def token_create(
    scope: Annotated[list[str], typer.Option("--scope", "-s", help="submit, worker or admin; repeat for several")],
    name: Annotated[str | None, typer.Option(help="a label to recognise the token by")] = None,
    expires_in_days: Annotated[float | None, typer.Option(min=0.0, help="expiry; default: never")] = None,
) -> None:
    """Create a token and print it once (stdout, nothing else there, so `$(locojax token create ...)` works)."""
    from server.services import tokens

    db = _database(get_settings())
    try:
        with db.write_session() as session:
            row, secret = tokens.create(session, name=name or "-".join(sorted(set(scope))), scopes=scope,
                                        expires_in_s=expires_in_days * 86400 if expires_in_days else None)
            typer.echo(f"token {row.id} ({row.name}, scopes: {row.scopes}) created; it is shown only now:", err=True)
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
        raise typer.Exit(1) from None
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


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)
    app.add_typer(token_app, name="token")
    app.add_typer(db_app, name="db")
