"""The errors a mode's run raises for the CLI to report as one line: `locojax train` prints the message
and exits EXIT_FAILED, no traceback. They live here, not in the modes' own files, so the CLI and every
mode name them without importing any mode's implementation."""


class ModeRunError(RuntimeError):
    """A process of a run failed; the message names which one and in which phase."""


class DAError(ModeRunError):
    """A host of a DA run failed; the message names the host and the phase."""


class SCError(ModeRunError):
    """A worker of an SC run failed; the message names the worker, its host and the phase."""
