"""Privacy accounting through dp-accounting (docs/mechanisms.md, Accounting)."""

from .analysis import (
    ACCOUNTANT_KINDS,
    GroupPrivacyAccountant,
    calibrate_noise_multiplier,
    compute_delta,
    compute_epsilon,
    group_privacy,
    item_level_target,
    make_accountant,
)
from .budget import PrivacyBudget
from .events import (
    ELSGaussian,
    GroupPrivacyGaussian,
    PoissonGaussian,
    StepEvent,
    TruncatedPoissonGaussian,
    els_event,
    poisson_gaussian_event,
    randomized_response_event,
    randomized_response_noise_parameter,
    truncated_poisson_gaussian_event,
)
from .report import REPORT_FILENAME, PrivacyReport

#: the accountants plug into Opacus's registry, so they are imported on first use: the events, the analysis and the
#: report (all that the mechanisms need) import no Opacus module
_ACCOUNTANTS = ("DPAccountingAccountant", "DPPldAccountant", "DPRdpAccountant")


def __getattr__(name: str):
    if name in _ACCOUNTANTS:
        from . import accountant

        return getattr(accountant, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ACCOUNTANT_KINDS",
    "DPAccountingAccountant",
    "DPPldAccountant",
    "DPRdpAccountant",
    "ELSGaussian",
    "GroupPrivacyGaussian",
    "PoissonGaussian",
    "PrivacyBudget",
    "StepEvent",
    "TruncatedPoissonGaussian",
    "GroupPrivacyAccountant",
    "PrivacyReport",
    "REPORT_FILENAME",
    "calibrate_noise_multiplier",
    "compute_delta",
    "compute_epsilon",
    "els_event",
    "group_privacy",
    "item_level_target",
    "make_accountant",
    "poisson_gaussian_event",
    "randomized_response_event",
    "randomized_response_noise_parameter",
    "truncated_poisson_gaussian_event",
]
