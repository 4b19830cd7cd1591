"""Losses for labels privatized by randomized response (docs/mechanisms.md, Losses).

All take margins in the *observed* orientation: ``z = r(chosen) − r(rejected)`` for a reward model,
or the DPO implicit-reward margin ``β·Δ``, where "chosen" is the response the (privatized) label
prefers. Each returns a reduced loss (``reduction="mean" | "sum" | "none"``).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .accountants.events import rr_keep_probability, rr_move_probability
from .validators import check_epsilon

REDUCTIONS = ("mean", "sum", "none")


def _reduce(loss: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "mean":
        return loss.mean()
    if reduction == "sum":
        return loss.sum()
    return loss


def _check_reduction(reduction: str) -> str:
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}.")
    return reduction


def flip_rate_from_epsilon(epsilon: float) -> float:
    """The probability that binary randomized response at ε flips a label.

    Args:
        epsilon: The per-label budget ε.

    Returns:
        ``1 − σ(ε) = σ(−ε)``.

    Raises:
        ValueError: If ``epsilon`` is not a finite number > 0.
    """
    return rr_move_probability(epsilon, 2)


class BTLLoss(nn.Module):
    """Bradley–Terry negative log-likelihood, ``softplus(−z)`` per pair (the non-private loss).

    Args:
        reduction: ``"mean"``, ``"sum"`` or ``"none"``.

    Raises:
        ValueError: If ``reduction`` is unknown.
    """

    def __init__(self, reduction: str = "mean"):
        super().__init__()
        self.reduction = _check_reduction(reduction)

    def forward(self, margin: torch.Tensor) -> torch.Tensor:
        """The loss of each pair's margin.

        Args:
            margin: The margins ``z`` [B], in the observed orientation.

        Returns:
            The reduced loss.
        """
        return _reduce(F.softplus(-margin), self.reduction)


class RRDebiasedRewardLoss(nn.Module):
    """De-biased reward loss for RR labels (Chowdhury et al. 2024 eq. 4–5; AUP-RLHF App. B.2).

    With ``s = σ(ε')`` and ``u = 2ỹ − 1`` (``u = +1`` in the observed orientation):
    ``loss = (2s − 1)·softplus(−u z) − (1 − s)·u z``. It is convex in ``z`` for every ε' > 0, can be
    negative, and its gradient is ``(2s − 1)(σ(z) − ȳ)`` with the de-biased label
    ``ȳ = (ỹ − (1 − s))/(2s − 1)``, whose expectation over RR is the clean label.

    Args:
        epsilon: the *per-label* RR parameter ε' (ε/m for user-level RR; see
            :attr:`trl_userdp.mechanisms.UserRandomizedResponse.epsilon_per_label`).
        normalize: divide by ``2s − 1``: the gradient is then an unbiased estimate of the clean BTL gradient.
        reduction: ``"mean"``, ``"sum"`` or ``"none"``.

    Raises:
        ValueError: If ``epsilon`` is not a finite number > 0 or ``reduction`` is unknown.
    """

    def __init__(self, epsilon: float, normalize: bool = False, reduction: str = "mean"):
        super().__init__()
        self.epsilon = check_epsilon(epsilon, "epsilon")
        self.keep = 1.0 - flip_rate_from_epsilon(epsilon)  # s = σ(ε')
        self.normalize = normalize
        self.reduction = _check_reduction(reduction)

    def forward(self, margin: torch.Tensor, observed_labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The de-biased loss of each pair's margin.

        Args:
            margin: The margins ``z`` [B].
            observed_labels: The observed labels ỹ ∈ {0, 1} [B] (1 = the first response preferred), if the
                margins are not already oriented by the observed label.

        Returns:
            The reduced loss.
        """
        u = 1.0 if observed_labels is None else 2.0 * observed_labels.to(margin.dtype) - 1.0
        s = self.keep
        loss = (2 * s - 1) * F.softplus(-u * margin) - (1 - s) * u * margin
        if self.normalize:
            loss = loss / (2 * s - 1)
        return _reduce(loss, self.reduction)


