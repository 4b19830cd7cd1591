"""ε ↔ σ through dp-accounting: accountant construction, ε of an event, σ calibration,
and the group-privacy conversion (docs/mechanisms.md, M2).

Accountant kinds: ``"rdp"`` (dp-accounting ``RdpAccountant`` on :data:`RDP_ORDERS`) and ``"pld"``
(dp-accounting ``PLDAccountant``, as :class:`StepPLDAccountant`, which builds each step's distribution once).
Neighbouring relations: ``"add_or_remove"`` (one user added or removed; the Opacus and
dp-accounting convention) and ``"replace"`` (one user's data replaced; the papers' definition,
PLD only for subsampled Gaussians).
"""

from __future__ import annotations

import collections
import functools
import logging
import math
from typing import Callable, Dict, Optional, Sequence, Tuple

import dp_accounting as dpa
from dp_accounting import pld as dpa_pld
from dp_accounting import rdp as dpa_rdp

from ..validators import check_delta, check_epsilon, check_max_samples_per_user

# dp-accounting logs a warning each time a fractional RDP order fails to converge at small σ; the
# order is then excluded (ε can only grow), so the message is noise for users.
logging.getLogger("absl").addFilter(lambda record: "failed to converge" not in record.getMessage())

ACCOUNTANT_KINDS = ("rdp", "pld")
NEIGHBORING_RELATIONS = {
    "add_or_remove": dpa.NeighboringRelation.ADD_OR_REMOVE_ONE,
    "replace": dpa.NeighboringRelation.REPLACE_ONE,
}
#: RDP orders: Opacus's defaults (1.1 … 63: ``RDPAccountant.DEFAULT_ALPHAS``, spelled here so that only
#: accountant.py, which plugs into Opacus, imports it; tests/accountants/test_rdp_orders.py checks they agree) plus dp-accounting's large orders, without which ε
#: cannot fall below about log(1/δ)/62 (small item-level ε for group privacy needs them). Pass the
#: same list as ``alphas`` to Opacus's ``rdp`` accountant to compare. At integer orders both
#: libraries agree to float precision; at fractional orders dp-accounting 0.6 is slightly
#: conservative (its series drops the sign of negative binomial coefficients; see
#: tests/accountants/test_rdp_orders.py), which can only over-state ε.
RDP_ORDERS: Tuple[float, ...] = (tuple(1 + x / 10.0 for x in range(1, 100)) + tuple(range(12, 64))  # Opacus's
                                  + (128, 256, 512, 1024))
#: Integer orders only: there dp-accounting's subsampled-Gaussian RDP is exact.
INTEGER_RDP_ORDERS: Tuple[int, ...] = tuple(range(2, 65)) + (128, 256, 512, 1024)
#: PLD discretisation (dp-accounting's default).
PLD_DISCRETIZATION = 1e-4


def check_accountant(kind: str) -> str:
    """Check an accountant kind.

    Args:
        kind: ``"rdp"`` or ``"pld"``.

    Returns:
        ``kind``.

    Raises:
        ValueError: If ``kind`` is not in :data:`ACCOUNTANT_KINDS`.
    """
    if kind not in ACCOUNTANT_KINDS:
        raise ValueError(f"accountant must be one of {ACCOUNTANT_KINDS}, got {kind!r}.")
    return kind


def neighboring_relation(name: str) -> dpa.NeighboringRelation:
    """The dp-accounting neighbouring relation of a name.

    Args:
        name: ``"add_or_remove"`` (one user added or removed) or ``"replace"`` (one user's data replaced).

    Returns:
        The ``dp_accounting.NeighboringRelation``.

    Raises:
        ValueError: If ``name`` is not in :data:`NEIGHBORING_RELATIONS`.
    """
    try:
        return NEIGHBORING_RELATIONS[name]
    except KeyError:
        raise ValueError(
            f"neighboring_relation must be one of {tuple(NEIGHBORING_RELATIONS)}, got {name!r}."
        ) from None


