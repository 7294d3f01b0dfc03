"""Engine commands of the `locojax` CLI: demo, and (as they land) train, sft, host, launch."""

from __future__ import annotations

import time

import typer


def demo(preset: str = typer.Option("small", help="model preset to build")) -> None:
    """Smoke demo: build a policy, run a KV-cached forward on a left-padded batch, print timings."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from locojax.model import create_model, forward, get_preset, init_cache, param_count, positions_from_mask
    from locojax.tokenizer import ByteTokenizer, pad_left

    config = get_preset(preset)
    tokenizer = ByteTokenizer()
    graphdef, params = nnx.split(create_model(config, seed=0))
    prompts = ["What is 2+3?", "Add 12 and 5.", "7-4="]
    tokens, mask = pad_left([tokenizer.encode(p, add_bos=True) for p in prompts], 16, tokenizer.pad_id)
    new_tokens = 16
    step = jax.jit(forward, static_argnums=0, donate_argnums=(5,))
    kv_mask = jnp.concatenate([jnp.asarray(mask), jnp.ones((len(prompts), new_tokens), bool)], axis=1)
    positions = positions_from_mask(kv_mask)
    cache = init_cache(config, len(prompts), kv_mask.shape[1])
    start = time.perf_counter()
    logits, cache = step(graphdef, params, jnp.asarray(tokens), positions[:, :16], kv_mask, cache, 0)
    token = jnp.argmax(logits[:, -1], axis=-1)
    for i in range(new_tokens - 1):
        logits, cache = step(graphdef, params, token[:, None], positions[:, 16 + i:17 + i], kv_mask, cache, 16 + i)
        token = jnp.argmax(logits[:, -1], axis=-1)
    jax.block_until_ready(token)
    elapsed = time.perf_counter() - start
    typer.echo(f"model {config.name}: {param_count(config):,} parameters on {jax.device_count()} device(s)")
    typer.echo(f"prefill + {new_tokens - 1} cached decode steps for {len(prompts)} prompts: {elapsed:.2f} s "
               "(including compilation)")


def register(app: typer.Typer) -> None:
    app.command("demo")(demo)
