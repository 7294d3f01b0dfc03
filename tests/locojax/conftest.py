"""Engine tests run on 4 fake CPU devices so sharded code paths are exercised on this machine."""

import jax
import pytest

jax.config.update("jax_num_cpu_devices", 4)


@pytest.fixture
def test_rewards_allowed():
    """This process may import the test rewards (tests.locojax.rewards_for_tests), as an operator's
    `--reward-modules` allows; the allowlist is empty again afterwards."""
    from locojax.rewards import allow_reward_modules

    allow_reward_modules(["tests.locojax.rewards_for_tests"])
    yield
    allow_reward_modules(())


@pytest.fixture(autouse=True, scope="session")
def float32_references_at_highest_precision():
    """On an accelerator (bench/tpu.sh's test stage), float32 matmuls run at the highest precision: a
    TPU's default passes float32 operands through bfloat16 (~1e-3 relative), and these tests compare
    against float32 references at 1e-4 or tighter. On a CPU nothing changes."""
    if jax.default_backend() == "cpu":
        yield
        return
    previous = jax.config.jax_default_matmul_precision
    jax.config.update("jax_default_matmul_precision", "highest")
    yield
    jax.config.update("jax_default_matmul_precision", previous)


@pytest.fixture
def four_cpu_devices():
    """The 4 fake CPU devices this conftest asks for (`jax_num_cpu_devices`, which an accelerator
    backend ignores): a test of sharded code paths skips where they are not there."""
    devices = jax.devices()
    if jax.default_backend() != "cpu" or len(devices) < 4:
        pytest.skip(f"needs 4 CPU devices (jax_num_cpu_devices 4); the {jax.default_backend()} backend has "
                    f"{len(devices)} device(s)")