class GroupPrivacyAccountant(dpa.PrivacyAccountant):
    """An item-level dp-accounting accountant that reports the user-level guarantee of group privacy.

    An item-level ``(ε₀, δ₀)`` guarantee implies ``(m·ε₀, m·e^{(m−1)ε₀}·δ₀)`` for a group of m records
    (docs/mechanisms.md, M2, Chua et al. 2024).

    Args:
        inner: The item-level accountant that composes the events.
        group_size: The group size m (records per user).

    Raises:
        ValueError: If ``group_size`` is not an integer ≥ 1.
    """

    def __init__(self, inner: dpa.PrivacyAccountant, group_size: int):
        super().__init__(inner.neighboring_relation)
        self._inner = inner
        self._m = check_max_samples_per_user(group_size, "group_size")

    def _maybe_compose(self, event, count, do_compose):
        return self._inner._maybe_compose(event, count, do_compose)

    def get_delta(self, target_epsilon: float) -> float:
        """User-level δ at ε: ``m·e^{(m−1)ε₀}·δ₀(ε₀)`` with ``ε₀ = ε/m``, capped at 1.

        Args:
            target_epsilon: The user-level ε.

        Returns:
            The user-level δ.
        """
        m = self._m
        eps0 = target_epsilon / m
        delta0 = self._inner.get_delta(eps0)
        if delta0 <= 0:
            return 0.0
        return math.exp(min(0.0, math.log(m) + (m - 1) * eps0 + math.log(delta0)))

    def get_epsilon(self, target_delta: float) -> float:
        """Smallest user-level ε (to 1e-6 relative) with ``get_delta(ε) ≤ δ``, by bisection.

        Args:
            target_delta: The user-level δ.

        Returns:
            The user-level ε (``math.inf`` if it exceeds 1e6).
        """
        if self._m == 1:
            return self._inner.get_epsilon(target_delta)
        lo, hi = 0.0, max(1.0, self._m * self._inner.get_epsilon(target_delta / self._m))
        while self.get_delta(hi) > target_delta:
            lo, hi = hi, 2 * hi
            if hi > 1e6:
                return math.inf
        if self.get_delta(lo) <= target_delta:
            return lo
        while hi - lo > 1e-6 * hi:
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if self.get_delta(mid) <= target_delta else (mid, hi)
        return hi


class StepPLDAccountant(dpa_pld.PLDAccountant):
    """dp-accounting's PLD accountant, which builds the privacy-loss distribution of one subsampled step once per
    process and setting (:func:`_step_pld`) instead of at every composition.

    ``PLDAccountant`` composes ``T`` steps as the step's distribution (``from_gaussian_mechanism``, or the truncated
    or mixture one) self-composed ``T`` times, and builds that distribution anew each time: seconds at a small σ on a
    fine grid, and ε after each step of a run, or the budget's search over ``T``, asks for the same step again and
    again. Here the step's distribution comes from the memo and the rest is dp-accounting's own composition, so ε is
    the same number ``PLDAccountant`` gives (tests/accountants/test_analysis.py).
    """

    def _maybe_compose(self, event: dpa.DpEvent, count: int, do_compose: bool):
        if do_compose and count >= 1:
            step = _step_pld(event, self.neighboring_relation, self._value_discretization_interval)
            if step is not None:
                self._pld = self._pld.compose(step.self_compose(count))
                return None
        return super()._maybe_compose(event, count, do_compose)


#: how many steps' distributions :func:`_step_pld` keeps (one is a few MB at the default grid)
STEP_PLD_MEMO_SIZE = 32
_STEP_PLDS: "collections.OrderedDict[Tuple[str, dpa.NeighboringRelation, float], object]" = collections.OrderedDict()


