"""The privacy report saved with every checkpoint and model (docs/mechanisms.md, Accounting)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Dict, Optional

REPORT_FILENAME = "privacy_report.json"


@dataclasses.dataclass
class PrivacyReport:
    """What was spent, under which model, by which mechanism.

    It is meant to be published beside the model, so it holds nothing that ε does not cover: no seeds, no
    secret state, and not the count of rows contribution bounding dropped (it can reveal one user's row count;
    the data owner finds it in ``PrivacyEngine.bounding``).

    Args:
        mechanism: The mechanism's name.
        n_users: The number of users n.
        max_samples_per_user: The contribution bound m (rows per user), if any.
        sample_rate: The user sampling rate q, if any.
        noise_multiplier: The noise multiplier σ, if any.
        steps: The planned number of steps T.
        steps_taken: The number of optimizer steps actually accounted (empty steps included).
        accountant: The accountant's name.
        epsilon: The ε spent (``math.inf`` without privacy).
        delta: The δ of the guarantee.
        neighboring_relation: The unit change the guarantee is about, ``"add_or_remove"`` or ``"replace"``
            one user.
        privacy_unit: What is protected (``"user"``).
        per_user_max_grad_norm: The norm C each user's averaged gradient is clipped to, by clipping mechanisms (the
            trainers' ``per_user_max_grad_norm``; the Trainer's ``max_grad_norm``, which would clip the whole noisy
            step, is off under DP). Reports saved as ``max_grad_norm`` before 0.1.0 load into it.
        concentration_radius: The concentration radius τ of AUP-RLHF.
        extra: Mechanism-specific entries.
    """

    mechanism: str
    n_users: int
    max_samples_per_user: Optional[int]
    sample_rate: Optional[float]
    noise_multiplier: Optional[float]
    steps: Optional[int]
    steps_taken: int
    accountant: str
    epsilon: float
    delta: float
    neighboring_relation: str = "add_or_remove"
    privacy_unit: str = "user"
    per_user_max_grad_norm: Optional[float] = None
    concentration_radius: Optional[float] = None
    extra: Dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> Dict[str, Any]:
        """The report as a JSON-serialisable dictionary.

        Returns:
            The fields by name, with an infinite ε written ``"inf"``.
        """
        d = dataclasses.asdict(self)
        if isinstance(d["epsilon"], float) and math.isinf(d["epsilon"]):
            d["epsilon"] = "inf"
        return d

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "PrivacyReport":
        """The report saved by :meth:`to_dict`.

        Args:
            d: The dictionary (``"inf"`` reads as an infinite ε).

        Returns:
            The report.

        Raises:
            ValueError: If ``d`` has fields the report does not know.
        """
        d = dict(d)
        if "max_grad_norm" in d and "per_user_max_grad_norm" not in d:  # the field's name before 0.1.0
            d["per_user_max_grad_norm"] = d.pop("max_grad_norm")
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"Unknown privacy report fields: {sorted(unknown)}")
        if d.get("epsilon") == "inf":
            d["epsilon"] = math.inf
        return cls(**d)

    def to_markdown(self) -> str:
        """The "Privacy" section of a model card.

        Returns:
            Markdown saying what is protected, by which mechanism, at which (ε, δ), and what is not protected;
            the full statement is ``privacy_report.json``.
        """
        unit = "one user (all of their rows)" if self.privacy_unit == "user" else self.privacy_unit
        if math.isinf(self.epsilon):
            guarantee = "**none**: trained on the users' data without differential privacy (ε = ∞)"
        else:
            guarantee = (f"(ε = {self.epsilon:.4g}, δ = {self.delta:g})-differential privacy for {unit}, under the "
                         f"{self._relation()} relation")
        lines = ["## Privacy", "", f"Trained with trl_userdp: {guarantee}.", "",
                 f"- mechanism: `{self.mechanism}`; accountant: {self.accountant}"
                 + ("" if self.noise_multiplier is None else f"; steps accounted: {self.steps_taken}")]
        if self.n_users:
            lines.append(f"- users: {self.n_users}, at most {self._rows()} each"
                         + ("" if self.sample_rate is None else f"; user sampling rate {self.sample_rate:.4g}")
                         + ("" if self.noise_multiplier is None else f"; noise multiplier {self.noise_multiplier:.4g}"))
        if self.extra.get("protects") == "labels only":
            lines.append("- not protected: the prompts and responses (randomized response privatizes the preference "
                         "labels only)")
        elif not math.isinf(self.epsilon):
            lines.append("- not protected: the number of users and the sampling rate, which are treated as public")
        prompts = self.extra.get("prompts_report")
        if prompts is not None:
            lines.append(f"- the policy's own training on the users' prompts: ε = {float(prompts['epsilon']):.4g}, "
                         f"δ = {prompts['delta']:g}, composed with the reports below (ε and δ add up)")
        if "reward_model_reports" in self.extra and not math.isinf(self.epsilon):
            lines.append("- a policy trained by online RL against private reward model(s) (and from a private starting "
                         "model, if any): post-processing of their guarantees, composed; each is listed in the report")
        lines += ["", f"The full statement is `{REPORT_FILENAME}` beside the model.", ""]
        return "\n".join(lines)

    def summary(self) -> str:
        """One line for a command's output: the guarantee and what spent it (the full statement is the JSON file).

        Returns:
            e.g. ``ε = 3, δ = 0.0001 per user (add-or-remove-one); user_dpsgd, σ = 1.357, 4 steps; 20 users, at
            most 10 rows each``.
        """
        if math.isinf(self.epsilon):
            return f"ε = ∞ (no differential privacy); {self.mechanism}"
        line = (f"ε = {self.epsilon:.4g}, δ = {self.delta:g} per {self.privacy_unit} ({self._relation()}); "
                f"{self.mechanism}")
        if self.noise_multiplier is not None:
            line += f", σ = {self.noise_multiplier:.4g}, {self.steps_taken} steps"
        if self.n_users:
            line += f"; {self.n_users} users, at most {self._rows()} each"
        return line

    def _relation(self) -> str:
        return {"add_or_remove": "add-or-remove-one", "replace": "replace-one"}.get(self.neighboring_relation,
                                                                                     self.neighboring_relation)

    def _rows(self) -> str:
        m = self.max_samples_per_user
        return f"{m} row" if m == 1 else f"{m} rows"

    def to_json(self) -> str:
        """The report as indented JSON with sorted keys.

        Returns:
            The JSON text of :meth:`to_dict`.
        """
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "PrivacyReport":
        """The report saved by :meth:`to_json`.

        Args:
            text: The JSON text.

        Returns:
            The report.

        Raises:
            ValueError: If the text is not JSON or has fields the report does not know.
        """
        return cls.from_dict(json.loads(text))

    def save(self, directory: str) -> str:
        """Write ``privacy_report.json`` into a directory, creating it if needed.

        Args:
            directory: The directory.

        Returns:
            The file's path.
        """
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, REPORT_FILENAME)
        with open(path, "w") as f:
            f.write(self.to_json() + "\n")
        return path

    @classmethod
    def load(cls, path: str) -> "PrivacyReport":
        """Read a report from a ``privacy_report.json`` file or the directory holding one.

        Args:
            path: The file or directory.

        Returns:
            The report.

        Raises:
            OSError: If the file cannot be read.
            ValueError: If it is not a valid report.
        """
        if os.path.isdir(path):
            path = os.path.join(path, REPORT_FILENAME)
        with open(path) as f:
            return cls.from_json(f.read())
