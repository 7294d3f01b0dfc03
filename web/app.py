"""`register(app, settings)`: the dashboard joins the API app through the `locojax.server_plugins`
entry point (pyproject.toml), so the API never imports it.

It adds the pages and partials (HTML, cookie sessions; not in the OpenAPI document) and `/static`
(our CSS and script, and the npm packages `make install` copies into `static/vendor/`).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles

from server.settings import Settings
from web.auth import LoginLimiter, signing_key
from web.routes import compare, hosts, new_run, placement, runs, session
from web.templating import STATIC_DIR, VENDOR_FILES

log = logging.getLogger("locojax.web")


def register(app: FastAPI, settings: Settings) -> None:
    app.state.dashboard_key = signing_key(settings)
    app.state.login_limiter = LoginLimiter(settings.login_failures_per_minute, window_s=60.0)
    missing = [name for name in VENDOR_FILES if not (STATIC_DIR / "vendor" / name).is_file()]
    if missing:
        # Pages still read fine without them (server-rendered); only live updates and charts need them.
        log.warning("dashboard: %s missing from web/static/vendor; run `make install`", ", ".join(missing))
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    for module in (session, runs, new_run, placement, compare, hosts):
        app.include_router(module.router)