def _step_pld(event: dpa.DpEvent, relation: dpa.NeighboringRelation, interval: float):
    """The privacy-loss distribution of one step for the events ``PLDAccountant`` self-composes (a Poisson-subsampled
    Gaussian, a truncated subsampled Gaussian, a mixture of Gaussians), built as ``PLDAccountant`` builds it and kept
    for the :data:`STEP_PLD_MEMO_SIZE` latest settings (keyed by the event's ``repr``: a mixture's fields are lists);
    ``None`` for any other event, or a degenerate one (zero noise or sampling), which ``PLDAccountant`` handles."""
    pld = dpa_pld.privacy_loss_distribution
    if isinstance(event, dpa.PoissonSampledDpEvent) and isinstance(event.event, dpa.GaussianDpEvent):
        if event.sampling_probability == 0 or event.event.noise_multiplier == 0:
            return None
        build = functools.partial(
            pld.from_gaussian_mechanism, standard_deviation=event.event.noise_multiplier,
            value_discretization_interval=interval, sampling_prob=event.sampling_probability,
            neighboring_relation=relation)
    elif isinstance(event, dpa.TruncatedSubsampledGaussianDpEvent):
        if 0 in (event.sampling_probability, event.truncated_batch_size, event.dataset_size, event.noise_multiplier):
            return None
        build = functools.partial(
            pld.from_truncated_subsampled_gaussian_mechanism, dataset_size=event.dataset_size,
            sampling_probability=event.sampling_probability, truncated_batch_size=event.truncated_batch_size,
            noise_multiplier=event.noise_multiplier, value_discretization_interval=interval,
            neighboring_relation=relation)
    elif (isinstance(event, dpa.dp_event.MixtureOfGaussiansDpEvent)
          and relation == dpa.NeighboringRelation.ADD_OR_REMOVE_ONE):
        if event.standard_deviation == 0 or list(event.sensitivities) == [0.0]:
            return None
        build = functools.partial(
            pld.from_mixture_gaussian_mechanism, standard_deviation=event.standard_deviation,
            sensitivities=event.sensitivities, sampling_probs=event.sampling_probs,
            value_discretization_interval=interval)
    else:  # decided before the key: a composed event's repr is as long as its history
        return None
    key = (repr(event), relation, interval)
    if key in _STEP_PLDS:
        _STEP_PLDS.move_to_end(key)
        return _STEP_PLDS[key]
    step = _STEP_PLDS[key] = build()
    if len(_STEP_PLDS) > STEP_PLD_MEMO_SIZE:
        _STEP_PLDS.popitem(last=False)
    return step


def make_accountant(
    kind: str = "rdp",
    relation: str = "add_or_remove",
    group_size: Optional[int] = None,
    orders: Optional[Sequence[float]] = None,
    value_discretization_interval: float = PLD_DISCRETIZATION,
) -> dpa.PrivacyAccountant:
    """A fresh dp-accounting accountant.

    Args:
        kind: ``"rdp"`` or ``"pld"``.
        relation: The neighbouring relation, ``"add_or_remove"`` or ``"replace"``.
        group_size: If given, the accountant reports group-privacy ε for groups of this many records
            (:class:`GroupPrivacyAccountant`).
        orders: RDP orders; default :data:`RDP_ORDERS`.
        value_discretization_interval: PLD's discretisation (coarser is faster and still an upper bound:
            dp-accounting rounds pessimistically).

    Returns:
        A ``dp_accounting.PrivacyAccountant``.

    Raises:
        ValueError: If ``kind`` or ``relation`` is unknown, or ``group_size`` is not an integer ≥ 1.
    """
    check_accountant(kind)
    rel = neighboring_relation(relation)
    if kind == "rdp":
        acc = dpa_rdp.RdpAccountant(orders=tuple(orders or RDP_ORDERS), neighboring_relation=rel)
    else:
        acc = StepPLDAccountant(neighboring_relation=rel, value_discretization_interval=value_discretization_interval)
    return acc if group_size is None else GroupPrivacyAccountant(acc, group_size)


def _compose(event, kind, relation, group_size, **options) -> dpa.PrivacyAccountant:
    acc = make_accountant(kind, relation, group_size, **options)
    if not acc.supports(event):
        hint = " (try accountant='pld')" if kind == "rdp" else ""
        raise ValueError(
            f"dp-accounting's {kind} accountant cannot account {type(event).__name__} under the "
            f"{relation!r} relation{hint}: {acc._maybe_compose(event, 1, False).error_message}"
        )
    return acc.compose(event)


