"""The support matrix (issue 40): each common Hugging Face architecture, built from a tiny configuration, as a reward
model (sequence classification) and, where it has one, a causal LM; full fine-tuning and LoRA; per-user hooks and
ghost clipping; right and left padding; fp32 and bf16; a clip that binds (C = 0.01) and one that does not. One private
step at σ = 0 through the public engine must equal an independent per-user autograd computation (each user's mean
loss on its own rows, clipped to C, summed and divided by the expected users), or the engine must refuse with the
reason :data:`REFUSED` names. A wrong update or any other error fails.

The default run takes one cell per architecture, kind and fine-tuning (full on hooks, LoRA on ghost); ``-m slow``
the whole matrix. ``python -m
tests.grad_sample.test_architectures`` rewrites the table in docs/architectures.md from :data:`REFUSED`, and a test
checks that the page matches."""

import copy
import itertools
import logging
import pathlib
import re
import warnings

import pytest
import torch
import transformers as tf
from peft import LoraConfig, get_peft_model
from torch.utils.data import DataLoader

import trl_userdp

V = 96
_COMMON = dict(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
_GQA = dict(_COMMON, num_key_value_heads=2)
BOTH, REWARD, CAUSAL = ("reward", "causal LM"), ("reward",), ("causal LM",)
#: name -> (config class, tiny configuration, kinds)
ARCHITECTURES = {
    "Llama (GQA)": (tf.LlamaConfig, _GQA, BOTH),
    "Qwen2": (tf.Qwen2Config, _GQA, BOTH),
    "Qwen3": (tf.Qwen3Config, dict(_GQA, head_dim=4), BOTH),
    "Mistral": (tf.MistralConfig, _GQA, BOTH),
    "Phi-3": (tf.Phi3Config, _GQA, BOTH),
    "GPT-2": (tf.GPT2Config, dict(vocab_size=V, n_embd=16, n_layer=2, n_head=4, n_positions=64, pad_token_id=0,
                                  bos_token_id=1, eos_token_id=2), BOTH),
    "GPT-NeoX (Pythia)": (tf.GPTNeoXConfig, _COMMON, BOTH),
    "SmolLM (tied embeddings)": (tf.LlamaConfig, dict(_GQA, tie_word_embeddings=True), BOTH),
    "Gemma": (tf.GemmaConfig, dict(_GQA, head_dim=4), BOTH),
    "Gemma 2": (tf.Gemma2Config, dict(_GQA, head_dim=4), BOTH),
    "Gemma 3 (text)": (tf.Gemma3TextConfig, dict(_GQA, head_dim=4), BOTH),
    "OPT": (tf.OPTConfig, dict(vocab_size=V, hidden_size=16, ffn_dim=32, num_hidden_layers=2, num_attention_heads=4,
                               max_position_embeddings=64, word_embed_proj_dim=16, pad_token_id=1, bos_token_id=2,
                               eos_token_id=2), BOTH),
    "Falcon": (tf.FalconConfig, dict(vocab_size=V, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                                     pad_token_id=0, bos_token_id=1, eos_token_id=2), BOTH),
    "OLMo 2": (tf.Olmo2Config, _GQA, BOTH),
    "Phi (phi-2)": (tf.PhiConfig, _GQA, BOTH),
    "StableLM": (tf.StableLmConfig, _GQA, BOTH),
    "StarCoder2": (tf.Starcoder2Config, _GQA, BOTH),
    "GPT-J": (tf.GPTJConfig, dict(vocab_size=V, n_embd=16, n_layer=2, n_head=4, n_positions=64, rotary_dim=4,
                                  pad_token_id=0, bos_token_id=1, eos_token_id=2), BOTH),
    "BLOOM": (tf.BloomConfig, dict(vocab_size=V, hidden_size=16, n_layer=2, n_head=4, pad_token_id=0, bos_token_id=1,
                                   eos_token_id=2), BOTH),
    "Granite": (tf.GraniteConfig, _GQA, CAUSAL),
    "Cohere (Command R)": (tf.CohereConfig, _GQA, CAUSAL),
    "Mixtral (mixture of experts)": (tf.MixtralConfig, dict(_GQA, num_local_experts=4, num_experts_per_tok=2), BOTH),
    "Qwen2-MoE": (tf.Qwen2MoeConfig, dict(_GQA, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                                          shared_expert_intermediate_size=16), BOTH),
    "BERT": (tf.BertConfig, _COMMON, REWARD),
    "DistilBERT": (tf.DistilBertConfig, dict(vocab_size=V, dim=16, hidden_dim=32, n_layers=2, n_heads=4,
                                             max_position_embeddings=64, pad_token_id=0), REWARD),
    "RoBERTa": (tf.RobertaConfig, dict(_COMMON, pad_token_id=1), REWARD),
    "DeBERTa-v3": (tf.DebertaV2Config, dict(_COMMON, relative_attention=True, position_buckets=8, share_att_key=True,
                                            pos_att_type=["p2c", "c2p"], norm_rel_ebd="layer_norm",
                                            position_biased_input=False, max_relative_positions=-1), REWARD),
    "DeBERTa-v2 (separate position projections, convolution)": (
        tf.DebertaV2Config, dict(_COMMON, relative_attention=True, position_buckets=8, share_att_key=False,
                                 pos_att_type=["p2c", "c2p"], norm_rel_ebd="layer_norm", position_biased_input=False,
                                 max_relative_positions=-1, conv_kernel_size=3)
        , REWARD),
    "ModernBERT": (tf.ModernBertConfig, dict(_COMMON, cls_token_id=1, sep_token_id=2, global_attn_every_n_layers=1,
                                             local_attention=8), REWARD),
}
_LEFT = "left-padded"
_EXPERTS = "mixture-of-experts block"
#: (architecture, fine-tuning or None for both, padding or None for both) -> what the refusal says, and why in words
REFUSED = {
    ("GPT-2", None, "left"): (_LEFT, "positions couple the rows"),
    ("BERT", None, "left"): (_LEFT, "positions couple the rows"),
    ("DistilBERT", None, "left"): (_LEFT, "positions couple the rows"),
    ("Mixtral (mixture of experts)", None, None): (_EXPERTS, "experts regroup the tokens (exact with them frozen)"),
    ("Qwen2-MoE", None, None): (_EXPERTS, "experts regroup the tokens (exact with them frozen)"),
}
#: LoRA targets where PEFT's "all-linear" does not apply to a sequence classifier
_LORA_TARGETS = {"DistilBERT": ["q_lin", "k_lin", "v_lin", "out_lin", "lin1", "lin2"]}
USERS = [0, 1, 1, 2, 2, 2, 3, 3]  # four users with one to three rows (m = 3), every one drawn (ñ = n = 4)
LENGTHS = [5, 3, 7, 4, 6, 2, 7, 5]
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


def refusal(arch: str, tuning: str, padding: str):
    for (a, t, p), reason in REFUSED.items():
        if a == arch and t in (None, tuning) and p in (None, padding):
            return reason
    return None


def build(arch: str, kind: str, tuning: str, dtype: torch.dtype, experts_frozen: bool = False) -> torch.nn.Module:
    """The tiny model (``experts_frozen``: the fix the mixture-of-experts refusal names, the ``mlp`` blocks frozen
    or, with LoRA, only the attention projections targeted)."""
    cls, kwargs, _ = ARCHITECTURES[arch]
    config = cls(**kwargs)
    for field, value in list(vars(config).items()):
        if ("dropout" in field or "pdrop" in field) and isinstance(value, float):
            setattr(config, field, 0.0)
    config.num_labels = 1
    torch.manual_seed(0)
    auto = tf.AutoModelForSequenceClassification if kind == "reward" else tf.AutoModelForCausalLM
    model = auto.from_config(config)
    if tuning == "lora":
        targets = ["q_proj", "k_proj", "v_proj", "o_proj"] if experts_frozen else _LORA_TARGETS.get(arch, "all-linear")
        model = get_peft_model(model, LoraConfig(
            r=2, lora_alpha=4, target_modules=targets, lora_dropout=0.0,
            init_lora_weights=False, task_type="SEQ_CLS" if kind == "reward" else "CAUSAL_LM"))
    elif experts_frozen:
        for name, p in model.named_parameters():
            p.requires_grad_(".mlp." not in name)
    return model.to(dtype).train()


def batch(padding: str, pad: int):
    g = torch.Generator().manual_seed(1)
    width = max(LENGTHS)
    ids = torch.full((len(LENGTHS), width), pad)
    mask = torch.zeros(len(LENGTHS), width, dtype=torch.long)
    for i, length in enumerate(LENGTHS):
        cols = slice(0, length) if padding == "right" else slice(width - length, width)
        ids[i, cols] = torch.randint(3, V, (length,), generator=g)
        mask[i, cols] = 1
    return ids, mask, torch.randn(len(LENGTHS), generator=g)


def row_losses(model, kind, ids, mask, target, positions=False):
    """A reward model's squared error to a target score; a causal LM's mean next-token loss over its real tokens
    (``positions``: with position ids that count each row's own tokens)."""
    extra = dict(position_ids=(mask.cumsum(-1) - 1).clamp(min=0)) if positions else {}
    logits = model(input_ids=ids, attention_mask=mask, **extra).logits.float()
    if kind == "reward":
        return (logits.squeeze(-1) - target) ** 2
    real = mask[:, 1:] * mask[:, :-1]
    ce = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")
    return (ce * real).sum(1) / real.sum(1)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def private_step_error(arch, kind, tuning, mode, padding, dtype, clip, positions=False, experts_frozen=False):
    """Relative error of a private step's gradient against the per-user autograd reference: the larger of two steps'
    on the same weights (the learning rate is 0), the first with the self-check (whose per-user half must run), the
    second on the path every later step takes (ghost clipping then spares autograd the weights' gradients)."""
    model = build(arch, kind, tuning, dtype, experts_frozen)
    all_ids, all_mask, all_target = batch(padding, model.config.pad_token_id)
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    rows = [dict(row=i) for i in range(len(USERS))]
    engine = trl_userdp.PrivacyEngine()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, optimizer, loader = engine.make_private_user_level(
            module=model, optimizer=optimizer,
            data_loader=DataLoader(rows, collate_fn=lambda b: torch.tensor([r["row"] for r in b])),
            noise_multiplier=0.0, max_grad_norm=clip, max_samples_per_user=3, users_per_batch=4, user_ids=USERS,
            grad_sample_mode=mode, sampling_seed=0)
    assert loader.sample_rate == 1.0
    errors = []
    for _ in range(2):
        drawn = next(iter(loader))
        ids, mask, target = all_ids[drawn], all_mask[drawn], all_target[drawn]
        row_users = [USERS[i] for i in drawn.tolist()]
        optimizer.zero_grad()
        row_losses(model, kind, ids, mask, target, positions).mean().backward()
        skipped = _Records()
        logging.getLogger("trl_userdp.grad_sample.user_check").addHandler(skipped)
        try:
            optimizer.step()
        finally:
            logging.getLogger("trl_userdp.grad_sample.user_check").removeHandler(skipped)
        assert not skipped.messages, skipped.messages  # the self-check's per-user half ran (and passed)
        assert not optimizer.self_check  # it ran on the first step, and passed
        expected = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in reference.named_parameters()
                    if p.requires_grad}
        for user in sorted(set(row_users)):
            own = [i for i, u in enumerate(row_users) if u == user]
            reference.zero_grad()
            row_losses(reference, kind, ids[own], mask[own], target[own], positions).mean().backward()
            grads = {n: p.grad.float() for n, p in reference.named_parameters() if p.requires_grad}
            factor = min(1.0, clip / float(torch.sqrt(sum((g ** 2).sum() for g in grads.values()))))
            for n in expected:
                expected[n] += factor * grads[n] / 4
        applied = {n: p.grad.float() for n, p in model.named_parameters() if p.requires_grad}
        err = sum(float((applied[n] - expected[n]).pow(2).sum()) for n in expected)
        errors.append((err / sum(float(e.pow(2).sum()) for e in expected.values())) ** 0.5)
    return max(errors)


