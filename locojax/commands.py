"""Engine commands of the `locojax` CLI: train, host, launch, sft, eval, demo.

JAX is imported inside each command: the number of CPU devices per process must be set before JAX
starts, and `locojax --help` should not pay for it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional, Sequence

import typer
from pydantic import ValidationError

from locojax.spec import EvalSpec, RunSpec, SpecError, load_spec, parse_spec

from locojax.compilation_cache import cache_from_every_process
from locojax.contract import CHECKPOINTS_DIR, EXIT_CANCELLED, EXIT_FAILED, EXIT_SPEC_ERROR, EngineStatus, validation_message
from locojax.modes import spec_mode

SpecArg = typer.Argument(..., exists=False, help="run spec (YAML); see examples/")


def _load(path: Path) -> RunSpec:
    try:
        return load_spec(path)
    except SpecError as exc:
        typer.secho(str(exc), fg="red", err=True)
        raise typer.Exit(EXIT_SPEC_ERROR) from None


def _check_data(spec: RunSpec, source: Path) -> None:
    """Read the spec's data files now, so a missing or malformed one is one line naming the field
    (`task.path`, `eval.path`) and EXIT_SPEC_ERROR, like any spec error, not a traceback from deep in a run."""
    if not spec.task.path and not (spec.eval and spec.eval.path):
        return  # generated tasks have no file to get wrong
    from locojax.tasks import load_task_data

    try:
        load_task_data(spec.task, spec.eval, str(source))
    except SpecError as exc:
        typer.secho(str(exc), fg="red", err=True)
        raise typer.Exit(EXIT_SPEC_ERROR) from None


RewardModulesOpt = typer.Option(
    "", "--reward-modules",
    help="module prefixes (comma-separated) that `package.module:function` rewards may be imported from; "
         "default: none, registered rewards only")


def _allow_rewards(spec: RunSpec, reward_modules: str, where: str, eval_spec: EvalSpec | None = None) -> None:
    """Set this process's reward allowlist and refuse a spec naming a task or reward its registries do not
    hold or a reward outside the allowlist, before anything is imported: the host re-checks what the API
    accepted (a forged start message stops here), with the API's messages. The eval block's rewards
    (`eval_spec`, default the spec's own) are checked the same way."""
    from locojax.rewards import allow_reward_modules, allowed_reward_modules, unknown_names

    allow_reward_modules(reward_modules)
    if eval_spec is not None:
        spec = spec.model_copy(update={"eval": eval_spec})
    refused = unknown_names(spec, allowed_reward_modules())
    if refused:
        lines = "; ".join(f"{field}: {message}" for field, message in refused)
        typer.secho(f"{where}: refused: {lines}", fg="red", err=True)
        raise typer.Exit(EXIT_SPEC_ERROR)


def default_compilation_cache() -> Path:
    """Where a host's runs share compiled programs unless its operator says otherwise."""
    return Path.home() / ".locojax" / "compilation-cache"


CompilationCacheOpt = typer.Option(
    None, "--compilation-cache",
    help="folder of compiled programs this host's runs share (JAX's persistent compilation cache), so a run "
         "that compiles what an earlier one did starts in seconds; default ~/.locojax/compilation-cache. "
         "An operator's setting, never a spec's")
NoCompilationCacheOpt = typer.Option(False, "--no-compilation-cache", help="compile everything afresh")

# Bounds the shared folder: JAX evicts the least recently used programs beyond it.
COMPILATION_CACHE_MAX_BYTES = 4 * 2**30


def configure_jax(devices_per_host: int, compilation_cache: Path | None = None, *,
                  no_compilation_cache: bool = False) -> None:
    """Give this process `devices_per_host` CPU devices (ignored by accelerator backends) and, unless
    `no_compilation_cache`, the persistent compilation cache in `compilation_cache` (default: the folder
    JAX was already given through its own JAX_COMPILATION_CACHE_DIR, as a test session does, else
    `default_compilation_cache()`). Every program is cached, however short its compilation: a run's
    first step compiles a dozen small ones beside rollout and the train step."""
    import jax

    jax.config.update("jax_num_cpu_devices", devices_per_host)
    if no_compilation_cache:
        jax.config.update("jax_compilation_cache_dir", None)
        return
    folder = Path(compilation_cache or jax.config.jax_compilation_cache_dir or default_compilation_cache())
    folder.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_compilation_cache_max_size", COMPILATION_CACHE_MAX_BYTES)
    cache_from_every_process()  # hosts other than the first reuse their programs too


def _with(spec: RunSpec, **overrides) -> RunSpec:
    """`spec` with top-level fields replaced, validated again (an override can make a spec invalid)."""
    try:
        return parse_spec({**spec.model_dump(mode="json"), **overrides}, "spec with command-line overrides")
    except SpecError as exc:
        typer.secho(str(exc), fg="red", err=True)
        raise typer.Exit(EXIT_SPEC_ERROR) from None


def train(
    spec_path: Path = SpecArg,
    resume: bool = typer.Option(False, "--resume", help="continue from the run's latest checkpoint"),
    steps: Optional[int] = typer.Option(None, help="override spec.steps"),
    output_dir: Optional[Path] = typer.Option(None, help="override spec.output_dir (default runs/<name>)"),
    quiet: bool = typer.Option(False, "--quiet", help="no progress bar"),
    cancel_file: Optional[Path] = typer.Option(None, help="stop at the next step boundary once this file exists "
                                                           f"(exit code {EXIT_CANCELLED})"),
    reward_modules: str = RewardModulesOpt,
    ray_address: Optional[str] = typer.Option(None, "--ray-address",
                                              help="DA: the operator's Ray cluster; default: a private one here"),
    listen: Optional[str] = typer.Option(None, help="ADDR:PORT where the controller listens for the processes the "
                                                    "control plane starts on the run's other hosts (SC: its "
                                                    "workers; DA: its Ray head); default: it starts them here"),
    secret_file: Optional[Path] = typer.Option(None, help="the attempt's shared secret (a file only this user "
                                                          "can read), with which its processes authenticate "
                                                          "(DA: the Ray token)"),
    compilation_cache: Optional[Path] = CompilationCacheOpt,
    no_compilation_cache: bool = NoCompilationCacheOpt,
) -> None:
    """Train a run (GRPO, or SFT for `kind: sft`): in this process when it has one host, else start its
    hosts with `launch`."""
    spec = _load(spec_path)
    overrides = {k: v for k, v in {"steps": steps, "output_dir": str(output_dir) if output_dir else None}.items()
                 if v is not None}
    if overrides:
        spec = _with(spec, **overrides)
    _allow_rewards(spec, reward_modules, str(spec_path))
    _check_data(spec, spec_path)
    placement, mode = spec.placement, spec_mode(spec)
    if mode.multi_process and placement.hosts > 1:
        _launch_spec(spec, placement.hosts, placement.devices_per_host, resume, quiet, cancel_file, reward_modules,
                     _cache_args(compilation_cache, no_compilation_cache))
        return
    from locojax.modes import isolate_network

    # A DA driver whose reserved hosts join its Ray head listens on its host's network, not a private
    # one, bound to the address it listens at.
    head = listen if mode.uses_ray and not ray_address else None
    isolate_network(spec, ray_address, head)
    configure_jax(mode.local_devices(placement), compilation_cache, no_compilation_cache=no_compilation_cache)
    from locojax.modes.errors import ModeRunError
    from locojax.placement.memory import MemoryPlanError
    from locojax.runner import run_mode

    try:
        extra = {"ray_address": ray_address} if ray_address and mode.uses_ray else {}
        if listen and not (mode.uses_ray and ray_address):  # an operator's Ray replaces a DA run's own head
            extra.update(listen=listen, secret_file=secret_file)
        result = run_mode(spec, resume=resume, console=not quiet, cancel_file=cancel_file, **extra)
    except ModeRunError as exc:
        typer.secho(f"{spec.name}: failed: {exc}", fg="red", err=True)
        raise typer.Exit(EXIT_FAILED) from None
    except MemoryPlanError as exc:  # refused before allocating: a spec that asks too much, like a bad field
        typer.secho(f"{spec.name}: refused: {exc}", fg="red", err=True)
        raise typer.Exit(EXIT_SPEC_ERROR) from None
    typer.echo(f"{spec.name}: {result.status} after {result.steps_done} steps")
    if result.status == EngineStatus.CANCELLED:
        raise typer.Exit(EXIT_CANCELLED)


def host(
    spec_path: Path = SpecArg,
    process_id: int = typer.Option(0, help="this host's index in the job"),
    num_processes: int = typer.Option(1, help="hosts in the job"),
    coordinator: Optional[str] = typer.Option(None, help="ADDR:PORT of process 0's coordination service"),
    devices_per_host: int = typer.Option(1, help="CPU devices to simulate in this process"),
    resume: bool = typer.Option(False, "--resume"),
    cancel_file: Optional[Path] = typer.Option(None, help="stop at the next step boundary once this file exists"),
    quiet: bool = typer.Option(False, "--quiet"),
    reward_modules: str = RewardModulesOpt,
    compilation_cache: Optional[Path] = CompilationCacheOpt,
    no_compilation_cache: bool = NoCompilationCacheOpt,
) -> None:
    """Run one host of a multi-host job: what every TPU VM (or simulated host) runs. An SFT spec
    (`kind: sft`) runs here too, as the single host of its job."""
    spec = _load(spec_path)
    _allow_rewards(spec, reward_modules, str(spec_path))
    mode = spec_mode(spec)
    if not mode.multi_process and num_processes > 1:
        typer.secho(f"{spec_path}: placement.hosts must be 1 for a run in mode {mode.name!r} (one process), "
                    f"but this host was started as one of --num-processes {num_processes}", fg="red", err=True)
        raise typer.Exit(EXIT_SPEC_ERROR)
    _check_data(spec, spec_path)
    configure_jax(devices_per_host, compilation_cache, no_compilation_cache=no_compilation_cache)
    import jax

    if num_processes > 1:
        if not coordinator:
            typer.secho("--coordinator is required with --num-processes > 1", fg="red", err=True)
            raise typer.Exit(EXIT_SPEC_ERROR)
        # Process 0 runs the coordination service; JAX would listen for it on every interface.
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                                   process_id=process_id,
                                   coordinator_bind_address=coordinator if process_id == 0 else None)
    from locojax.runner import run_mode

    kwargs = {"resume": resume, "console": not quiet and process_id == 0}
    if cancel_file is not None:
        kwargs["cancel_file"] = cancel_file
    result = run_mode(spec, **kwargs)
    if process_id == 0:
        typer.echo(f"{spec.name}: {result.status} after {result.steps_done} steps")
    if num_processes > 1:
        jax.distributed.shutdown()
    if result.status == EngineStatus.CANCELLED:
        raise typer.Exit(EXIT_CANCELLED)