def compute_epsilon(
    event: dpa.DpEvent,
    delta: float,
    *,
    accountant: str = "rdp",
    relation: str = "add_or_remove",
    group_size: Optional[int] = None,
    **options,
) -> float:
    """ε at ``delta`` of an event.

    Args:
        event: A dp-accounting event (one of :mod:`trl_userdp.accountants.events`).
        delta: The target δ.
        accountant: ``"rdp"`` or ``"pld"``.
        relation: The neighbouring relation, ``"add_or_remove"`` or ``"replace"``.
        group_size: If given, report group-privacy ε for groups of this many records.
        **options: Passed to :func:`make_accountant`.

    Returns:
        ε.

    Raises:
        ValueError: If ``delta`` is not in (0, 1), an option is invalid, or the accountant cannot account
            ``event`` under ``relation``.
    """
    check_delta(delta, "delta")
    return float(_compose(event, accountant, relation, group_size, **options).get_epsilon(delta))


def compute_delta(
    event: dpa.DpEvent,
    epsilon: float,
    *,
    accountant: str = "rdp",
    relation: str = "add_or_remove",
    group_size: Optional[int] = None,
    **options,
) -> float:
    """δ at ``epsilon`` of an event.

    Args:
        event: A dp-accounting event (one of :mod:`trl_userdp.accountants.events`).
        epsilon: The target ε ≥ 0.
        accountant: ``"rdp"`` or ``"pld"``.
        relation: The neighbouring relation, ``"add_or_remove"`` or ``"replace"``.
        group_size: If given, report group-privacy δ for groups of this many records.
        **options: Passed to :func:`make_accountant`.

    Returns:
        δ.

    Raises:
        ValueError: If ``epsilon`` < 0, an option is invalid, or the accountant cannot account ``event``
            under ``relation``.
    """
    if not epsilon >= 0:
        raise ValueError(f"epsilon must be >= 0, got {epsilon!r}.")
    return float(_compose(event, accountant, relation, group_size, **options).get_delta(epsilon))


class _RememberingAccountant(dpa.PrivacyAccountant):
    """A fresh dp-accounting accountant of ``make()`` whose ε at δ is computed once per composed event, in ``memo``:
    dp-accounting's Brent search (``calibrate_dp_mechanism``) asks again for the ε of the bracket's ends, which the
    bracket search has just computed, and each PLD ε takes about a second.

    Args:
        make: returns the fresh accountant that computes.
        memo: ``(repr(event), δ) -> ε``, shared by the accountants of one calibration.
    """

    def __init__(self, make: Callable[[], dpa.PrivacyAccountant], memo: Dict[Tuple[str, float], float]):
        self._make, self._memo = make, memo
        self._probe = make()
        super().__init__(self._probe.neighboring_relation)

    def _maybe_compose(self, event, count, do_compose):
        return self._probe._maybe_compose(event, count, False)  # composed by get_epsilon, from the ledger

    def get_epsilon(self, target_delta: float) -> float:
        """ε at ``target_delta`` of the events composed so far (from ``memo`` when known).

        Args:
            target_delta: δ.

        Returns:
            ε, as the accountant of ``make()`` computes it.
        """
        key = (repr(self.ledger), float(target_delta))
        if key not in self._memo:
            self._memo[key] = self._make().compose(self.ledger).get_epsilon(target_delta)
        return self._memo[key]


