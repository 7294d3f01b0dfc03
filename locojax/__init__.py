"""LoCoJAX engine: Qwen3 policies, rollout, rewards, GRPO training in CO/DA/SC modes, and placement.

The engine is a library plus a CLI. It never reads environment variables or a database; everything it
needs arrives as a `locojax.spec.RunSpec`.
"""

__version__ = "0.1.0"
