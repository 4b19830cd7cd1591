"""One-run user-level privacy auditing (Steinke, Nasr and Jagielski 2023; docs/audit.md): canary users, each in the
training data by a secret draw of probability ½, the one-run lower bound on ε from guesses of which were in, the
f-DP audit of the run's own trade-off curve (Mahloujifar, Melis and Chaudhuri 2024), the white-box audit of the
engine as implemented, and the black-box audit of a trained reward model or DPO policy."""

from .blackbox import PreferenceCanaries
from .bounds import Guesses, ScoreAudit, audit_scores, epsilon_lower_bound, guess, p_value
from .canaries import CanaryDraw
from .fdp import CurveAudit, TradeOffCurve, audit_curve, run_curves
from .report import AuditReport
from .whitebox import audit_gradient_canaries

__all__ = [
    "AuditReport",
    "CanaryDraw",
    "CurveAudit",
    "Guesses",
    "PreferenceCanaries",
    "ScoreAudit",
    "TradeOffCurve",
    "audit_curve",
    "audit_gradient_canaries",
    "audit_scores",
    "epsilon_lower_bound",
    "guess",
    "p_value",
    "run_curves",
]
