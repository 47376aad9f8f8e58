from .placement import ColocatedRLStrategy, DedicatedRolloutStrategy

__all__ = ["ColocatedRLStrategy", "DedicatedRolloutStrategy"]
