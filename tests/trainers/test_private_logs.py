"""No statistic of private data in what a private run logs (issue 39, finding 5): each trainer runs twice on datasets
that differ in one user's labels (GRPO: that user's prompts), and everything logged at INFO or above — the package's,
TRL's, transformers' and accelerate's loggers — is the same text, timings aside."""

import copy
import logging
import re
import shutil

import pytest
from datasets import Dataset

from trl_userdp.trainers import (UserDPDPOConfig, UserDPDPOTrainer, UserDPGRPOConfig, UserDPGRPOTrainer,
                                 UserDPKTOConfig, UserDPKTOTrainer, UserDPRewardConfig, UserDPRewardTrainer)

from ..tiny_models import text_preference_dataset, tiny_llama_lm, tiny_tokenizer
from .scripts import COMMON, tiny_reward_model

PRIVATE = dict(max_steps=2, noise_multiplier=1.0, target_epsilon=None, users_per_batch=4.0, max_samples_per_user=3)
#: loggers that do not propagate to the root (transformers' library logger has its own handler)
LIBRARY_LOGGERS = ("transformers", "trl", "accelerate", "trl_userdp")
#: what changes from run to run whatever the data: timings and rates, and hexadecimal addresses
VOLATILE = re.compile(r"(runtime|per_second|_flos)\D*[\d.e+-]+|0x[0-9a-f]+")


def _preferences(flip_user0: bool) -> Dataset:
    data = text_preference_dataset(n_users=8, pairs_per_user=3).to_dict()
    if flip_user0:
        for i, user in enumerate(data["user_id"]):
            if user == "user0":
                data["chosen"][i], data["rejected"][i] = data["rejected"][i], data["chosen"][i]
    return Dataset.from_dict(data)


def _unpaired(flip_user0: bool) -> Dataset:
    """Balanced labels but user0's, which are all desirable (or, flipped, all undesirable)."""
    users = [f"user{u}" for u in range(8) for _ in range(3)]
    labels = [u == "user0" and not flip_user0 or (u != "user0" and i % 2 == 0) for i, u in enumerate(users)]
    return Dataset.from_dict({"prompt": ["review:"] * len(users), "label": labels, "user_id": users,
                              "completion": [" great and fun" if y else " bad and boring" for y in labels]})


def _prompts(flip_user0: bool) -> Dataset:
    users = [f"user{u}" for u in range(8) for _ in range(2)]
    prompts = [("i hated it, the" if u == "user0" and flip_user0 else "the movie was") for u in users]
    return Dataset.from_dict({"prompt": prompts, "user_id": users})


def _train(kind: str, out: str, flip_user0: bool) -> None:
    tokenizer = tiny_tokenizer()
    if kind == "reward":
        trainer = UserDPRewardTrainer(model=tiny_reward_model(tokenizer), processing_class=tokenizer,
                                      args=UserDPRewardConfig(output_dir=out, **{**COMMON, **PRIVATE}),
                                      train_dataset=_preferences(flip_user0))
    elif kind == "dpo":
        policy = tiny_llama_lm(len(tokenizer))
        trainer = UserDPDPOTrainer(model=policy, ref_model=copy.deepcopy(policy), processing_class=tokenizer,
                                   args=UserDPDPOConfig(output_dir=out, **{**COMMON, **PRIVATE}),
                                   train_dataset=_preferences(flip_user0))
    elif kind == "kto":
        policy = tiny_llama_lm(len(tokenizer))
        trainer = UserDPKTOTrainer(model=policy, ref_model=copy.deepcopy(policy), processing_class=tokenizer,
                                   args=UserDPKTOConfig(output_dir=out, loss_type="apo_zero_unpaired",
                                                        **{**COMMON, **PRIVATE}),
                                   train_dataset=_unpaired(flip_user0))
    else:
        trainer = UserDPGRPOTrainer(model=tiny_llama_lm(len(tokenizer)), reward_funcs=lambda completion_ids, **kw: [
            float(sum(ids) % 7) for ids in completion_ids], processing_class=tokenizer, reward_model_is_public=True,
            args=UserDPGRPOConfig(output_dir=out, num_generations=2, max_completion_length=4,
                                  **{**COMMON, **PRIVATE, "per_device_train_batch_size": 8}),
            train_dataset=_prompts(flip_user0))
    trainer.train()
    trainer.save_model()


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(f"{record.name} {record.levelname} {VOLATILE.sub('<v>', record.getMessage())}")


def _logged(kind: str, out: str, flip_user0: bool):
    handler = _Lines()
    loggers = [logging.getLogger()] + [logging.getLogger(name) for name in LIBRARY_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    try:
        _train(kind, out, flip_user0)
    finally:
        for logger, level in zip(loggers, levels):
            logger.removeHandler(handler)
            logger.setLevel(level)
        shutil.rmtree(out, ignore_errors=True)
    return list(dict.fromkeys(handler.lines))  # a record that reaches two of the handler's loggers, once


@pytest.mark.parametrize("kind", ["reward", "dpo", "kto", "grpo"])
def test_what_a_private_run_logs_does_not_depend_on_one_users_labels(tmp_path, kind):
    out = str(tmp_path / "run")
    first, second = _logged(kind, out, flip_user0=False), _logged(kind, out, flip_user0=True)
    assert any("User-level DP" in line for line in first)  # the capture sees the package's own INFO lines
    assert first == second