def ray_node(
    spec_path: Path = SpecArg,
    head: str = typer.Option(..., "--head", help="ADDR:PORT of the run's Ray head (its driver's published address)"),
    node_address: str = typer.Option(..., "--node-address", help="this host's address, which its Ray node binds"),
    process_id: int = typer.Option(..., help="this host's index among the run's reserved hosts"),
    secret_file: Optional[Path] = typer.Option(None, "--secret-file", help="the attempt's shared secret: the "
                                               "cluster's Ray token"),
    ray_address: Optional[str] = typer.Option(None, "--ray-address", help="the worker's operator Ray cluster, "
                                              "which then holds the run's actors: this host runs nothing"),
) -> None:
    """One reserved host of a DA run other than its driver's: a Ray node that joins the run's head and
    holds this host's actors until the driver ends the cluster (locojax.modes.da_cluster)."""
    spec = _load(spec_path)
    if not spec_mode(spec).uses_ray or not 1 <= process_id < spec.placement.hosts:
        typer.secho(f"{spec_path}: a Ray node is one of a Ray mode's (DA's) reserved hosts "
                    f"1..{spec.placement.hosts - 1}, not mode {spec.placement.mode!r} process {process_id}",
                    fg="red", err=True)
        raise typer.Exit(EXIT_SPEC_ERROR)
    if ray_address:
        typer.echo(f"host {process_id}: the run's actors live on the operator's Ray cluster; nothing to run here")
        return
    if secret_file is None:
        typer.secho("--secret-file is required: the run's Ray cluster refuses anyone without its token", fg="red",
                    err=True)
        raise typer.Exit(EXIT_SPEC_ERROR)
    from locojax.bind_address import reexecute_bound_to
    from locojax.modes.da_cluster import serve_node

    reexecute_bound_to(node_address)  # this node's Ray listens at its host's address only
    code = serve_node(spec, head, node_address, process_id, secret_file)
    if code:
        raise typer.Exit(code)


