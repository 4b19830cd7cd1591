"""The linear BTL world of the theory: data generation and one estimator per mechanism."""

from .btl import BTLData, generate_btl_data, project_theta, sample_theta_star
from .user_level import (
    SGDResult,
    aup_rlhf,
    group_dpsgd,
    theorem4_lr,
    theorem4_tau,
    user_dpsgd,
    user_dpsgd_adaptive_clip,
    user_gradients,
    user_objective_perturbation,
    user_rr_mle,
)
from .estimators import (
    curvature_gamma,
    debiased_labels,
    fit_logistic,
    mle,
    objective_perturbation,
    objective_perturbation_sigma,
    rr_debiased_mle,
    sgd_rr,
)

__all__ = [
    "BTLData",
    "SGDResult",
    "aup_rlhf",
    "group_dpsgd",
    "theorem4_lr",
    "theorem4_tau",
    "user_dpsgd",
    "user_dpsgd_adaptive_clip",
    "user_gradients",
    "user_objective_perturbation",
    "user_rr_mle",
    "curvature_gamma",
    "debiased_labels",
    "fit_logistic",
    "generate_btl_data",
    "mle",
    "objective_perturbation",
    "objective_perturbation_sigma",
    "project_theta",
    "rr_debiased_mle",
    "sample_theta_star",
    "sgd_rr",
]
