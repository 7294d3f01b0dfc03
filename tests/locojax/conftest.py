"""Engine tests run on 4 fake CPU devices so sharded code paths are exercised on this machine."""

import jax

jax.config.update("jax_num_cpu_devices", 4)
