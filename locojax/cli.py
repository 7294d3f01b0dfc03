"""The `locojax` command line.

Engine commands are registered here from the engine's own modules. Control-plane commands (`up`,
`token`, ...) live in the `server`/`worker` packages and join through the `locojax.commands` entry-point
group, so the engine never imports the control plane. Heavy imports (JAX) happen inside commands, so
`locojax --help` and the REST client stay fast.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points

import typer

app = typer.Typer(
    name="locojax",
    help="LoCoJAX: host-local coordination for small-model RL. Train GRPO policies in CO/DA/SC modes, "
    "ask the placement model which mode wins, and run the control plane.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# Each module exposes `register(app: typer.Typer) -> None`.
ENGINE_COMMAND_MODULES = [
    "locojax.commands",
    "locojax.placement.commands",
    "locojax.client",
    "locojax.calibration_client",
    "locojax.export_metrics",
]


def _register_all() -> None:
    for module_name in ENGINE_COMMAND_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:  # that part of the engine is not there yet
                continue
            raise
        module.register(app)
    for entry in entry_points(group="locojax.commands"):
        try:
            register = entry.load()
        except ModuleNotFoundError as exc:
            if exc.name and entry.module.startswith(exc.name):  # plugin package not installed here
                continue
            raise
        register(app)


_register_all()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
