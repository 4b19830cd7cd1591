"""One-run user-level privacy auditing (Steinke, Nasr and Jagielski 2023; docs/audit.md): canary users, each in the
training data by a secret draw of probability ½, the one-run lower bound on ε from guesses of which were in, the
white-box audit of the engine as implemented, and the black-box audit of a trained reward model or DPO policy."""

from .blackbox import PreferenceCanaries
from .bounds import Guesses, ScoreAudit, audit_scores, epsilon_lower_bound, guess, p_value
from .canaries import CanaryDraw
from .report import AuditReport
from .whitebox import audit_gradient_canaries

__all__ = [
    "AuditReport",
    "CanaryDraw",
    "Guesses",
    "PreferenceCanaries",
    "ScoreAudit",
    "audit_gradient_canaries",
    "audit_scores",
    "epsilon_lower_bound",
    "guess",
    "p_value",
]
