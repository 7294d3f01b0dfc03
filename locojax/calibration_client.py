"""`locojax calibration ...`: what the placement model learns from measured runs, over the REST API.

  locojax calibration import RUN_DIR...       add runs measured elsewhere (`locojax train` directories)
  locojax calibration ls [--hardware H]       observations, newest first, with each prediction's error
  locojax calibration versions [--hardware H] every calibration version; `*` marks the active one
  locojax calibration exclude|include ID      leave an observation out of the fits (or back in)
  locojax calibration activate ID             return to a calibration version

Importing, excluding and activating take an admin token: a calibration is shared by every user's
recommendations (`server/api/calibration.py`). Each run directory is read here
(`locojax.placement.calibration.observation_payload`: its spec, metrics and environment.json) and sent
as one observation; a directory that cannot be read is named with the file at fault, and nothing of it
is sent. Importing the same directory again is harmless (the server knows its digest).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from locojax.client import DEFAULT_URL, JsonOption, TokenOption, UrlOption, _call, _client
from locojax.contract import EXIT_SPEC_ERROR

calibration_app = typer.Typer(help="What the placement model learned from measured runs.", no_args_is_help=True)
HardwareOption = Annotated[str | None, typer.Option(help="only this hardware profile, e.g. tpu-v5e")]


def _error_text(observation: dict[str, Any]) -> str:
    error = observation.get("rel_error")
    return "-" if error is None else f"{error:+.1%}"


@calibration_app.command("import")
def import_runs(
    run_dirs: Annotated[list[Path], typer.Argument(metavar="RUN_DIR...", help="`locojax train` output directories")],
    url: UrlOption = DEFAULT_URL, token: TokenOption = None, as_json: JsonOption = False,
) -> None:
    """Add runs measured elsewhere (e.g. on a TPU VM without the control plane) as observations; each
    hardware's calibration is refitted with them."""
    from locojax.placement.calibration import observation_payload

    payloads = []
    for run_dir in run_dirs:  # every directory is read before anything is sent
        try:
            payloads.append(observation_payload(run_dir))
        except ValueError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(EXIT_SPEC_ERROR) from None
    results = []
    with _client(url, token) as client:
        for run_dir, payload in zip(run_dirs, payloads):
            result = _call(client.import_observation, payload)
            results.append(result)
            if as_json:
                continue
            observation, calibration = result["observation"], result["calibration"]
            state = "imported" if result["created"] else "already imported"
            version = f"; {observation['hardware']} calibration now v{calibration['version']}" if calibration else ""
            typer.echo(f"{run_dir}: {state} as observation {observation['id']} ({observation['hardware']}, "
                       f"step {observation['measured']['step_s']:.4g} s, predicted error "
                       f"{_error_text(observation)}){version}")
    if as_json:
        typer.echo(json.dumps(results, indent=2))


@calibration_app.command("ls")
def list_observations(url: UrlOption = DEFAULT_URL, token: TokenOption = None, as_json: JsonOption = False,
                      hardware: HardwareOption = None,
                      limit: Annotated[int, typer.Option(min=1, help="observations shown")] = 50) -> None:
    """Observations, newest first: where from, measured step, the prediction's error, excluded or not."""
    with _client(url, token) as client:
        page = _call(client.list_observations, hardware=hardware, limit=limit)
    if as_json:
        typer.echo(json.dumps(page["data"], indent=2))
        return
    for row in page["data"]:
        origin = f"run {row['run_id']}" if row["run_id"] is not None else f"import {row['label']}"
        excluded = "  EXCLUDED" if row["excluded_at"] else ""
        typer.echo(f"{row['id']:>6}  {row['hardware']:<10} {origin:<32} step {row['measured']['step_s']:>9.4g} s  "
                   f"error {_error_text(row):>7}  {row['measured_at'][:19]}{excluded}")


@calibration_app.command("versions")
def list_versions(url: UrlOption = DEFAULT_URL, token: TokenOption = None, as_json: JsonOption = False,
                  hardware: HardwareOption = None) -> None:
    """Calibration versions per hardware, newest first; `*` marks the active one."""
    with _client(url, token) as client:
        versions = _call(client.list_calibrations, hardware)["data"]
    if as_json:
        typer.echo(json.dumps(versions, indent=2))
        return
    for row in versions:
        after = (row["fit_error"].get("after") or {}).get("step")
        fit = f"fit error {after:.3f}" if after is not None else "catalog constants"
        typer.echo(f"{'*' if row['active'] else ' '} {row['id']:>5}  {row['hardware']:<10} v{row['version']:<4} "
                   f"{len(row['observation_ids']):>4} observation(s)  {fit}  {row['created_at'][:19]}")


def _set_excluded(observation_id: int, excluded: bool, url: str, token: str | None, as_json: bool) -> None:
    with _client(url, token) as client:
        row = _call(client.set_observation_excluded, observation_id, excluded)
    if as_json:
        typer.echo(json.dumps(row, indent=2))
    else:
        typer.echo(f"observation {row['id']} {'excluded from' if excluded else 'included in'} the "
                   f"{row['hardware']} fits")


@calibration_app.command("exclude")
def exclude(observation_id: int, url: UrlOption = DEFAULT_URL, token: TokenOption = None,
            as_json: JsonOption = False) -> None:
    """Leave an observation out of its hardware's calibration (admin)."""
    _set_excluded(observation_id, True, url, token, as_json)


@calibration_app.command("include")
def include(observation_id: int, url: UrlOption = DEFAULT_URL, token: TokenOption = None,
            as_json: JsonOption = False) -> None:
    """Take an excluded observation back into its hardware's calibration (admin)."""
    _set_excluded(observation_id, False, url, token, as_json)


@calibration_app.command("activate")
def activate(calibration_id: int, url: UrlOption = DEFAULT_URL, token: TokenOption = None,
             as_json: JsonOption = False) -> None:
    """Return to a calibration version (admin); it holds until its hardware's observations next change."""
    with _client(url, token) as client:
        row = _call(client.activate_calibration, calibration_id)
    if as_json:
        typer.echo(json.dumps(row, indent=2))
    else:
        typer.echo(f"{row['hardware']} calibration v{row['version']} is active")


def register(app: typer.Typer) -> None:
    app.add_typer(calibration_app, name="calibration")
