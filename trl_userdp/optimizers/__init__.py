"""DP optimizers over users (Opacus ``DPOptimizer`` subclasses), and :func:`get_optimizer_class`, which picks one as
Opacus's function of the same name does."""

from typing import Union

from .adaptive_clip_optimizer import AdaptiveClipUserDPOptimizer, AdaptiveClipUserDPOptimizerFastGradientClipping
from .aup_optimizer import AUPOptimizer
from .user_optimizer import (
    DistributedUserDPOptimizer,
    DistributedUserDPOptimizerFastGradientClipping,
    PrivacyBudgetExhausted,
    UserDPOptimizer,
    UserDPOptimizerFastGradientClipping,
)
from .sharded_optimizer import ShardedUserDPOptimizerFastGradientClipping

#: (clipping, distributed, ghost) -> optimizer class; ``clipping`` is a mechanism's
#: :attr:`~trl_userdp.mechanisms.GradientMechanism.clipping`; ``distributed`` is False, True (data parallel) or
#: ``"sharded"`` (FSDP2)
OPTIMIZERS = {
    ("flat", False, False): UserDPOptimizer,
    ("flat", True, False): DistributedUserDPOptimizer,
    ("flat", False, True): UserDPOptimizerFastGradientClipping,
    ("flat", True, True): DistributedUserDPOptimizerFastGradientClipping,
    ("adaptive", False, False): AdaptiveClipUserDPOptimizer,
    ("adaptive", False, True): AdaptiveClipUserDPOptimizerFastGradientClipping,
    ("aup", False, False): AUPOptimizer,
    ("flat", "sharded", True): ShardedUserDPOptimizerFastGradientClipping,
}


def get_optimizer_class(clipping: str, distributed: Union[bool, str], grad_sample_mode: str = "hooks") -> type:
    """The optimizer that runs one step of a mechanism (Opacus's ``opacus.optimizers.get_optimizer_class`` for users).

    Args:
        clipping: the mechanism's ``clipping``: ``"flat"``, ``"adaptive"`` or ``"aup"``.
        distributed: several data-parallel processes (True), an FSDP2-sharded model (``"sharded"``), or neither.
        grad_sample_mode: ``"hooks"``, ``"functorch"`` or ``"ghost"``.

    Returns:
        The :class:`UserDPOptimizer` subclass.

    Raises:
        ValueError: a combination no optimizer runs (mechanisms refuse these first, with their reason).
    """
    key = (clipping, distributed if distributed == "sharded" else bool(distributed), grad_sample_mode == "ghost")
    if key not in OPTIMIZERS:
        raise ValueError(f"No optimizer for clipping={clipping!r}, distributed={distributed}, "
                         f"grad_sample_mode={grad_sample_mode!r}.")
    return OPTIMIZERS[key]


__all__ = [
    "AUPOptimizer",
    "AdaptiveClipUserDPOptimizer",
    "AdaptiveClipUserDPOptimizerFastGradientClipping",
    "DistributedUserDPOptimizer",
    "DistributedUserDPOptimizerFastGradientClipping",
    "OPTIMIZERS",
    "PrivacyBudgetExhausted",
    "ShardedUserDPOptimizerFastGradientClipping",
    "UserDPOptimizer",
    "UserDPOptimizerFastGradientClipping",
    "get_optimizer_class",
]
