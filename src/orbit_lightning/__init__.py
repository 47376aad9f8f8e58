"""orbit-lightning: RL post-training of BF16 adapters on a frozen low-precision base."""

__version__ = "0.1.0"