def sc_worker(
    spec_path: Path = SpecArg,
    controller: str = typer.Option(..., help="ADDR:PORT of the run's SC controller"),
    process_id: int = typer.Option(..., help="this process's index in the run (1..hosts; 0 is the controller)"),
    devices_per_host: int = typer.Option(1, help="CPU devices to simulate in this process"),
    secret_file: Path = typer.Option(..., help="the attempt's shared secret (a file only this user can read)"),
    resume: bool = typer.Option(False, "--resume"),
    quiet: bool = typer.Option(False, "--quiet"),
    compilation_cache: Optional[Path] = CompilationCacheOpt,
    no_compilation_cache: bool = NoCompilationCacheOpt,
) -> None:
    """Run one host's worker of an SC run: it samples and trains that host's share when its
    controller says so, and stops when the controller does."""
    spec = _load(spec_path)
    _check_data(spec, spec_path)
    configure_jax(devices_per_host, compilation_cache, no_compilation_cache=no_compilation_cache)
    from locojax.link import LinkError, read_secret
    from locojax.modes.sc import serve_worker

    try:
        serve_worker(spec, controller, read_secret(secret_file), process_id, resume)
    except LinkError as exc:
        typer.secho(f"{spec.name}: SC worker {process_id}: the controller went away: {exc}", fg="red", err=True)
        raise typer.Exit(EXIT_FAILED) from None


