"""The persistent compilation cache for every process of a `jax.distributed` job, not only the first.

JAX writes a compiled program to its persistent cache only from process 0 (`jax._src.compiler._cache_write`:
many processes writing one shared remote folder would contend). On the CPU backend a program's cache key
includes its process's topology fingerprint, which differs per process even for one global program
(measured with jax 0.10.2: the keys of process 0 and process 1 differ in `accelerator_config` alone). So
process 0's entries never serve another process, and every host but the first compiled everything afresh
on every run, however often it had run the same spec: a lockstep step waits for its slowest host, so the
run started no faster than with no cache at all. Each process here writes only entries under its own keys
to a local folder, through JAX's own size-bounded cache (its writes take a file lock), so every process may
write: `cache_from_every_process` lets it, on the CPU backend only. An accelerator's processes keep JAX's
rule: their keys can be the same on every process (one slice's topology) and their folder a shared remote
one, where process 0's entries serve them all. Nothing else about caching changes (the same thresholds, no
programs with host callbacks)."""

from __future__ import annotations

import warnings
from typing import Any


def cache_from_every_process() -> None:
    """Let this process write the programs it compiles for the CPU to the persistent cache whatever its
    index in a `jax.distributed` job (JAX's own rule writes from process 0 only). Idempotent."""
    from jax._src import compilation_cache, compiler, config, distributed

    if getattr(compiler._cache_write, "writes_from_every_process", False):
        return

    def cache_write(cache_key: str, compile_time_secs: float, module_name: str, backend: Any, executable: Any,
                    host_callbacks: Any) -> None:
        # JAX's `_cache_write`, its process-index check kept for accelerators only.
        if distributed.global_state.process_id != 0 and backend.platform != "cpu":
            return
        if host_callbacks or compile_time_secs < config.persistent_cache_min_compile_time_secs.value:
            return
        try:
            compilation_cache.put_executable_and_time(cache_key, module_name, executable, backend,
                                                      int(compile_time_secs))
        except Exception as exc:  # a cache that cannot be written costs a compile, never the run
            if config.raise_persistent_cache_errors.value:
                raise
            warnings.warn(f"Error writing persistent compilation cache entry for '{module_name}': "
                          f"{type(exc).__name__}: {exc}")

    cache_write.writes_from_every_process = True
    compiler._cache_write = cache_write
