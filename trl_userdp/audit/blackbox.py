"""The black-box audit of a trained reward model or DPO policy (docs/audit.md): canary users whose preference pairs
carry a signal only they hold, scored by the model's margin on those pairs.

Canary user ``c`` prefers ``A_c`` to ``B_c``, two strings of tokens drawn at random from the tokenizer's vocabulary
(distinct tokens for every canary, when the vocabulary allows: no other pair, canary or not, moves their embeddings).
A model trained on ``c`` ranks ``A_c`` above ``B_c`` by more than chance; one that never saw ``c`` has only its
initialisation's margin.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Dict, List, Optional

import numpy as np
import torch

from ..accountants.accountant import DPAccountingAccountant
from ..validators import check_confidence
from .bounds import audit_scores, each_test_confidence
from .canaries import DRAW_FILENAME, CanaryDraw
from .fdp import audit_curve, run_curves
from .report import AuditReport

#: the canary users' pairs, beside their draw (:data:`~trl_userdp.audit.canaries.DRAW_FILENAME`)
CANARIES_FILENAME = "canaries.json"


def _whole_tokens(tokenizer: Any, needed: int, rng: np.random.Generator) -> np.ndarray:
    """``needed`` tokens in a random order, each standing for a printable text of its own: not special, and read back
    as itself (a byte-level token holding part of a character decodes to "\ufffd", which many tokens share). Distinct
    while the vocabulary has that many; then drawn again from those it has.

    Args:
        tokenizer: the tokenizer.
        needed: how many tokens.
        rng: the source of the order.

    Returns:
        ``[needed]`` token ids.

    Raises:
        ValueError: the vocabulary has no such token.
    """
    special = set(tokenizer.all_special_ids)
    whole = []
    for i in rng.permutation(len(tokenizer)).tolist():  # stops as soon as it has enough: a vocabulary can be large
        text = tokenizer.decode([i])
        if i not in special and text.strip() and text.isprintable() and "\ufffd" not in text \
                and tokenizer(text, add_special_tokens=False)["input_ids"] == [i]:
            whole.append(i)
            if len(whole) == needed:
                return np.array(whole)
    if not whole:
        raise ValueError("The tokenizer has no token that reads back as itself to write canary pairs with.")
    return rng.choice(np.array(whole), needed)


@dataclasses.dataclass(frozen=True)
class PreferenceCanaries:
    """``m`` canary users, each with ``pairs_per_user`` copies of its own pair ``(prompt, A_c, B_c)``.

    Args:
        draw: the secret inclusion draw.
        prompt: the prompt of every canary pair.
        chosen: ``A_c`` per canary.
        rejected: ``B_c`` per canary.
        pairs_per_user: the records of each canary user.
        user_prefix: canary ``c``'s user id is ``f"{user_prefix}{c}"``.
    """

    draw: CanaryDraw
    prompt: str
    chosen: List[str]
    rejected: List[str]
    pairs_per_user: int = 1
    user_prefix: str = "canary-"

    @classmethod
    def make(cls, tokenizer: Any, m: int, *, tokens: int = 2, pairs_per_user: int = 1, prompt: str = "",
             seed: Optional[int] = None, user_prefix: str = "canary-") -> "PreferenceCanaries":
        """Draw ``m`` canary users' pairs from ``tokenizer``'s vocabulary and their inclusion.

        Args:
            tokenizer: the model's tokenizer (only tokens that read back as themselves are drawn; no special one).
            m: the number of canary users.
            tokens: the tokens of each of ``A_c`` and ``B_c``.
            pairs_per_user: the records of each canary user (copies of its pair).
            prompt: the prompt of every canary pair.
            seed: seeds the inclusion draw and the strings (None: the OS).
            user_prefix: the canaries' user ids start with it.

        Returns:
            The canaries.
        """
        draw = CanaryDraw.draw(m, seed)
        ids = _whole_tokens(tokenizer, 2 * m * tokens, np.random.default_rng([draw.seed, 1]))
        texts = [tokenizer.decode(row.tolist()) for row in ids.reshape(2 * m, tokens)]
        return cls(draw, prompt, texts[:m], texts[m:], pairs_per_user, user_prefix)

    def save(self, directory: str) -> str:
        """Write the canaries to ``directory``: their secret draw (``canary_draw.json``) and their pairs
        (``canaries.json``), for an audit of a model trained elsewhere on :meth:`add_to`'s data (keep the folder from
        whoever holds the model).

        Args:
            directory: the auditor's folder.

        Returns:
            The path of ``canaries.json``.
        """
        self.draw.save(directory)
        path = os.path.join(directory, CANARIES_FILENAME)
        with open(path, "w") as f:
            json.dump({"prompt": self.prompt, "chosen": self.chosen, "rejected": self.rejected,
                       "pairs_per_user": self.pairs_per_user, "user_prefix": self.user_prefix}, f)
        return path

    @classmethod
    def load(cls, directory: str) -> "PreferenceCanaries":
        """Read canaries written by :meth:`save`.

        Args:
            directory: the auditor's folder.

        Returns:
            The canaries.

        Raises:
            ValueError: the folder holds no canaries, or pairs that do not match their draw.
        """
        if not os.path.isfile(os.path.join(directory, CANARIES_FILENAME)) or \
                not os.path.isfile(os.path.join(directory, DRAW_FILENAME)):
            raise ValueError(f"{directory!r} holds no canaries ({CANARIES_FILENAME} and {DRAW_FILENAME}): plant them "
                             "first (trl-userdp audit --plant_into, docs/audit.md).")
        draw = CanaryDraw.load(directory)
        with open(os.path.join(directory, CANARIES_FILENAME)) as f:
            state = json.load(f)
        if not (len(state["chosen"]) == len(state["rejected"]) == draw.m):
            raise ValueError(f"{directory}: {CANARIES_FILENAME} does not hold one pair per canary of the draw.")
        return cls(draw, state["prompt"], list(state["chosen"]), list(state["rejected"]), int(state["pairs_per_user"]),
                   state["user_prefix"])

    def rows(self, user_column: str = "user_id", first_id: Optional[int] = None) -> Dict[str, list]:
        """The included canary users' records, as columns of a preference dataset.

        Args:
            user_column: the name of the user column.
            first_id: integer user ids from this one on (canary ``c`` is ``first_id + c``), for a dataset whose users
                are integers; None: ``f"{user_prefix}{c}"``.

        Returns:
            ``prompt``, ``chosen``, ``rejected`` and the user column.
        """
        members = np.repeat(np.flatnonzero(self.draw.included), self.pairs_per_user)
        users = [f"{self.user_prefix}{c}" if first_id is None else first_id + int(c) for c in members]
        return {"prompt": [self.prompt] * len(members), "chosen": [self.chosen[c] for c in members],
                "rejected": [self.rejected[c] for c in members], user_column: users}

    def add_to(self, dataset: Any, user_column: str = "user_id") -> Any:
        """``dataset`` (a ``datasets.Dataset`` of preference pairs) with the included canary users' records appended.

        Args:
            dataset: the real users' pairs, with ``prompt``, ``chosen``, ``rejected`` and the user column.
            user_column: the user column.

        Returns:
            The concatenated dataset (its other columns dropped; without a ``prompt`` column if it has none).

        Raises:
            ValueError: a real user's id starts with the canaries' prefix, or the canaries have a prompt and the
                dataset no ``prompt`` column.
        """
        import datasets

        users = dataset[user_column]
        integer_ids = str(getattr(dataset.features[user_column], "dtype", "")).startswith(("int", "uint"))
        if not integer_ids and any(str(u).startswith(self.user_prefix) for u in users):
            raise ValueError(f"A user id of the dataset starts with {self.user_prefix!r}, the canaries' prefix: pass "
                             "another user_prefix.")
        columns = [c for c in ("prompt", "chosen", "rejected") if c in dataset.column_names] + [user_column]
        if "prompt" not in columns and self.prompt:
            raise ValueError("The canaries have a prompt but the dataset has no 'prompt' column.")
        real = dataset.select_columns(columns)
        first_id = int(max(users)) + 1 if integer_ids else None  # integer users: canaries after the largest id
        rows = {c: v for c, v in self.rows(user_column, first_id).items() if c in columns}
        canaries = datasets.Dataset.from_dict(rows).cast(real.features)
        return datasets.concatenate_datasets([real, canaries])

    @torch.no_grad()
    def scores(self, model: torch.nn.Module, tokenizer: Any, reference: Optional[torch.nn.Module] = None,
               batch_size: int = 32) -> np.ndarray:
        """Each canary's margin under the model: for a reward model ``r(prompt + A_c) − r(prompt + B_c)``, tokenized as
        TRL's ``RewardTrainer`` tokenizes (EOS appended); for a policy with its ``reference``, DPO's implicit reward
        margin ``[log π(A_c|x) − log π_ref(A_c|x)] − [log π(B_c|x) − log π_ref(B_c|x)]`` (completions tokenized apart
        from the prompt, EOS appended, as TRL's ``DPOTrainer``).

        Args:
            model: a one-output sequence-classification reward model, or a causal LM policy.
            tokenizer: its tokenizer.
            reference: the policy's reference model (None: ``model`` is a reward model).
            batch_size: texts per forward pass.

        Returns:
            ``[m]`` margins.
        """
        if reference is None:
            return self._rewards(model, tokenizer, self.chosen, batch_size) - \
                self._rewards(model, tokenizer, self.rejected, batch_size)
        chosen = self._log_probs(model, tokenizer, self.chosen) - self._log_probs(reference, tokenizer, self.chosen)
        rejected = self._log_probs(model, tokenizer, self.rejected) - self._log_probs(reference, tokenizer, self.rejected)
        return chosen - rejected

    def _rewards(self, model: torch.nn.Module, tokenizer: Any, texts: List[str], batch_size: int) -> np.ndarray:
        """The reward model's output on ``prompt + text + EOS`` for each text."""
        model.eval()
        device = next(model.parameters()).device
        eos, out = tokenizer.eos_token or "", []
        for i in range(0, len(texts), batch_size):
            batch = tokenizer([self.prompt + t + eos for t in texts[i:i + batch_size]], return_tensors="pt",
                              padding=True, add_special_tokens=False).to(device)
            out.append(model(**batch).logits[:, 0].float().cpu())
        return torch.cat(out).double().numpy()

    def _log_probs(self, model: torch.nn.Module, tokenizer: Any, texts: List[str]) -> np.ndarray:
        """``log π(text + EOS | prompt)`` under a causal LM, one sequence at a time."""
        model.eval()
        device = next(model.parameters()).device
        prompt = tokenizer(self.prompt, add_special_tokens=False)["input_ids"]
        if tokenizer.bos_token_id is not None:
            prompt = [tokenizer.bos_token_id] + prompt
        out = []
        for text in texts:
            completion = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            ids = torch.tensor([prompt + completion], device=device)
            logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
            out.append(float(torch.log_softmax(logits, -1).gather(1, ids[0, len(prompt):, None]).sum()))
        return np.array(out, dtype=np.float64)

    def audit(self, model: torch.nn.Module, tokenizer: Any, *, delta: float, epsilon_claimed: float,
              reference: Optional[torch.nn.Module] = None, confidence: float = 0.95,
              settings: Optional[Dict[str, Any]] = None,
              accountant: Optional[DPAccountingAccountant] = None) -> AuditReport:
        """Score the canaries on a trained reward model or DPO policy and bound its ε (one run: Steinke et al. 2023, and the f-DP audit of Mahloujifar et al. 2024 given the accountant).

        Args:
            model: the reward model or policy trained on the real users and the included canaries.
            tokenizer: its tokenizer.
            reference: a policy's reference model (None: ``model`` is a reward model).
            delta: the run's δ.
            epsilon_claimed: the ε its privacy report states (``math.inf`` without privacy).
            confidence: the confidence of the bound.
            settings: the run's settings, for the report.
            accountant: the run's accountant, when its curve is the run's claim
                (:func:`~trl_userdp.audit.fdp.audits_curve`): with Gaussian noise (σ > 0) the f-DP audit of that curve
                runs too (:func:`~trl_userdp.audit.fdp.audit_curve`), each test at half the significance.

        Returns:
            The :class:`~trl_userdp.audit.report.AuditReport`.
        """
        check_confidence(confidence)
        scores = self.scores(model, tokenizer, reference)
        included = self.draw.included
        with_curve = accountant is not None and any(sigma > 0 for sigma, _, _ in accountant.history)
        level = each_test_confidence(confidence, 2 if with_curve else 1)
        found = audit_scores(scores, included, delta, level)
        curve = audit_curve(scores, included, run_curves(accountant, delta), level) if with_curve else None
        return AuditReport(
            epsilon_lower=found.epsilon_lower, epsilon_claimed=epsilon_claimed, delta=delta, confidence=confidence,
            canaries=self.draw.m, canaries_in=int(included.sum()), guesses=found.guesses.guesses,
            correct=found.guesses.correct,
            auditor="black-box preference canary users, score: the " + ("reward margin" if reference is None else
                                                                         "implicit reward margin (DPO)"),
            settings={**(settings or {}), "pairs_per_user": self.pairs_per_user, "k_in": found.guesses.k_in,
                      "k_out": found.guesses.k_out, "abstentions_tried": list(found.tried), "level_of_each_test": level,
                      "fdp": None if curve is None else {"guesses": curve.guesses, "correct": curve.correct,
                                                         "scale": curve.scale}},
            scores_in=scores[included].tolist(), scores_out=scores[~included].tolist(),
            epsilon_lower_fdp=None if curve is None else curve.epsilon_lower,
            fdp_claim_rejected=None if curve is None else curve.claim_rejected)