class RobustDPOLoss(nn.Module):
    """rDPO (Chowdhury et al. 2024; Zhou et al. eq. 16) for labels flipped at rate ρ.

    ``[−(1 − ρ)·log σ(m) + ρ·log σ(−m)] / (1 − 2ρ)`` on the implicit-reward margin ``m = β·Δ``.
    Equal to TRL's ``loss_type="robust"`` with ``label_smoothing=ρ``; plain DPO at ρ = 0.
    Zhou et al.: the same loss serves corruption-then-privacy and privacy-then-corruption; it needs
    neither the corruption rate nor the order.

    Args:
        flip_rate: The flip rate ρ ∈ [0, 1/2); give exactly one of ``flip_rate`` and ``epsilon``.
        epsilon: The per-label RR ε', so ρ = σ(−ε').
        reduction: ``"mean"``, ``"sum"`` or ``"none"``.

    Raises:
        ValueError: If both or neither of ``flip_rate`` and ``epsilon`` are given, ρ is not in [0, 1/2),
            ``epsilon`` is not a finite number > 0, or ``reduction`` is unknown.
    """

    def __init__(self, flip_rate: Optional[float] = None, epsilon: Optional[float] = None, reduction: str = "mean"):
        super().__init__()
        if (flip_rate is None) == (epsilon is None):
            raise ValueError("Give exactly one of `flip_rate` or `epsilon`.")
        rho = flip_rate_from_epsilon(epsilon) if flip_rate is None else float(flip_rate)
        if not 0.0 <= rho < 0.5:
            raise ValueError(
                f"flip_rate must lie in [0, 1/2), got {rho!r}: at 1/2 the labels carry no information (ε = 0)."
            )
        self.flip_rate = rho
        self.reduction = _check_reduction(reduction)

    def forward(self, margin: torch.Tensor) -> torch.Tensor:
        """The rDPO loss of each pair's margin.

        Args:
            margin: The implicit-reward margins ``m = β·Δ`` [B], in the observed orientation.

        Returns:
            The reduced loss.
        """
        rho = self.flip_rate
        loss = (-(1 - rho) * F.logsigmoid(margin) + rho * F.logsigmoid(-margin)) / (1 - 2 * rho)
        return _reduce(loss, self.reduction)


class PlackettLuceLoss(nn.Module):
    """Top-1 Plackett–Luce loss over K responses (AUP-RLHF App. B.3): ``−log softmax(scores)[y]``.

    With ``epsilon`` (the per-label K-RR parameter ε'), the K-RR de-biased form of Chowdhury et al.
    §C.4: ``−log p_ỹ + (1/(e^ε' + K − 1))·Σ_k log p_k``, whose gradient has expectation
    ``(e^ε' − 1)/(e^ε' + K − 1)`` times the clean one. For K = 2 it is :class:`BTLLoss` /
    :class:`RRDebiasedRewardLoss`.

    Args:
        epsilon: The per-label K-RR parameter ε', or None for the plain loss.
        normalize: With ``epsilon``, divide by ``(e^ε' − 1)/(e^ε' + K − 1)`` (unbiased).
        reduction: ``"mean"``, ``"sum"`` or ``"none"``.

    Raises:
        ValueError: If ``epsilon`` is given and not a finite number > 0, or ``reduction`` is unknown.
    """

    def __init__(self, epsilon: Optional[float] = None, normalize: bool = False, reduction: str = "mean"):
        super().__init__()
        self.epsilon = None if epsilon is None else check_epsilon(epsilon, "epsilon")
        self.normalize = normalize
        self.reduction = _check_reduction(reduction)

    def forward(self, scores: torch.Tensor, observed: torch.Tensor) -> torch.Tensor:
        """The loss of each ranking.

        Args:
            scores: The responses' scores [B, K].
            observed: The index of the (privatized) top response [B].

        Returns:
            The reduced loss.

        Raises:
            ValueError: If ``scores`` is not of shape [B, K] with K ≥ 2.
        """
        if scores.dim() != 2 or scores.shape[1] < 2:
            raise ValueError(f"scores must have shape [B, K] with K >= 2, got {tuple(scores.shape)}.")
        logp = F.log_softmax(scores, dim=-1)
        loss = -logp.gather(1, observed.long().view(-1, 1)).squeeze(1)
        if self.epsilon is not None:
            k = scores.shape[1]
            move, keep = rr_move_probability(self.epsilon, k), rr_keep_probability(self.epsilon, k)
            loss = loss + logp.sum(dim=1) * move
            if self.normalize:
                loss = loss / (keep - move)
        return _reduce(loss, self.reduction)
