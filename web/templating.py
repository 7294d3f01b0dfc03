"""The Jinja2 environment of the dashboard: where templates live, the filters they format numbers and
times with, and `render`, which every route answers through.

Templates come in two kinds: pages (`runs.html`), and one partial per htmx swap target (`_run_header.html`).
A page includes its partials, so the first paint and every later swap come from the same markup.
"""

from __future__ import annotations

import math
from datetime import datetime
from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.templating import Jinja2Templates
from starlette.responses import Response

from server.models import TERMINAL_STATES, RunStatus, utcnow

WEB_DIR = Path(__file__).resolve().parent
TEMPLATES_DIR = WEB_DIR / "templates"
STATIC_DIR = WEB_DIR / "static"
# What `make install` copies out of node_modules (see package.json); the pages load these.
VENDOR_FILES = ("htmx.min.js", "uPlot.iife.min.js", "uPlot.min.css")


def is_htmx(request: Request) -> bool:
    """An htmx request that wants a fragment. A boosted link, or htmx restoring a page of its history
    that fell out of its cache, wants the whole page."""
    headers = request.headers
    return (headers.get("HX-Request") == "true" and headers.get("HX-Boosted") != "true"
            and headers.get("HX-History-Restore-Request") != "true")


def is_terminal(status: RunStatus | str) -> bool:
    return RunStatus(status) in TERMINAL_STATES


def number(value: float | int | None, digits: int = 4) -> str:
    """A metric value for people: 4 significant digits, thousands separated, no exponent for ordinary sizes."""
    if value is None:
        return "–"
    if isinstance(value, int):
        return f"{value:,}"
    if not math.isfinite(value):
        return str(value)
    if value == 0:
        return "0"
    magnitude = abs(value)
    if 1e-3 <= magnitude < 1e6:
        decimals = max(0, digits - 1 - math.floor(math.log10(magnitude)))
        text = f"{value:,.{decimals}f}"
        return text.rstrip("0").rstrip(".") if "." in text else text
    return f"{value:.{digits - 1}e}"


def seconds(value: float | None) -> str:
    """A step time: milliseconds below a second, so 0.0172 reads as 17.2 ms."""
    if value is None:
        return "–"
    if abs(value) < 1:
        return f"{number(value * 1000, 3)} ms"
    return f"{number(value, 3)} s"


def duration(total: float | None) -> str:
    if total is None:
        return "–"
    total = max(0, int(total))
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h {minutes:02d}m"
    if minutes:
        return f"{minutes}m {secs:02d}s"
    return f"{secs}s"


def timestamp(value: datetime | None) -> str:
    return value.strftime("%Y-%m-%d %H:%M:%S UTC") if value else "–"


def age(value: datetime | None, now: datetime | None = None) -> str:
    if value is None:
        return "–"
    return duration(((now or utcnow()) - value).total_seconds()) + " ago"


def percent(part: float, whole: float) -> float:
    """Width of a bar segment in percent; negative or missing parts draw nothing."""
    if not whole or whole <= 0 or part is None or part <= 0:
        return 0.0
    return round(min(100.0, 100.0 * part / whole), 2)


def _common_context(request: Request) -> dict[str, Any]:
    settings = request.app.state.settings
    viewer = getattr(request.state, "viewer", None)
    web_session = getattr(request.state, "web_session", None)
    return {
        "viewer": viewer,
        "csrf_token": web_session.csrf if web_session is not None else "",
        "poll_s": settings.dashboard_poll_s,
    }


templates = Jinja2Templates(directory=str(TEMPLATES_DIR), context_processors=[_common_context])
templates.env.filters.update(number=number, seconds=seconds, duration=duration, timestamp=timestamp, age=age)
templates.env.globals.update(is_terminal=is_terminal, percent=percent)
templates.env.trim_blocks = True
templates.env.lstrip_blocks = True


def render(request: Request, template: str, /, status_code: int = 200, headers: dict[str, str] | None = None,
           **context: Any) -> Response:
    return templates.TemplateResponse(request, template, context, status_code=status_code, headers=headers)
