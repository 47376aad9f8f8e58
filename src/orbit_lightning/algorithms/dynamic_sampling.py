"""DAPO dynamic sampling (Yu et al. 2025, §3.2): drop groups whose samples all got the same reward.

Such a group has zero advantage under any group baseline, so it only dilutes the batch. The trainer
keeps generating rounds and fills the batch with informative groups until it has the target number.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from ._common import check_groups


def group_keep_mask(
    rewards: Tensor,  # [N = B*G] float
    group_size: int,
    valid: Tensor | None = None,  # [N] bool
    tol: float = 1e-6,
) -> Tensor:  # [B] bool
    """True for groups whose valid rewards spread by more than ``tol`` (max - min > tol).

    Groups with fewer than two valid samples carry no signal either and are dropped.
    """
    if tol < 0:
        raise ValueError(f"tol must be >= 0, got {tol}")
    r, v = check_groups(rewards, group_size, valid)
    inf = torch.tensor(float("inf"), dtype=r.dtype, device=r.device)
    spread = torch.where(v, r, -inf).amax(dim=1) - torch.where(v, r, inf).amin(dim=1)
    # one valid sample gives spread 0 and none gives -inf, so such groups fail the test without a count
    return spread > tol


def concat_kept_groups(
    rounds: Sequence[Mapping[str, Tensor]],
    keeps: Sequence[Tensor],
    group_size: int,
    target_groups: int,
    pad_values: Mapping[str, float] | None = None,
) -> tuple[dict[str, Tensor], int]:
    """Concatenate the kept groups of successive generation rounds, oldest first, up to ``target_groups``.

    ``rounds[r]`` maps names to per-sample tensors whose first dim is N_r = B_r * G (group-contiguous);
    ``keeps[r]`` is that round's [B_r] bool mask from ``group_keep_mask``. Every round must have the same
    keys. Tensors with more than one dim (e.g. tokens [N_r, T_r]) are right-padded along the last dim to
    the longest of the rounds used, with ``pad_values[name]`` (default 0). Returns (batch of K*G rows, K);
    K is below ``target_groups`` when the rounds do not hold enough kept groups yet (generate another round).
    """
    if len(rounds) != len(keeps) or not rounds:
        raise ValueError(f"need >= 1 round and one keep mask per round, got {len(rounds)} / {len(keeps)}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if target_groups < 1:
        raise ValueError(f"target_groups must be >= 1, got {target_groups}")
    names = list(rounds[0])
    pad_values = dict(pad_values or {})

    for i, (batch, keep) in enumerate(zip(rounds, keeps)):
        if sorted(batch) != sorted(names):
            raise ValueError(f"round {i} has keys {sorted(batch)}, round 0 has {sorted(names)}")
        if keep.dtype != torch.bool or keep.dim() != 1:
            raise ValueError(f"keeps[{i}] must be a bool tensor [B], got {keep.dtype} {tuple(keep.shape)}")
        n_rows = keep.shape[0] * group_size
        for name, t in batch.items():
            if t.shape[0] != n_rows:
                raise ValueError(
                    f"round {i}: {name!r} has {t.shape[0]} rows, expected B*G = {keep.shape[0]}*{group_size}"
                )

    pieces: dict[str, list[Tensor]] = {name: [] for name in names}
    taken = 0
    for batch, keep in zip(rounds, keeps):
        groups = keep.nonzero().flatten()[: target_groups - taken]
        taken += groups.numel()
        rows = (groups[:, None] * group_size + torch.arange(group_size, device=keep.device)).flatten()
        for name, t in batch.items():
            pieces[name].append(t.index_select(0, rows.to(t.device)))
        if taken == target_groups:
            break

    out = {}
    for name, parts in pieces.items():
        if parts[0].dim() > 1:
            width = max(p.shape[-1] for p in parts)
            fill = pad_values.get(name, 0)
            parts = [F.pad(p, (0, width - p.shape[-1]), value=fill) for p in parts]
        out[name] = torch.cat(parts, dim=0)
    return out, taken
