"""The persistent compilation cache a host's runs share: the second run of a spec compiles nothing new."""

from __future__ import annotations

import os

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
