"""User-wise DP-SGD on a model sharded by FSDP2 (``fully_shard``): ghost clipping per user on each rank, the clipped
sums reduce-scattered to the parameters' shards, and one noise draw per element by the rank that owns it
(docs/architecture.md, "Sharded models").

Users are sharded by rank as under data parallelism, so each user's rows, norm and clip are on one process. While a
layer runs, FSDP2 has gathered its parameters, and :class:`~trl_userdp.grad_sample.UserGhostHooks` (built on the
gathered parameters) computes each user's ghost norm and the book-kept clipped sum ``Σ_u c_u ḡ_u`` from the layer's
activations and output gradients, as on one process. Autograd's own gradient (the unclipped one) is freed as it is
accumulated, so FSDP2 has nothing to reduce-scatter. As each micro-batch is clipped, each parameter's clipped sum is
summed over the ranks and scattered to the shards by one collective per parameter tensor (a ``Partial`` DTensor
redistributed to FSDP2's ``Shard(0)`` layout, uneven shards included), layer by layer, so no rank holds more than one
layer's full sums; at the step each rank
adds ``N(0, σ²C²)`` to the elements it owns: every element of the full gradient gets exactly one draw.
"""

from __future__ import annotations

from typing import Any, Dict

import torch
from opacus.optimizers.optimizer import _check_processed_flag, _mark_as_processed
from torch.optim import Optimizer

from ..seeding import derive_seed
from .noise import add_gaussian_noise_
from .user_optimizer import StopTogether, UserDPOptimizerFastGradientClipping


class ShardedUserDPOptimizerFastGradientClipping(StopTogether, UserDPOptimizerFastGradientClipping):
    """:class:`UserDPOptimizerFastGradientClipping` for an FSDP2-sharded model (module docstring); a check failing on
    one rank stops every rank (:class:`StopTogether`).

    Args:
        optimizer: The wrapped optimizer, over the sharded parameters (DTensors).
        live_params: ``{sharded parameter: the unsharded parameter FSDP2 gathers for it}``, on which the hooks were
            keyed (:func:`~trl_userdp.distributed.gathered_parameters`).
        expected_batch_size: ñ, the expected users per step over all processes.
        **kwargs: As :class:`UserDPOptimizer`'s. ``self_check`` is off: it compares the per-user sums with
            autograd's gradient, which the hooks free here before FSDP2 would reduce-scatter it; the sharded update is
            checked against the single-process one by the tests instead.
    """

    def __init__(self, optimizer: Optimizer, *, live_params: Dict[torch.nn.Parameter, torch.nn.Parameter],
                 **kwargs: Any):
        if kwargs.get("generator") is not None and not kwargs.get("secure_mode") and torch.distributed.get_world_size() > 1:
            raise ValueError("A noise_generator seeded alike on every process would add the same noise to every shard "
                             "(subtracting two shards would cancel it): pass noise_seed, keyed by step and process, or "
                             "leave the noise to the OS.")
        kwargs["self_check"] = False
        super().__init__(optimizer, **kwargs)
        self.live_params = live_params
        self.hooks.shards = {live: sharded for sharded, live in live_params.items()}
        self.rank = torch.distributed.get_rank()

    def _hooked(self, p: torch.nn.Parameter) -> torch.nn.Parameter:
        """The unsharded parameter FSDP2 gathers for the shard ``p``, by which the hooks key their state."""
        return self.live_params[p]

    def key_randomness(self) -> None:
        """With ``noise_seed``: seed this step's noise from ``(noise_seed, step, rank)``: each rank draws for its own
        shard, independently of the others."""
        if self.noise_seed is not None:
            self.generator.manual_seed(derive_seed(self.noise_seed, "noise", self.step_index(), self.rank))

    def add_noise(self) -> None:
        """``p.grad`` = this rank's shard of the clipped sum plus ``N(0, σ²C²)`` on each of its elements, as a DTensor
        of the parameter's layout."""
        from torch.distributed.tensor import DTensor

        for p in self.params:
            _check_processed_flag(p.summed_grad)
            noisy = add_gaussian_noise_(p.summed_grad, self.noise_multiplier * self.max_grad_norm, self.generator,
                                        self.secure_mode)
            p.grad = DTensor.from_local(noisy, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
            _mark_as_processed(p.summed_grad)