def cells():
    for arch, (_, _, kinds) in ARCHITECTURES.items():
        for kind, tuning, mode, padding, dtype, clip in itertools.product(
                kinds, ["full", "lora"], ["hooks", "ghost"],
                ["right", "left"], [torch.float32, torch.bfloat16], [1e6, 1e-2]):
            # the default run: every architecture, kind and fine-tuning, full on hooks with right padding and LoRA on
            # ghost with left padding, in fp32 with a binding clip
            fast = dtype == torch.float32 and clip == 1e-2 and (mode, padding) == (
                ("hooks", "right") if tuning == "full" else ("ghost", "left"))
            marks = () if fast else (pytest.mark.slow,)
            yield pytest.param(arch, kind, tuning, mode, padding, dtype, clip, marks=marks,
                               id=f"{arch}-{kind}-{tuning}-{mode}-{padding}-{str(dtype)[6:]}-C{clip:g}")


@pytest.mark.parametrize("arch,kind,tuning,mode,padding,dtype,clip", list(cells()))
def test_a_private_step_is_exact_or_refused_by_name(arch, kind, tuning, mode, padding, dtype, clip):
    reason = refusal(arch, tuning, padding)
    if reason is not None:
        with pytest.raises(ValueError, match=re.escape(reason[0])):
            private_step_error(arch, kind.split()[0], tuning, mode, padding, dtype, clip)
        return
    assert private_step_error(arch, kind.split()[0], tuning, mode, padding, dtype, clip) < TOLERANCE[dtype]