def _cache_args(compilation_cache: Path | None, no_compilation_cache: bool) -> list[str]:
    """The compilation-cache options to hand on to the host processes a command starts."""
    if no_compilation_cache:
        return ["--no-compilation-cache"]
    return ["--compilation-cache", str(compilation_cache)] if compilation_cache else []


def _launch_spec(spec: RunSpec, hosts: int, devices_per_host: int, resume: bool, quiet: bool,
                 cancel_file: Path | None = None, reward_modules: str = "", cache_args: Sequence[str] = ()) -> None:
    import tempfile

    from locojax.launch import LaunchError, launch
    from locojax.runner import output_dir
    from locojax.spec import dump_spec

    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as handle:
        handle.write(dump_spec(spec))
    extra = (["--resume"] if resume else []) + (["--quiet"] if quiet else [])
    extra += ["--reward-modules", reward_modules] if reward_modules else []
    # Every host watches the same file; CO hosts agree on it in their per-step gather.
    extra += ["--cancel-file", str(cancel_file)] if cancel_file is not None else []
    extra += list(cache_args)
    try:
        codes = launch(handle.name, hosts, devices_per_host, extra, status_dir=output_dir(spec))
    except LaunchError as exc:
        typer.secho(str(exc), fg="red", err=True)
        raise typer.Exit(EXIT_FAILED) from None
    finally:
        Path(handle.name).unlink(missing_ok=True)
    if EXIT_CANCELLED in codes:  # the hosts stopped at a step boundary on the cancel file
        raise typer.Exit(EXIT_CANCELLED)


def launch_command(
    spec_path: Path = SpecArg,
    hosts: int = typer.Option(..., help="host processes to start on this machine"),
    devices_per_host: int = typer.Option(1, help="CPU devices per host process"),
    resume: bool = typer.Option(False, "--resume"),
    quiet: bool = typer.Option(False, "--quiet"),
    reward_modules: str = RewardModulesOpt,
) -> None:
    """Start HOSTS `locojax host` processes here (pinned to their own cores, on a free loopback port);
    if one fails, the rest are stopped and the failure is reported."""
    spec = _load(spec_path)
    spec = _with(spec, placement={**spec.placement.model_dump(), "hosts": hosts, "devices_per_host": devices_per_host})
    _allow_rewards(spec, reward_modules, str(spec_path))
    _launch_spec(spec, hosts, devices_per_host, resume, quiet, reward_modules=reward_modules)


