"""The persistent compilation cache a host's runs share: the second run of a spec compiles nothing new."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.locojax.test_co import locojax, tiny_spec, write_spec


def _entries(folder) -> set[str]:
    return {entry.name for entry in folder.iterdir()} if folder.exists() else set()


@pytest.mark.slow
def test_a_second_run_of_the_same_spec_takes_every_program_from_the_cache(tmp_path):
    cache = tmp_path / "cache"
    spec = write_spec(tmp_path, tiny_spec(tmp_path, "cached", steps=2, checkpoint={"every": 0}))
    # JAX's own variable names another folder: the operator's option wins over it.
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "elsewhere")}
    first = locojax("train", str(spec), "--quiet", "--compilation-cache", str(cache), env=env)
    assert first.returncode == 0, first.stderr
    after_first = _entries(cache)
    # The rollout, the train step and the small programs around them, each written once.
    assert len(after_first) >= 3, after_first
    assert not _entries(tmp_path / "elsewhere")

    second = locojax("train", str(spec), "--quiet", "--compilation-cache", str(cache), "--output-dir",
                     str(tmp_path / "again"), env=env)
    assert second.returncode == 0, second.stderr
    assert _entries(cache) == after_first  # every program was found: nothing compiled, nothing written

    off = locojax("train", str(spec), "--quiet", "--no-compilation-cache", "--output-dir", str(tmp_path / "off"),
                  env={**os.environ, "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax-own")})
    assert off.returncode == 0, off.stderr
    assert not _entries(tmp_path / "jax-own")


# One process of a 2-process `jax.distributed` job, configured as an engine host is (`configure_jax`):
# it compiles a global program (over both processes' devices) and a local one, and prints how many
# programs it took from the persistent cache.
JOB_PROCESS = """
import json, sys
import jax, numpy as np
from jax._src import monitoring
from jax.sharding import NamedSharding, PartitionSpec
from locojax.commands import configure_jax
process_id, coordinator, cache = int(sys.argv[1]), sys.argv[2], sys.argv[3]
configure_jax(1, cache)
hits = []
monitoring.register_event_listener(
    lambda name, **_: hits.append(name) if name == "/jax/compilation_cache/cache_hits" else None)
jax.distributed.initialize(coordinator_address=coordinator, num_processes=2, process_id=process_id)
mesh = jax.make_mesh((2,), ("hosts",))
rows = jax.make_array_from_process_local_data(NamedSharding(mesh, PartitionSpec("hosts")), np.ones((1, 8), np.float32))
local = jax.device_put(np.arange(8.0, dtype=np.float32), jax.local_devices()[0])
jax.block_until_ready((jax.jit(lambda x: (x * 2).sum())(rows), jax.jit(lambda x: x * 3 + 1)(local)))
print(json.dumps({"process": process_id, "cache_hits": len(hits)}), flush=True)
"""


def _run_job(cache) -> dict[int, int]:
    """Both processes of one 2-process job: each process's number of programs taken from the cache."""
    from locojax.launch import free_port

    coordinator = f"127.0.0.1:{free_port()}"
    processes = [subprocess.Popen([sys.executable, "-c", JOB_PROCESS, str(index), coordinator, str(cache)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for index in (0, 1)]
    hits = {}
    for process in processes:
        out, err = process.communicate(timeout=120)
        assert process.returncode == 0, err
        reply = json.loads(out.strip().splitlines()[-1])
        hits[reply["process"]] = reply["cache_hits"]
    return hits


@pytest.mark.multiprocess
def test_every_process_of_a_job_takes_its_programs_from_the_cache_the_second_time(tmp_path):
    # JAX itself writes only process 0's programs, and on a CPU the other processes' keys differ from
    # its keys: without `cache_from_every_process` process 1 would compile both programs again.
    assert _run_job(tmp_path / "cache") == {0: 0, 1: 0}
    assert _run_job(tmp_path / "cache") == {0: 2, 1: 2}
