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

    ``neighboring_relation`` names the unit change the guarantee is about ("add_or_remove" or
    "replace" one user); ``max_grad_norm`` is C for clipping mechanisms and
    ``concentration_radius`` is τ for AUP-RLHF; ``steps`` is the planned T and ``steps_taken``
    the number of optimizer steps actually accounted (empty steps included). It is meant to be published
    beside the model, so it holds nothing that ε does not cover: no seeds, no secret state, and not the count
    of rows contribution bounding dropped (it can reveal one user's row count; the data owner finds it in
    ``PrivacyEngine.bounding``).
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
    max_grad_norm: Optional[float] = None
    concentration_radius: Optional[float] = None
    extra: Dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> Dict[str, Any]:
        d = dataclasses.asdict(self)
        if isinstance(d["epsilon"], float) and math.isinf(d["epsilon"]):
            d["epsilon"] = "inf"
        return d

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "PrivacyReport":
        d = dict(d)
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"Unknown privacy report fields: {sorted(unknown)}")
        if d.get("epsilon") == "inf":
            d["epsilon"] = math.inf
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "PrivacyReport":
        return cls.from_dict(json.loads(text))

    def save(self, directory: str) -> str:
        """Write ``privacy_report.json`` into ``directory``; returns the file's path."""
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, REPORT_FILENAME)
        with open(path, "w") as f:
            f.write(self.to_json() + "\n")
        return path

    @classmethod
    def load(cls, path: str) -> "PrivacyReport":
        """Read a report from a ``privacy_report.json`` file or the directory holding one."""
        if os.path.isdir(path):
            path = os.path.join(path, REPORT_FILENAME)
        with open(path) as f:
            return cls.from_json(f.read())
