"""``UserDPKTOTrainer``: TRL's ``KTOTrainer`` with user-level differential privacy."""

from __future__ import annotations

from typing import List

from trl import KTOTrainer

from .kto_config import UserDPKTOConfig
from .mixin import UserDPTrainerMixin


class UserDPKTOTrainer(UserDPTrainerMixin, KTOTrainer):
    """Drop-in for ``trl.KTOTrainer`` on unpaired feedback (one completion and a desirable/undesirable label per
    row) with a :class:`UserDPKTOConfig` and a user column. KTO's own loss estimates a KL baseline from completions
    of *other* examples of the batch, which couples users, so under DP it trains KTO's unpaired APO loss
    (``loss_type="apo_zero_unpaired"``, no KL term)."""

    config_class = UserDPKTOConfig
    rows_per_example = 1

    def dp_refusals(self, args) -> List[str]:
        if args.loss_type != "apo_zero_unpaired":
            return [f"loss_type={args.loss_type!r} estimates KTO's KL baseline from other examples of the batch (other "
                    "users' completions), which breaks the per-user bound: use loss_type='apo_zero_unpaired'."]
        return []