def sft(
    spec_path: Path = SpecArg,
    out: Optional[Path] = typer.Option(None, help="the run's output directory (default: spec.output_dir or "
                                       "runs/<name>); the model a GRPO spec's model.checkpoint names is <out>/model"),
    steps: Optional[int] = typer.Option(None, help="SFT steps (default: spec.steps)"),
    batch_size: Optional[int] = typer.Option(None, help="examples per step (default: rollout.prompts_per_step)"),
    lr: Optional[float] = typer.Option(None, help="learning rate (default: optim.lr)"),
    resume: bool = typer.Option(False, "--resume", help="continue from the run's latest checkpoint"),
    quiet: bool = typer.Option(False, "--quiet", help="no progress bar"),
) -> None:
    """Warm-start a policy with teacher-forced SFT on the spec's task reference answers.

    The same as `locojax train` on the spec with `kind: sft` (any spec works: a GRPO spec is run as SFT);
    the options override the spec's fields. Writes metrics.jsonl and checkpoints like any run, and
    exports <out>/model when done."""
    spec = _load(spec_path)
    rollout = {**spec.rollout.model_dump(), **({"prompts_per_step": batch_size} if batch_size else {})}
    optim = {**spec.optim.model_dump(), **({"lr": lr} if lr else {})}
    overrides = {"kind": "sft", "rollout": rollout, "optim": optim,
                 "placement": {**spec.placement.model_dump(), "mode": "co", "hosts": 1, "rollout_fraction": None}}
    if steps is not None:
        overrides["steps"] = steps
    if out is not None:
        overrides["output_dir"] = str(out)
    spec = _with(spec, **overrides)
    _check_data(spec, spec_path)
    configure_jax(spec.placement.devices_per_host)
    from locojax import metrics as m
    from locojax.modes.sft import export_dir, run_sft

    result = run_sft(spec, resume=resume, console=not quiet)
    loss = result.final_metrics.get(m.LOSS_SFT, float("nan"))
    typer.echo(f"sft: {result.status}, loss {loss:.4f} after {result.steps_done} steps -> {export_dir(spec)}")


def eval_command(
    spec_path: Path = SpecArg,
    checkpoint: Path = typer.Option(..., help="a saved model: a HF directory (config.json + safetensors, e.g. "
                                    "<output_dir>/model of an SFT run) or an Orbax checkpoint directory "
                                    "(<output_dir>/checkpoints of a run; its latest step)"),
    prompts: Optional[int] = typer.Option(None, help="override eval.prompts"),
    k: Optional[int] = typer.Option(None, help="override eval.k"),
    reward_modules: str = RewardModulesOpt,
) -> None:
    """Evaluate a saved model on the spec's held-out prompts (its eval block, or the defaults): greedy
    accuracy and pass@k, in this process on placement.devices_per_host devices."""
    spec = _load(spec_path)
    overrides = {name: value for name, value in {"prompts": prompts, "k": k}.items() if value is not None}
    try:
        eval_spec = EvalSpec.model_validate({**(spec.eval or EvalSpec()).model_dump(), **overrides})
    except ValidationError as exc:
        errors = [(".".join(["eval", *map(str, err["loc"])]), validation_message(err))
                  for err in exc.errors()]
        typer.secho(str(SpecError(errors, "command-line overrides")), fg="red", err=True)
        raise typer.Exit(EXIT_SPEC_ERROR) from None
    _allow_rewards(spec, reward_modules, str(spec_path), eval_spec)
    if not checkpoint.is_dir():
        typer.secho(f"--checkpoint: {checkpoint} is not a directory", fg="red", err=True)
        raise typer.Exit(EXIT_SPEC_ERROR)
    from locojax.tasks import load_task_data

    try:
        data = load_task_data(spec.task, eval_spec, str(spec_path))
    except SpecError as exc:
        typer.secho(str(exc), fg="red", err=True)
        raise typer.Exit(EXIT_SPEC_ERROR) from None
    configure_jax(spec.placement.devices_per_host)
    import jax

    from locojax import metrics as m
    from locojax.evaluate import Evaluator, eval_rewards
    from locojax.policy import load_policy

    hf = (checkpoint / "config.json").is_file()
    # An Orbax checkpoint holds params only: the spec's own starting model gives their tree and shapes.
    policy = load_policy(_with(spec, model={**spec.model.model_dump(), "checkpoint": str(checkpoint)}) if hf else spec)
    if not hf:
        restore_trained_params(spec, policy, checkpoint)
    evaluator = Evaluator(spec, eval_spec, policy, data.held_out, eval_rewards(eval_spec, data.train), 0,
                          jax.local_devices())
    result = evaluator.timed(policy.params)
    typer.echo(f"{m.EVAL_ACCURACY} {result[m.EVAL_ACCURACY]:.4f}  {m.EVAL_PASS_AT_K.replace('@k', f'@{eval_spec.k}')} "
               f"{result[m.EVAL_PASS_AT_K]:.4f}  on {int(result[m.EVAL_PROMPTS])} held-out {spec.task.name} prompts "
               f"({checkpoint}; {result[m.EVAL_TIME]:.1f} s)")