@pytest.mark.parametrize("arch", ["GPT-2", "BERT", "DistilBERT"])
def test_left_padding_with_positions_counted_per_row_is_exact(arch):
    """The fix the refusal names: position_ids that count each row's own tokens."""
    kwargs = dict(kind="reward", tuning="full", padding="left", dtype=torch.float32, clip=1e-2, positions=True)
    for mode in ("hooks", "ghost"):
        assert private_step_error(arch, mode=mode, **kwargs) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("arch", ["Mixtral (mixture of experts)", "Qwen2-MoE"])
@pytest.mark.parametrize("tuning", ["full", "lora"])
def test_a_mixture_of_experts_with_its_experts_frozen_is_exact(arch, tuning):
    """The fix the refusal names: the mixture-of-experts blocks frozen (their routing is per token, so the rest of
    the model keeps one row per user)."""
    kwargs = dict(kind="causal LM", padding="left", dtype=torch.float32, clip=1e-2, experts_frozen=True)
    for mode in ("hooks", "ghost"):
        assert private_step_error(arch, tuning=tuning, mode=mode, **kwargs) < TOLERANCE[torch.float32]


DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "architectures.md"
_BEGIN, _END = "<!-- matrix: begin -->", "<!-- matrix: end -->"


def support_table() -> str:
    """The docs table: one line per architecture, one column per fine-tuning and padding, from :data:`REFUSED`."""
    lines = ["| architecture | kinds | full, right padding | full, left padding | LoRA, right padding | "
             "LoRA, left padding |", "|---|---|---|---|---|---|"]
    for arch, (_, _, kinds) in ARCHITECTURES.items():
        row = [arch, ", ".join(kinds)]
        for tuning, padding in itertools.product(["full", "lora"], ["right", "left"]):
            reason = refusal(arch, tuning, padding)
            row.append("exact" if reason is None else f"refused: {reason[1]}")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def test_the_docs_table_is_the_matrix():
    text = DOC.read_text()
    assert text[text.index(_BEGIN) + len(_BEGIN):text.index(_END)].strip() == support_table()


if __name__ == "__main__":
    text = DOC.read_text()
    DOC.write_text(text[:text.index(_BEGIN) + len(_BEGIN)] + "\n" + support_table() + "\n" + text[text.index(_END):])
