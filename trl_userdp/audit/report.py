"""The audit's report: the audited lower bound beside the claimed ε, the guesses behind it, and the canaries' scores
(docs/audit.md)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Dict, List, Optional

from ..utils.plots import save_figure

REPORT_FILENAME = "audit_report.json"


@dataclasses.dataclass
class AuditReport:
    """One run's audit.

    Args:
        epsilon_lower: the audited lower bound on ε (holds with probability ``confidence``).
        epsilon_claimed: the ε the run reports (its accountant's), at ``delta``.
        delta: the δ of both.
        confidence: the confidence of ``epsilon_lower``.
        canaries: the number of canary users m.
        canaries_in: how many of them the secret draw put in the training data.
        guesses: the guesses behind the bound (the others were abstained on).
        correct: the right ones.
        auditor: what was audited and how (e.g. ``"white-box gradient canaries, score: sum of updates"``).
        settings: the run's path and privacy settings (mechanism, grad_sample_mode, precision, σ, q, T, ...).
        scores_in: the scores of the canaries that were in.
        scores_out: the scores of those that were out.
        epsilon_lower_fdp: the f-DP audit's bound: ε of the weakest claim "the same run at a noise scale" its
            guesses reject (:func:`~trl_userdp.audit.fdp.audit_curve`; None where it was not run).
        fdp_claim_rejected: whether the f-DP audit rejects the run's own trade-off curve (its accountant's claim).
    """

    epsilon_lower: float
    epsilon_claimed: float
    delta: float
    confidence: float
    canaries: int
    canaries_in: int
    guesses: int
    correct: int
    auditor: str
    settings: Dict[str, Any] = dataclasses.field(default_factory=dict)
    scores_in: List[float] = dataclasses.field(default_factory=list)
    scores_out: List[float] = dataclasses.field(default_factory=list)
    epsilon_lower_fdp: Optional[float] = None
    fdp_claim_rejected: Optional[bool] = None

    @property
    def consistent(self) -> bool:
        """Whether the audit is consistent with the claim: the lower bound does not exceed it, and the f-DP audit (if
        run) does not reject the claimed curve. An honest run is called inconsistent with probability at most
        ``1 − confidence`` (the auditors run two tests at half the significance each)."""
        return self.epsilon_lower <= self.epsilon_claimed and not self.fdp_claim_rejected

    def summary(self) -> str:
        """One line: the claim, the audited bound, its confidence and the guesses behind it.

        Returns:
            The line.
        """
        verdict = "consistent with the claim" if self.consistent else "ABOVE the claim: the run leaks more than it says"
        fdp = "" if self.epsilon_lower_fdp is None else (
            f"; f-DP: claimed curve {'REJECTED' if self.fdp_claim_rejected else 'not rejected'}, "
            f"{self.epsilon_lower_fdp:.3g} in its family")
        return (f"ε claimed {self.epsilon_claimed:.3g}, audited lower bound {self.epsilon_lower:.3g} at "
                f"{self.confidence:.0%} (δ = {self.delta:g}; {self.correct} of {self.guesses} guesses right on "
                f"{self.canaries} canary users{fdp}): {verdict}")

    def to_dict(self) -> Dict[str, Any]:
        """The report as JSON-serialisable values (an infinite claimed ε as ``"inf"``).

        Returns:
            The dictionary.
        """
        out = dataclasses.asdict(self)
        out["epsilon_claimed"] = "inf" if math.isinf(self.epsilon_claimed) else self.epsilon_claimed
        return out

    def save(self, directory: str) -> str:
        """Write ``directory/audit_report.json``.

        Args:
            directory: the folder.

        Returns:
            The file's path.
        """
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, REPORT_FILENAME)
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2)
        return path

    @classmethod
    def load(cls, directory: str) -> "AuditReport":
        """Read a report written by :meth:`save`.

        Args:
            directory: the folder.

        Returns:
            The report.
        """
        with open(os.path.join(directory, REPORT_FILENAME)) as f:
            state = json.load(f)
        state["epsilon_claimed"] = float(state["epsilon_claimed"])
        return cls(**state)

    def plot(self, path: str, title: Optional[str] = None) -> str:
        """Histograms of the canaries' scores, in and out (the further apart, the more one user shows).

        Args:
            path: the image file to write (``.png``).
            title: the plot's title (default: :meth:`summary`'s claim and bound).

        Returns:
            ``path``.

        Raises:
            ImportError: matplotlib is not installed (the ``examples`` extra).
        """
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        bins = 40
        ax.hist(self.scores_out, bins=bins, alpha=0.6, label=f"out ({len(self.scores_out)})", density=True)
        ax.hist(self.scores_in, bins=bins, alpha=0.6, label=f"in ({len(self.scores_in)})", density=True)
        ax.set_xlabel("canary user's score")
        ax.set_ylabel("density")
        ax.legend()
        ax.set_title(title or f"ε claimed {self.epsilon_claimed:.3g}, audited ≥ {self.epsilon_lower:.3g} "
                              f"({self.confidence:.0%})", fontsize=10)
        fig.tight_layout()
        save_figure(fig, path, dpi=120)
        plt.close(fig)
        return path