def restore_trained_params(spec: RunSpec, policy, checkpoint: Path) -> None:
    """Set `policy`'s params to those of the Orbax checkpoint `checkpoint` (a run's directory or its
    checkpoints/; the latest step). With model.lora a checkpoint holds the adapters alone: they go beside
    the spec's own frozen base."""
    from flax import nnx

    from locojax.checkpoint import load_params
    from locojax.model.transformer import split_adapters

    orbax = checkpoint / CHECKPOINTS_DIR if (checkpoint / CHECKPOINTS_DIR).is_dir() else checkpoint
    try:
        if spec.model.lora is None:
            policy.params = load_params(orbax, policy.params)
        else:
            frozen, adapters = split_adapters(policy.params)
            policy.params = nnx.merge_state(frozen, load_params(orbax, adapters))
    except FileNotFoundError as exc:
        typer.secho(f"--checkpoint: {exc}", fg="red", err=True)
        raise typer.Exit(EXIT_SPEC_ERROR) from None


def export_command(
    spec_path: Path = SpecArg,
    checkpoint: Path = typer.Option(..., help="the run's Orbax checkpoints: <output_dir>/checkpoints or "
                                    "<output_dir> (its latest step)"),
    out: Path = typer.Option(..., help="where to write model/ (and, with model.lora, adapter/)"),
) -> None:
    """Export a run's trained policy: <out>/model, a Hugging Face directory (with model.lora the adapters
    merged into the weights), and with model.lora also <out>/adapter, the adapters alone in PEFT's format
    (adapter_config.json + adapter_model.safetensors) for `peft.PeftModel.from_pretrained`."""
    spec = _load(spec_path)
    configure_jax(spec.placement.devices_per_host)
    from flax import nnx

    from locojax.modes.sft import export_policy
    from locojax.policy import load_policy

    policy = load_policy(spec)
    restore_trained_params(spec, policy, checkpoint)
    for written in export_policy(nnx.merge(policy.graphdef, policy.params), out):
        typer.echo(f"wrote {written}")


def demo(
    out: Path = typer.Option(Path("runs/demo"), help="where the demo writes checkpoints, metrics and a plot"),
    sft_steps: Optional[int] = typer.Option(None, help="SFT warm-start steps (default: the demo's)"),
    grpo_steps: Optional[int] = typer.Option(None, help="GRPO steps (default: the demo's)"),
    seed: int = typer.Option(0),
    quiet: bool = typer.Option(False, "--quiet"),
) -> None:
    """The newcomer's demo: SFT warm start, then GRPO on `arith` with the `small` preset, locally."""
    configure_jax(1)
    from locojax.demo import run_demo

    kwargs = {k: v for k, v in {"sft_steps": sft_steps, "grpo_steps": grpo_steps}.items() if v is not None}
    summary = run_demo(out, console=not quiet, seed=seed, **kwargs)
    typer.echo(summary)


def register(app: typer.Typer) -> None:
    app.command("train")(train)
    app.command("host")(host)
    app.command("ray-node")(ray_node)
    app.command("launch")(launch_command)
    app.command("sc-worker")(sc_worker)
    app.command("sft")(sft)
    app.command("eval")(eval_command)
    app.command("export")(export_command)
    app.command("demo")(demo)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(0)
