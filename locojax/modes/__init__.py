"""What a mode is, as one registered object per mode: `co`, `sc`, `da` (DESIGN §2) and `sft`.

A `ModeDef` carries everything the rest of the system needs to know about a mode:
  * its session (setup + step, run by the one loop of `locojax.runner`), named "module:Class" and
    imported on use, so this module stays jax-free: the scheduler, the worker and the web import it;
  * its process layout: how many hosts a run reserves and which engine processes start on them, and
    the `locojax` command line each of those processes runs (`command`, which the host worker asks);
  * how the CLI runs it in one process (devices that process owns, whether `locojax train` starts
    local host processes instead, whether it takes an operator's Ray cluster);
  * its spec validation (`validate`, called by RunSpec, so the CLI and the API refuse alike);
  * its cost-model entry: the name of its entry in `locojax.placement.cost_model.MODE_COSTS`
    (placement never imports modes; the cost functions live there and a mode names its own).

`mode_for(kind, mode)` picks the definition a spec runs under: `kind: sft` runs as the `sft` mode,
a GRPO spec as its `placement.mode`.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import TYPE_CHECKING, Callable, Sequence

from locojax.registry import Registry

if TYPE_CHECKING:  # RunSpec validation calls into here; the spec module imports this one
    from locojax.spec import PlacementSpec, RunSpec

# Roles of engine processes, as the control plane records them (server.models.HostRole has the values).
ROLE_CO = "co"  # colocated: rollout + reward + train on its host, one of a multi-controller job
ROLE_CONTROLLER = "controller"  # the one process of an SC, DA or SFT run (DA's driver places its actors)


ROLE_WORKER = "worker"  # SC: samples and trains its host's share as the controller says, one per host
# DA: the Ray node of one reserved host other than the driver's, in the run's train or rollout group
ROLE_TRAIN = "train"
ROLE_ROLLOUT = "rollout"


@dataclasses.dataclass(frozen=True)
class ProcessLayout:
    """What a run occupies: `hosts` reserved hosts, and one engine process per entry of `roles`,
    process i started on reserved host `host_of[i]` (by default host i)."""

    hosts: int
    roles: tuple[str, ...]
    host_of: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.host_of:
            object.__setattr__(self, "host_of", tuple(range(len(self.roles))))
        if len(self.host_of) != len(self.roles) or not all(0 <= h < self.hosts for h in self.host_of):
            raise ValueError(f"process layout {self.roles} on {self.host_of} does not fit {self.hosts} host(s)")


@dataclasses.dataclass(frozen=True)
class EngineStart:
    """What a host worker knows when it starts one engine process of a run (process `process_index` of
    `num_processes`, in the role the run's layout gave it); a mode's `command` makes its command line."""

    spec_path: str
    role: str
    process_index: int
    num_processes: int
    devices_per_host: int
    cancel_file: str
    coordinator: str | None = None  # the ADDR:PORT process 0 published; None in a run of one process
    resume: bool = False
    reward_modules: tuple[str, ...] = ()  # the operator's reward module prefixes
    secret_file: str | None = None  # the attempt's shared secret, a file only its user can read
    ray_address: str = ""  # the worker's operator Ray cluster; empty: none
    node_address: str = ""  # where the run's other hosts reach this one
    compilation_cache: str = ""  # the operator's compiled-program folder for the host; empty: the engine's default


def _no_placement_checks(placement: "PlacementSpec") -> str | None:
    return None


def _no_spec_checks(spec: "RunSpec") -> str | None:
    return None


def _all_hosts(placement: "PlacementSpec") -> int:
    return placement.hosts


@dataclasses.dataclass(frozen=True)
class ModeDef:
    name: str
    summary: str
    session: str  # "module:Class" of its ModeSession, imported on use (CO never pays for Ray)
    layout: Callable[["PlacementSpec"], ProcessLayout]
    # Devices the one process of `locojax train` owns (a multi-process mode counts one host's).
    local_devices: Callable[["PlacementSpec"], int]
    # The `locojax` subcommand and options a process of this mode's layout runs (the host worker starts
    # `python -m locojax.cli` with them).
    command: Callable[[EngineStart], list[str]]
    cost_entry: str | None = None  # its entry in locojax.placement.cost_model.MODE_COSTS; None: not costed
    # Mode-specific checks, each giving an error message or None: of the placement block alone (the
    # error names `placement`) and of the whole spec (after the placement's).
    validate_placement: Callable[["PlacementSpec"], str | None] = _no_placement_checks
    validate: Callable[["RunSpec"], str | None] = _no_spec_checks
    # The hosts that do rollout, each holding whole groups: prompts_per_step must divide among them.
    rollout_hosts: Callable[["PlacementSpec"], int] = _all_hosts
    rollout_groups: bool = False  # splits its hosts into rollout and train groups (placement.rollout_fraction)
    multi_process: bool = False  # `locojax train` on more than one host starts local host processes
    uses_ray: bool = False  # takes the operator's Ray cluster (`--ray-address`)
    evaluates: bool = False  # runs the spec's `eval:` block
    # Samples groups of completions to train on (GRPO); False: trains on the task's reference answers
    # (SFT: one row per prompt, no rollout, no KL reference). The memory plan and the trainer ask it.
    samples: bool = True
    # Its session can run the update's forward pass while the host scores (placement.early_forward).
    early_forward: bool = False

    def session_class(self):
        module_name, name = self.session.split(":")
        return getattr(importlib.import_module(module_name), name)


MODES: Registry[ModeDef] = Registry("mode")
# A spec's kind that runs as a mode of its own, whatever its placement.mode says.
KIND_MODES = {"sft": "sft"}


def mode_for(kind: str, mode: str) -> ModeDef:
    return MODES.get(KIND_MODES.get(kind, mode))


def spec_mode(spec: "RunSpec") -> ModeDef:
    return mode_for(spec.kind, spec.placement.mode)


def isolate_network(spec: "RunSpec", ray_address: str | None, head: str | None = None) -> None:
    """A run of a Ray mode that starts its own Ray re-executes itself first, since Ray 2.60 listens on
    every interface: a private Ray in a private network namespace (locojax.private_network); a DA
    driver whose reserved hosts join its head (`head`, its `--listen` ADDR:PORT) on the host's
    network, with every listener bound to the head's address (locojax.bind_address). An operator's
    Ray (`ray_address`) is theirs to secure."""
    if not spec_mode(spec).uses_ray or ray_address:
        return
    if head:
        from locojax.bind_address import reexecute_bound_to
        from locojax.link import split_address

        reexecute_bound_to(split_address(head)[0])
    else:
        from locojax.private_network import reexecute_inside

        reexecute_inside()


# ---------------------------------------------------------------------------------------------
# The modes


def _one_process_on_every_host(placement: "PlacementSpec") -> ProcessLayout:
    return ProcessLayout(placement.hosts, (ROLE_CO,) * placement.hosts)


def _controller_on_first_host(placement: "PlacementSpec") -> ProcessLayout:
    # SFT is one host: its one engine process starts on the first reserved host.
    return ProcessLayout(placement.hosts, (ROLE_CONTROLLER,))


def _controller_and_a_worker_per_host(placement: "PlacementSpec") -> ProcessLayout:
    # SC: process 0 is the controller on the first host (it starts that host's worker as its child,
    # since a host's worker runs one start message at a time); process h is host h's worker.
    return ProcessLayout(placement.hosts, (ROLE_CONTROLLER,) + (ROLE_WORKER,) * (placement.hosts - 1))


def _no_devices(placement: "PlacementSpec") -> int:
    return 1  # a process that holds no model still gets JAX's one CPU device


def _one_host(placement: "PlacementSpec") -> int:
    return placement.devices_per_host


def _every_host_in_one_process(placement: "PlacementSpec") -> int:
    return placement.hosts * placement.devices_per_host


def _da_driver_and_a_ray_node_per_host(placement: "PlacementSpec") -> ProcessLayout:
    # Process 0, the driver, starts the run's Ray head on the first reserved host (which is train
    # host 0, locojax.modes.da_cluster); every other reserved host runs one Ray node joining it, in
    # its group: the train hosts first, then the rollout hosts.
    train_hosts = placement.hosts - placement.rollout_hosts
    return ProcessLayout(placement.hosts, (ROLE_CONTROLLER,) + tuple(
        ROLE_TRAIN if host < train_hosts else ROLE_ROLLOUT for host in range(1, placement.hosts)))


def _engine_options(start: EngineStart) -> list[str]:
    """A process that decides its own steps: quiet, its cancel file, resume, the operator's reward modules
    and compilation cache."""
    options = ["--quiet", "--cancel-file", start.cancel_file] + (["--resume"] if start.resume else [])
    options += ["--reward-modules", ",".join(start.reward_modules)] if start.reward_modules else []
    return options + _cache_option(start)


def _cache_option(start: EngineStart) -> list[str]:
    return ["--compilation-cache", start.compilation_cache] if start.compilation_cache else []


def _secret_option(start: EngineStart) -> list[str]:
    return ["--secret-file", start.secret_file] if start.secret_file else []


def _controller_command(start: EngineStart, ray: Sequence[str] = ()) -> list[str]:
    # A controller of a multi-process run listens where it published itself (SC: for its workers; DA:
    # its Ray head, which the other hosts' nodes join).
    listen = ["--listen", start.coordinator] if start.coordinator else []
    return ["train", start.spec_path, *ray, *listen, *_secret_option(start), *_engine_options(start)]


def _co_command(start: EngineStart) -> list[str]:
    command = ["host", start.spec_path, "--process-id", str(start.process_index), "--num-processes",
               str(start.num_processes), "--devices-per-host", str(start.devices_per_host)]
    if start.coordinator:
        command += ["--coordinator", start.coordinator]
    return command + _engine_options(start)


def _sc_command(start: EngineStart) -> list[str]:
    if start.role == ROLE_CONTROLLER:
        return _controller_command(start)
    # An SC worker connects to its run's controller (process 0's published address); it scores nothing
    # and watches no cancel file: the controller decides both.
    assert start.coordinator is not None
    return ["sc-worker", start.spec_path, "--controller", start.coordinator, "--process-id", str(start.process_index),
            "--devices-per-host", str(start.devices_per_host), "--quiet", *_secret_option(start),
            *(["--resume"] if start.resume else []), *_cache_option(start)]


def _da_command(start: EngineStart) -> list[str]:
    ray = ["--ray-address", start.ray_address] if start.ray_address else []
    if start.role == ROLE_CONTROLLER:
        return _controller_command(start, ray)
    # A DA host's Ray node joins the head its run's driver (process 0) started where it published
    # itself, and advertises this worker's address; the driver decides when it ends.
    assert start.coordinator is not None
    return ["ray-node", start.spec_path, "--head", start.coordinator, "--node-address", start.node_address,
            "--process-id", str(start.process_index), *ray, *_secret_option(start)]


def _check_da_placement(placement: "PlacementSpec") -> str | None:
    if placement.hosts < 2:
        return "placement.hosts must be at least 2 in DA mode (one rollout and one train host)"
    fraction = placement.rollout_fraction if placement.rollout_fraction is not None else 0.5
    if not 1 <= placement.rollout_hosts <= placement.hosts - 1:
        return (f"placement.rollout_fraction {fraction} gives {placement.rollout_hosts} rollout hosts of "
                f"{placement.hosts}; both groups need at least one host")
    return None


def _da_rollout_hosts(placement: "PlacementSpec") -> int:
    return placement.rollout_hosts


def _check_sft(spec: "RunSpec") -> str | None:
    if spec.placement.hosts != 1:
        return f"placement.hosts must be 1 for an SFT run (kind 'sft' is single-host), got {spec.placement.hosts}"
    if spec.rollout.prompts_per_step % spec.placement.devices_per_host:
        return (f"rollout.prompts_per_step ({spec.rollout.prompts_per_step}) is the SFT batch and must be "
                f"divisible by placement.devices_per_host ({spec.placement.devices_per_host})")
    return None


MODES.register("co")(ModeDef(
    "co", "colocated: every host samples, scores and trains its own prompts; one SPMD train step",
    "locojax.modes.co:COSession", _one_process_on_every_host, _one_host, command=_co_command, cost_entry="co",
    multi_process=True, evaluates=True, early_forward=True))
MODES.register("sc")(ModeDef(
    "sc", "single controller: one process dispatches every host's work and gathers every rollout",
    "locojax.modes.sc:SCSession", _controller_and_a_worker_per_host, _no_devices, command=_sc_command,
    cost_entry="sc"))
MODES.register("da")(ModeDef(
    "da", "disaggregated: rollout and train host groups as Ray actors, overlapped (staleness <= 1)",
    "locojax.modes.da:DASession", _da_driver_and_a_ray_node_per_host, _every_host_in_one_process,
    command=_da_command, cost_entry="da", validate_placement=_check_da_placement, rollout_hosts=_da_rollout_hosts,
    rollout_groups=True, uses_ray=True))
MODES.register("sft")(ModeDef(
    "sft", "supervised warm start: teacher-forced updates on the task's reference answers, one host",
    "locojax.modes.sft:SFTSession", _controller_on_first_host, _one_host, command=_controller_command,
    validate=_check_sft, samples=False))
