"""The first private update, checked weight by weight: every trainable weight that received a non-zero private
gradient moved, and no frozen weight changed since set-up.

Users of Opacus with PEFT report LoRA adapters that trained "normally" (loss falling, ε accumulating) and came out
unusable (opacus #820): the optimizer's update and the model's weights had parted ways, and nothing said so. A
frozen weight that changes is worse still: a change nobody clipped, noised or accounted (a layer that writes its
inputs into a frozen buffer-like parameter in its forward). :class:`WeightGuard` compares exact fingerprints of the
weights around the first update that should move something (a group with a learning rate above 0) and stops
training with the weight's name. Under data parallelism every rank holds the same weights and applies the same update,
so every rank reaches the same verdict on the trained weights.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch
from torch import nn

_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_CHUNK = 1 << 20  # 8 MB of int64 at a time
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)  # 2⁶⁴/φ as a signed int64


def _local(p: torch.Tensor) -> torch.Tensor:
    """A parameter's own values (an FSDP2 shard's local part)."""
    return p.to_local() if hasattr(p, "to_local") else p


def fingerprints(params: Sequence[torch.Tensor]) -> List[Tuple[int, Tuple[int, ...], torch.dtype]]:
    """Exact fingerprints of tensors: a hash of their bit patterns, with their shape and dtype (one host sync).

    The hash is ``Σ_i bits_i · w_i mod 2⁶⁴`` with odd pseudo-random weights ``w_i`` per position, so that no change
    of a few entries by a unit of rounding each (which moves plain bit sums by ±1 that can cancel) goes unseen but by a
    chance of about 2⁻⁶⁰.

    Args:
        params: The tensors.

    Returns:
        ``(hash, shape, dtype)`` per tensor.
    """
    sums = []
    for p in params:
        t = _local(p).detach()
        bits = (t.contiguous().view(_INT_VIEW[t.element_size()]) if t.is_floating_point() else t).reshape(-1)
        total = torch.zeros((), dtype=torch.int64, device=t.device)
        for start in range(0, bits.numel(), _CHUNK):  # one chunk at a time in int64, not the whole weight
            chunk = bits[start:start + _CHUNK].to(torch.int64)
            weights = torch.arange(start, start + len(chunk), dtype=torch.int64, device=t.device)
            weights = (weights * _GOLDEN + _GOLDEN) ^ (weights >> 7) | 1  # odd, and wrapping as int64 does
            total += (chunk * weights).sum()
        sums.append(total.cpu())
    values = torch.stack(sums).tolist() if sums else []
    return [(v, tuple(_local(p).shape), p.dtype) for v, p in zip(values, params)]


class WeightGuard:
    """Checks the first private update that should move a weight (module docstring).

    Args:
        model: The model; its frozen weights are fingerprinted now.
        optimizer: The optimizer whose update is checked (its ``param_groups``).
        name_of: ``{parameter: name}`` for the messages.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, name_of: Dict[nn.Parameter, str]):
        self.optimizer = optimizer
        trained = {id(p) for g in optimizer.param_groups for p in g["params"]}
        names = {id(p): n for n, p in model.named_parameters()}
        self.names = {id(p): name_of.get(p, names.get(id(p), "?")) for p in model.parameters()}
        self.frozen = [p for p in model.parameters() if not p.requires_grad and id(p) not in trained]
        self._frozen_before = fingerprints(self.frozen)
        #: True until the first update that should move a weight has been checked
        self.pending = True
        self._moving_now: List[nn.Parameter] = []
        self._trained_before: List[Tuple[int, Tuple[int, ...], torch.dtype]] = []
        self._depth = 0
        # torch's step hooks on ``optimizer``; an optimizer class whose step calls its parent's runs them once more
        # inside: the outermost call counts
        self._handles = [optimizer.register_step_pre_hook(self._before), optimizer.register_step_post_hook(self._after)]

    def _before(self, *_args) -> None:
        self._depth += 1
        if self._depth == 1:
            self._moving_now = self._moving()
            self._trained_before = fingerprints(self._moving_now)

    def _after(self, *_args) -> None:
        self._depth -= 1
        if self._depth == 0 and self._moving_now:
            for handle in self._handles:
                handle.remove()
            self.after_update()

    def _moving(self) -> List[nn.Parameter]:
        """The optimizer parameters whose update must move them: a learning rate above 0, no optimizer state yet (the
        first update of any common optimizer moves an entry by at least ``lr · min(|g|, 1)``: SGD by ``lr·g``, Adam,
        Adagrad, RMSprop and Lion by about ``lr``), and an entry where that exceeds twice its rounding unit (an update
        below it rounds away, correctly)."""
        out = []
        for group in self.optimizer.param_groups:
            lr = float(group.get("lr", 1.0))
            for p in group["params"]:
                if lr > 0 and p.grad is not None and not self.optimizer.state.get(p):
                    g, w = torch.nan_to_num(_local(p.grad).detach()).float(), _local(p).detach().float()
                    if bool(((lr * g.abs().clamp(max=1.0)) > w.abs() * (2 * torch.finfo(p.dtype).eps)).any()):
                        out.append(p)
        return out

    def after_update(self) -> None:
        """Compare after the update; the guard is then done.

        Raises:
            ValueError: A frozen weight changed since set-up, or a trained weight whose update must move it did not.
        """
        self.pending = False
        for p, before, after in zip(self.frozen, self._frozen_before, fingerprints(self.frozen)):
            if before[1:] == after[1:] and before != after:
                raise ValueError(
                    f"The frozen weight {self.names[id(p)]!r} changed during the first private step: nothing clips, "
                    "noises or accounts such a change, so it may carry the users' data out unprotected (a layer that "
                    "writes into its own weights in the forward pass, or an update applied outside the private "
                    "optimizer). Training stops here; make it trainable (it then gets the private update) or keep "
                    "it fixed."
                )
        stuck = [p for p, before, after in zip(self._moving_now, self._trained_before, fingerprints(self._moving_now))
                 if before == after]
        if stuck:
            raise ValueError(
                f"The trained weight {self.names[id(stuck[0])]!r} (and {len(stuck) - 1} more) did not move in the "
                "first private step, although its private gradient at this learning rate must have moved it: the "
                "optimizer's update does not reach the model's weights (an optimizer built on other tensors than "
                "the model's, weights replaced after the optimizer was made), so training would spend ε on a model "
                "that does not learn. Build the optimizer on the model's final parameters."
            )
