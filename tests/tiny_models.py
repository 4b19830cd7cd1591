"""Tiny Hugging Face models built from configs (no downloads) and a preference batch builder."""

from types import SimpleNamespace

import numpy as np
import torch
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers import (GPT2Config, GPT2ForSequenceClassification, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM,
                          LlamaForSequenceClassification)

VOCAB = 64


def tiny_llama_rm() -> nn.Module:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=2, max_position_embeddings=64, num_labels=1, pad_token_id=0)
    return LlamaForSequenceClassification(cfg)


def tiny_gpt2_rm() -> nn.Module:
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=2, n_positions=64, num_labels=1, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2ForSequenceClassification(cfg)


class TiedRewardModel(nn.Module):
    """A reward model whose score is read through a tied LM head (lm_head.weight is embed_tokens.weight)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                          num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, tie_word_embeddings=True)
        self.lm = LlamaForCausalLM(cfg)
        assert self.lm.lm_head.weight is self.lm.model.embed_tokens.weight

    def forward(self, input_ids, attention_mask=None):
        logits = self.lm(input_ids=input_ids, attention_mask=attention_mask).logits
        return SimpleNamespace(logits=logits[:, -1, :1])


def with_lora(model: nn.Module, targets) -> nn.Module:
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0, init_lora_weights=False,
                     task_type="SEQ_CLS", fan_in_fan_out=targets == ["c_attn"])
    return get_peft_model(model, cfg)


MODELS = {
    "llama": lambda: tiny_llama_rm(),
    "llama_lora": lambda: with_lora(tiny_llama_rm(), ["q_proj", "v_proj"]),
    "gpt2": lambda: tiny_gpt2_rm(),
    "gpt2_lora": lambda: with_lora(tiny_gpt2_rm(), ["c_attn"]),
    "tied": lambda: TiedRewardModel(),
}


def preference_dataset(n_users=6, pairs_per_user=3, seed=0) -> Dataset:
    """Random token pairs; ``pairs_per_user`` is one count for everyone or one count per user."""
    rng = np.random.default_rng(seed)
    counts = np.broadcast_to(np.asarray(pairs_per_user), (n_users,))
    n = int(counts.sum())
    seq = lambda: [int(t) for t in rng.integers(1, VOCAB, rng.integers(3, 9))]  # noqa: E731
    return Dataset.from_dict(
        {
            "chosen_ids": [seq() for _ in range(n)],
            "rejected_ids": [seq() for _ in range(n)],
            "user_id": [f"user{u}" for u in np.repeat(np.arange(n_users), counts)],
        }
    )


def btl_pair_losses(model, batch) -> torch.Tensor:
    """Per-pair Bradley-Terry loss for a TRL [chosen; rejected] batch."""
    rewards = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.squeeze(-1)
    chosen, rejected = rewards.chunk(2)
    return -torch.nn.functional.logsigmoid(chosen - rejected)


def tiny_tokenizer():
    """A byte-level BPE tokenizer trained offline on a few movie-review phrases."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["the movie was great and fun", "the movie was bad and boring", "i loved the acting", "i hated the plot"]
    tok.train_from_iterator(corpus * 50, trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def tiny_llama_lm(vocab_size: int, tie: bool = False) -> nn.Module:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                      tie_word_embeddings=tie)
    return LlamaForCausalLM(cfg)


def tiny_gpt2_lm(vocab_size: int, dropout: float = 0.0) -> nn.Module:
    """A causal GPT-2 (learned absolute positions, tied embeddings), without dropout (GPT-2's default is 0.1)."""
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=vocab_size, n_embd=16, n_layer=2, n_head=2, n_positions=128,
                                      pad_token_id=0, bos_token_id=1, eos_token_id=2, resid_pdrop=dropout,
                                      embd_pdrop=dropout, attn_pdrop=dropout))


def text_preference_dataset(n_users=4, pairs_per_user=3, seed=0) -> Dataset:
    rng = np.random.default_rng(seed)
    good = ["the movie was great", "i loved the acting", "great and fun"]
    bad = ["the movie was bad", "i hated the plot", "bad and boring"]
    n = n_users * pairs_per_user
    return Dataset.from_dict(
        {
            "prompt": ["review:"] * n,
            "chosen": [" " + good[i] for i in rng.integers(0, 3, n)],
            "rejected": [" " + bad[i] for i in rng.integers(0, 3, n)],
            "user_id": [f"user{u}" for u in np.repeat(np.arange(n_users), pairs_per_user)],
        }
    )
