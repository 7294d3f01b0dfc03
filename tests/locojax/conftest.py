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