def calibrate_noise_multiplier(
    make_event: Callable[[float], dpa.DpEvent],
    *,
    target_epsilon: float,
    target_delta: float,
    accountant: str = "rdp",
    relation: str = "add_or_remove",
    group_size: Optional[int] = None,
    tol: float = 1e-4,
    min_sigma: float = 0.05,
    max_sigma: float = 1e4,
    start: float = 1.0,
    factor: float = 2.0,
    **options,
) -> float:
    """Smallest σ (within ``tol``) whose event meets ``(target_epsilon, target_delta)``.

    A bracket is found by multiplying or dividing by ``factor`` from σ = ``start``, then dp-accounting's
    ``calibrate_dp_mechanism`` bisects (Brent) inside it. The returned σ never exceeds the budget.

    Args:
        make_event: Maps a noise multiplier σ to the dp-accounting event of the whole run.
        target_epsilon: The target ε.
        target_delta: The target δ.
        accountant: ``"rdp"`` or ``"pld"``.
        relation: The neighbouring relation, ``"add_or_remove"`` or ``"replace"``.
        group_size: If given, the target is group-privacy ε for groups of this many records.
        tol: The tolerance on σ.
        min_sigma: The smallest σ searched.
        max_sigma: The largest σ searched.
        start: Where the bracket search starts (any σ in range is correct; one near the answer is faster).
        factor: The search's step (σ multiplied or divided by it until ε crosses the target), > 1.
        **options: Passed to :func:`make_accountant`.

    Returns:
        The noise multiplier σ.

    Raises:
        ValueError: If a target or ``accountant`` is invalid, if the target needs σ above ``max_sigma``,
            or if it is met even at ``min_sigma``.
    """
    check_epsilon(target_epsilon)
    check_delta(target_delta)
    check_accountant(accountant)

    memo: Dict[Tuple[str, float], float] = {}

    def fresh() -> _RememberingAccountant:
        return _RememberingAccountant(lambda: make_accountant(accountant, relation, group_size, **options), memo)

    def eps(sigma: float) -> float:
        event, probe = make_event(sigma), fresh()
        if not probe.supports(event):
            _compose(event, accountant, relation, group_size, **options)  # raises with the reason and a hint
        return probe.compose(event).get_epsilon(target_delta)

    lo = hi = min(max(float(start), min_sigma), max_sigma)
    if eps(hi) > target_epsilon:
        while eps(hi) > target_epsilon:
            lo, hi = hi, factor * hi
            if hi > max_sigma:
                raise ValueError(
                    f"target_epsilon={target_epsilon} at target_delta={target_delta} needs a noise multiplier "
                    f"above {max_sigma}: the privacy budget is too small for this many steps."
                )
    else:
        while eps(lo) <= target_epsilon:
            hi, lo = lo, lo / factor
            if lo < min_sigma:
                raise ValueError(
                    f"target_epsilon={target_epsilon} is met even with a noise multiplier of {min_sigma}: "
                    "the budget does not constrain training; choose a smaller target_epsilon or more steps."
                )
    sigma = dpa.calibrate_dp_mechanism(
        fresh,
        make_event,
        target_epsilon,
        target_delta,
        bracket_interval=dpa.ExplicitBracketInterval(lo, hi),
        tol=tol,
    )
    if sigma is None:  # Brent did not converge: fall back to the safe end of the bracket
        sigma = hi
    return float(sigma)


def group_privacy(epsilon0: float, delta0: float, group_size: int) -> Tuple[float, float]:
    """Item-level ``(ε₀, δ₀)`` → guarantee for a group of ``m`` records: ``(mε₀, m e^{(m−1)ε₀} δ₀)``.

    Args:
        epsilon0: The item-level ε₀.
        delta0: The item-level δ₀.
        group_size: The group size m.

    Returns:
        The group-level ``(ε, δ)``.

    Raises:
        ValueError: If ``group_size`` is not an integer ≥ 1.
    """
    m = check_max_samples_per_user(group_size, "group_size")
    return m * epsilon0, m * math.exp((m - 1) * epsilon0) * delta0


def item_level_target(epsilon: float, delta: float, group_size: int) -> Tuple[float, float]:
    """Inverse of :func:`group_privacy` at ``ε₀ = ε/m``: the item-level target implying ``(ε, δ)``.

    Args:
        epsilon: The group-level (user-level) ε.
        delta: The group-level δ.
        group_size: The group size m.

    Returns:
        The item-level ``(ε₀, δ₀) = (ε/m, δ / (m e^{(m−1)ε₀}))``.

    Raises:
        ValueError: If ``epsilon`` is not > 0, ``delta`` is not in (0, 1), or ``group_size`` is not an
            integer ≥ 1.
    """
    check_epsilon(epsilon, "epsilon")
    check_delta(delta, "delta")
    m = check_max_samples_per_user(group_size, "group_size")
    eps0 = epsilon / m
    return eps0, delta / (m * math.exp((m - 1) * eps0))

