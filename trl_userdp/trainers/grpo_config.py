"""``UserDPGRPOConfig``: TRL's ``GRPOConfig`` plus the user-level privacy fields."""

from __future__ import annotations

import dataclasses

from trl import GRPOConfig

from .privacy_config import UserDPArguments


@dataclasses.dataclass
class UserDPGRPOConfig(UserDPArguments, GRPOConfig):
    """``GRPOConfig`` with the fields of :class:`UserDPArguments` (docs/trainers.md, "GRPO on the users' own prompts").
    The privacy unit is the user who wrote the prompts; ``max_samples_per_user`` bounds their prompts, each answered by
    ``num_generations`` completions. ``loss_type`` defaults to ``"grpo"`` (each completion's loss is its own token mean):
    TRL's default ``"dapo"`` divides by the batch's token count, so one user's completion lengths would weigh every
    other user's gradient. ``disable_dropout`` defaults to True (TRL's GRPO default is False): dropout's masks come
    from torch's public stream, one per batch, so under DP a model with dropout on is refused."""

    disable_dropout: bool = dataclasses.field(
        default=True,
        metadata={"help": "Turn the model's dropout off (required under user-level DP: its masks couple users)."},
    )

    loss_type: str = dataclasses.field(
        default="grpo",
        metadata={"help": "GRPO's loss aggregation; under user-level DP one of 'grpo', 'dr_grpo', 'sapo' or 'luspo' "
                          "(per-completion normalisation)."},
    )
