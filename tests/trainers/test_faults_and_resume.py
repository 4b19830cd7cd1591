"""The trainers under faults (issue 11): a non-finite user, a resume, a tampered or hostile checkpoint, and the
files a user publishes."""

import copy
import os
import pickletools
import warnings
import zipfile

import pytest
import torch
from datasets import Dataset, load_from_disk
from transformers import TrainerCallback

from trl_userdp import PrivacyReport
from trl_userdp.mechanisms.randomized_response import OUTPUT_DIR
from trl_userdp.trainers import UserDPDPOConfig, UserDPDPOTrainer, UserDPRewardConfig, UserDPRewardTrainer

from ..tiny_models import text_preference_dataset, tiny_llama_lm, tiny_tokenizer
from .scripts import COMMON, reward_script, tiny_reward_model

BAD_USER = "user2"


class _ParamsPerStep(TrainerCallback):
    def __init__(self, model):
        self.model, self.after = model, []

    def on_step_end(self, args, state, control, **kwargs):
        self.after.append(torch.cat([p.detach().flatten().clone() for p in self.model.parameters()]))


def _dataset_with(user_rows, **columns):
    """8 users × 3 pairs (plus ``columns`` on every row); ``user_rows(row)`` edits the bad user's rows."""
    data = text_preference_dataset(n_users=8, pairs_per_user=3).to_dict()
    rows = [{**dict(zip(data, values)), **columns} for values in zip(*data.values())]
    return Dataset.from_list([user_rows(r) if r["user_id"] == BAD_USER else r for r in rows])


NOISELESS_EVERY_USER = dict(noise_multiplier=0.0, target_epsilon=None, users_per_batch=8.0, privacy_seed=11)


def _train_reward(dataset, output_dir, steps=3, **config):
    tokenizer = tiny_tokenizer()
    model = tiny_reward_model(tokenizer)
    args = UserDPRewardConfig(output_dir=output_dir, max_steps=steps, **{**COMMON, **NOISELESS_EVERY_USER, **config})
    trainer = UserDPRewardTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    record = _ParamsPerStep(trainer.model)
    trainer.add_callback(record)
    trainer.train()
    return record.after


def _train_dpo(dataset, output_dir, steps=3, poison=None):
    tokenizer = tiny_tokenizer()
    policy = tiny_llama_lm(len(tokenizer))
    reference = copy.deepcopy(policy)
    if poison is not None:  # a token whose reference embedding is NaN: that row's reference log-probs are NaN
        with torch.no_grad():
            reference.model.embed_tokens.weight[poison] = float("nan")
    args = UserDPDPOConfig(output_dir=output_dir, max_steps=steps, **{**COMMON, **NOISELESS_EVERY_USER})
    trainer = UserDPDPOTrainer(model=policy, ref_model=reference, args=args, train_dataset=dataset,
                               processing_class=tokenizer)
    record = _ParamsPerStep(trainer.model)
    trainer.add_callback(record)
    trainer.train()
    return record.after


def _assert_same_steps(got, expected):
    assert len(got) == len(expected) == 3
    for step, (a, b) in enumerate(zip(got, expected), start=1):
        assert torch.isfinite(a).all(), f"step {step}: NaN reached the parameters"
        assert torch.allclose(a, b, rtol=0, atol=1e-6), f"step {step}"


def test_reward_trainer_a_nan_margin_user_counts_as_a_zero_gradient(tmp_path):
    # reference: margin -1e4 makes the user's loss flat (σ(-1e4) = 0 in float32): an exactly zero gradient
    flat = _train_reward(_dataset_with(lambda r: {**r, "margin": -1e4}, margin=0.0), str(tmp_path / "a"))
    with pytest.warns(RuntimeWarning, match="not finite"):
        nan = _train_reward(_dataset_with(lambda r: {**r, "margin": float("nan")}, margin=0.0), str(tmp_path / "b"))
    _assert_same_steps(nan, flat)


def test_dpo_trainer_a_user_with_non_finite_reference_log_probs_counts_as_a_zero_gradient(tmp_path):
    unk = tiny_tokenizer().unk_token_id
    # the user's pairs compare a response with itself: their DPO gradient is zero up to float error
    same = lambda text: lambda r: {**r, "chosen": text, "rejected": text}  # noqa: E731
    zero = _train_dpo(_dataset_with(same(" the movie was great")), str(tmp_path / "a"), poison=unk)
    with pytest.warns(RuntimeWarning, match="not finite"):
        nan = _train_dpo(_dataset_with(same(" the movie was<unk>")), str(tmp_path / "b"), poison=unk)
    _assert_same_steps(nan, zero)


# -- randomized response is drawn once per output directory (item 2) -----------------------------------------
def _rr_trainer(output_dir, dataset=None):
    tokenizer = tiny_tokenizer()
    args = UserDPRewardConfig(output_dir=output_dir, max_steps=1, privacy_mechanism="randomized_response",
                              target_epsilon=1.0, max_samples_per_user=3, **COMMON)
    return UserDPRewardTrainer(model=tiny_reward_model(tokenizer), args=args, processing_class=tokenizer,
                               train_dataset=dataset or text_preference_dataset(n_users=8, pairs_per_user=3))


def test_randomized_response_is_reused_on_resume_and_refused_on_other_data(tmp_path):
    first = _rr_trainer(str(tmp_path / "run"))  # privacy_seed unset: the flips come from the OS
    saved = load_from_disk(str(tmp_path / "run" / OUTPUT_DIR))
    assert "rr_epsilon_per_label" in saved.column_names and len(saved) == 24
    assert not {"flip", "flipped", "true_label"} & set(saved.column_names)  # the output, never the flip mask
    resumed = _rr_trainer(str(tmp_path / "run"))
    assert resumed.train_dataset.to_dict() == first.train_dataset.to_dict()
    assert load_from_disk(str(tmp_path / "run" / OUTPUT_DIR)).to_dict() == saved.to_dict()
    other_run = _rr_trainer(str(tmp_path / "other"))  # a new directory draws anew (so the test can fail)
    assert other_run.train_dataset.to_dict() != first.train_dataset.to_dict()
    with pytest.raises(ValueError, match="labels privatized from other data"):
        _rr_trainer(str(tmp_path / "run"), text_preference_dataset(n_users=8, pairs_per_user=3, seed=1))


# -- a resume with privacy_seed continues the noise and the sampling, it never replays them (item 3) ---------
SEEDED = dict(noise_multiplier=1.0, target_epsilon=None, privacy_seed=7, accountant="rdp")


@pytest.fixture
def noise_draws(monkeypatch):
    from trl_userdp.optimizers import noise as noise_module

    real, draws = noise_module.gaussian_draw, []

    def recording(*args, **kwargs):
        noise = real(*args, **kwargs)
        draws.append(noise.detach().clone())
        return noise

    monkeypatch.setattr(noise_module, "gaussian_draw", recording)
    return draws


def _seeded_run(output_dir, resume=None, **extra):
    tokenizer = tiny_tokenizer()
    model = tiny_reward_model(tokenizer)
    args = UserDPRewardConfig(output_dir=output_dir, max_steps=6, **{**COMMON, **SEEDED, "save_strategy": "steps",
                                                                     "save_steps": 3, **extra})
    trainer = UserDPRewardTrainer(model=model, args=args, processing_class=tokenizer,
                                  train_dataset=text_preference_dataset(n_users=8, pairs_per_user=3))
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def test_a_resumed_seeded_run_draws_new_noise_and_continues_the_uninterrupted_run(tmp_path, noise_draws):
    straight = _seeded_run(str(tmp_path / "run"))
    per_step = len(noise_draws) // 6
    steps = [noise_draws[i * per_step:(i + 1) * per_step] for i in range(6)]
    noise_draws.clear()
    resumed = _seeded_run(str(tmp_path / "run"), resume=str(tmp_path / "run" / "checkpoint-3"))
    again = [noise_draws[i * per_step:(i + 1) * per_step] for i in range(3)]
    assert len(noise_draws) == 3 * per_step
    for k, draw in enumerate(again, start=4):
        for earlier in steps[:3]:  # never a replay of steps 1-3 ...
            assert not any(torch.equal(a, b) for a, b in zip(draw, earlier)), f"step {k} replays an earlier step"
        assert all(torch.equal(a, b) for a, b in zip(draw, steps[k - 1]))  # ... but exactly steps 4-6
    for a, b in zip(resumed.model.parameters(), straight.model.parameters()):  # same users sampled too
        assert torch.allclose(a, b, atol=1e-6)
    assert resumed.privacy_engine.accountant.steps_taken == 6


def test_two_resumes_from_one_checkpoint_share_no_noise_by_default(tmp_path, noise_draws):
    """Issue 39, finding 3: without a privacy_seed (the default) every process draws its secret from the OS, so two
    runs resumed from one checkpoint draw independent noise: their steps 4-6 share almost no coordinate, and
    their difference has the variance of two independent draws (not 0, as with a replayed stream)."""
    _seeded_run(str(tmp_path / "run"), privacy_seed=None)
    checkpoint = str(tmp_path / "run" / "checkpoint-3")
    draws = []
    for resume in range(2):
        noise_draws.clear()
        _seeded_run(str(tmp_path / f"resume{resume}"), resume=checkpoint, privacy_seed=None)
        draws.append(torch.cat([d.flatten() for d in noise_draws]))
    assert draws[0].numel() == draws[1].numel() > 1000
    assert float((draws[0] == draws[1]).float().mean()) < 1e-3  # a replay would repeat every coordinate
    spread = float((draws[0] - draws[1]).var() / (draws[0].var() + draws[1].var()))
    assert 0.9 < spread < 1.1, spread


def test_the_public_seed_decides_neither_the_users_drawn_nor_the_noise(tmp_path, noise_draws):
    """Two runs with the same public ``seed`` (and torch's global stream seeded alike) and no privacy_seed draw
    different users and different noise: both come from secrets drawn from the OS."""
    runs = []
    for run in range(2):
        noise_draws.clear()
        torch.manual_seed(0)
        trainer = _seeded_run(str(tmp_path / f"run{run}"), privacy_seed=None, save_strategy="no")
        users = trainer.privacy_engine.data_loader.user_sampler
        runs.append((torch.cat([d.flatten() for d in noise_draws]), [users.sample_users() for _ in range(20)]))
    (noise_a, users_a), (noise_b, users_b) = runs
    assert float((noise_a == noise_b).float().mean()) < 1e-3  # drawn from the public seed, every coordinate repeats
    assert any(not torch.equal(a, b) for a, b in zip(users_a, users_b))


def test_a_privacy_seed_equal_to_the_public_seed_is_refused():
    """The public ``seed`` is saved in training_args.bin: a privacy_seed equal to it would let anyone replay the noise."""
    with pytest.raises(ValueError, match="privacy_seed equals seed"):
        UserDPRewardConfig(output_dir="unused", seed=3, privacy_seed=3, **{k: v for k, v in COMMON.items() if k != "seed"})


def test_a_resume_with_ignore_data_skip_draws_the_next_users_not_the_epochs_first(tmp_path):
    """Issue 24, finding 5: with ``ignore_data_skip=True`` the Trainer restarts the epoch without skipping the steps
    already taken; the user draws must still continue the run (steps 4-6's users), not replay the epoch's first."""
    straight = _seeded_run(str(tmp_path / "run"), ignore_data_skip=True)
    sampler = straight.privacy_engine.data_loader.user_sampler
    assert sampler.steps > 1  # the resumed step 4 lies inside an epoch, so the Trainer does restart that epoch
    resumed = _seeded_run(str(tmp_path / "run"), resume=str(tmp_path / "run" / "checkpoint-3"), ignore_data_skip=True)
    for a, b in zip(resumed.model.parameters(), straight.model.parameters()):  # same users as the straight run
        assert torch.allclose(a, b, atol=1e-6)
    assert resumed.privacy_engine.accountant.steps_taken == 6


# -- hostile and tampered checkpoints (items 4, 5) ------------------------------------------------------------
class _Payload:
    """Unpickling this writes a file: the stand-in for code planted in a checkpoint."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _checkpoint(tmp_path, **config):
    reward_script(UserDPRewardTrainer, UserDPRewardConfig, str(tmp_path / "run"), steps=3, save_strategy="steps",
                  save_steps=3, **{"accountant": "rdp", **config})
    return str(tmp_path / "run" / "checkpoint-3")


def _resume(tmp_path, checkpoint, **config):
    tokenizer = tiny_tokenizer()
    args = UserDPRewardConfig(output_dir=str(tmp_path / "run"), max_steps=6,
                              **{**COMMON, "accountant": "rdp", **config})
    trainer = UserDPRewardTrainer(model=tiny_reward_model(tokenizer), args=args, processing_class=tokenizer,
                                  train_dataset=text_preference_dataset(n_users=8, pairs_per_user=3))
    trainer.train(resume_from_checkpoint=checkpoint)
    return trainer


def test_a_planted_payload_in_the_privacy_state_never_runs(tmp_path):
    checkpoint = _checkpoint(tmp_path)
    marker = str(tmp_path / "payload_ran")
    torch.save({"accountant": _Payload(marker)}, os.path.join(checkpoint, "privacy_state.pt"))
    with pytest.raises(ValueError, match="more than plain data"):
        _resume(tmp_path, checkpoint)
    assert not os.path.exists(marker)


def test_opacus_style_engine_checkpoints_load_as_data_only(tmp_path):
    import trl_userdp

    from ..helpers import private_linear

    engine, model, optimizer, _ = private_linear(noise_multiplier=1.0, max_samples_per_user=10, users_per_batch=6)
    path = str(tmp_path / "ckpt.pt")
    marker = str(tmp_path / "payload_ran")
    torch.save({"module_state_dict": model.state_dict(), "privacy_accountant_state_dict": _Payload(marker)}, path)
    with pytest.raises(ValueError, match="more than plain data"):
        trl_userdp.PrivacyEngine().load_checkpoint(path=path, module=model)
    assert not os.path.exists(marker)
    with pytest.raises(ValueError, match="weights_only=True only"):
        trl_userdp.PrivacyEngine().load_checkpoint(path=path, module=model, torch_load_kwargs={"weights_only": False})


@pytest.mark.parametrize("edit,match", [
    (lambda s: s["accountant"].update(history=[]), "holds 0 steps, but the checkpoint is at step 3"),
    (lambda s: s["accountant"].update(history=[(0.5, 0.5, 3)]), "σ=0.5"),
    (lambda s: s["accountant"].update(relation="replace"), "not this run's"),
])
def test_a_tampered_accountant_is_refused_with_the_numbers(tmp_path, edit, match):
    checkpoint = _checkpoint(tmp_path, noise_multiplier=2.0, target_epsilon=None)
    path = os.path.join(checkpoint, "privacy_state.pt")
    state = torch.load(path, weights_only=True)
    edit(state)
    torch.save(state, path)
    with pytest.raises(ValueError, match=match):
        _resume(tmp_path, checkpoint, noise_multiplier=2.0, target_epsilon=None)


def test_an_untampered_checkpoint_resumes(tmp_path):
    checkpoint = _checkpoint(tmp_path, noise_multiplier=2.0, target_epsilon=None)
    assert _resume(tmp_path, checkpoint, noise_multiplier=2.0, target_epsilon=None).privacy_engine.accountant.steps_taken == 6


# -- what save_model writes holds no secret (item 6) -----------------------------------------------------------
def test_the_saved_model_folder_holds_no_secret_or_per_user_count(tmp_path):
    from .test_mechanisms import MECHANISMS

    aup = MECHANISMS["aup"]
    seed = 918273645
    trainer = reward_script(UserDPRewardTrainer, UserDPRewardConfig, str(tmp_path), steps=2, privacy_mechanism="aup",
                            privacy_seed=seed, save_strategy="steps", save_steps=2,
                            dataset=text_preference_dataset(n_users=40, pairs_per_user=1),
                            **{k: v for k, v in aup.items() if k not in ("dataset", "privacy_seed")})
    threshold = trainer.privacy_engine.optimizer.svt.noisy_threshold
    assert threshold is not None
    files = [f for f in os.listdir(tmp_path) if os.path.isfile(tmp_path / f)]
    assert "privacy_state.pt" not in files and "privacy_report.json" in files
    for name in files:  # the text files (report, configs, model card) as written; the pickle is read below
        if name.endswith((".json", ".md", ".txt")):
            text = (tmp_path / name).read_text()
            assert repr(threshold) not in text and str(seed) not in text, name
    report = PrivacyReport.load(str(tmp_path))
    assert "rows_dropped" not in report.to_dict() and "noisy_threshold" not in report.to_json()
    # training_args.bin is a pickle of the arguments: read its opcodes without running it
    with zipfile.ZipFile(tmp_path / "training_args.bin") as archive:
        pickled = archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl")))
    arguments = [arg for _, arg, _ in pickletools.genops(pickled)]
    assert "privacy_seed" in arguments and seed not in arguments
    assert trainer.args.privacy_seed == seed  # the run keeps its seed
    assert str(seed) not in trainer.args.to_json_string() and str(seed) not in str(trainer.args)
    assert str(seed) not in repr(trainer.args)
    assert copy.deepcopy(trainer.args).privacy_seed == seed and copy.copy(trainer.args).privacy_seed == seed
    # the checkpoint keeps the threshold it needs to resume (named a checkpoint-only secret in the README)
    state = torch.load(tmp_path / "checkpoint-2" / "privacy_state.pt", weights_only=True)
    assert state["optimizer"]["noisy_threshold"] == threshold


# -- smaller ones (item 8) ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("trainer_cls,config_cls", [(UserDPRewardTrainer, UserDPRewardConfig),
                                                    (UserDPDPOTrainer, UserDPDPOConfig)])
@pytest.mark.parametrize("dataset,match", [
    (Dataset.from_dict({"prompt": [], "chosen": [], "rejected": [], "user_id": []}), "train_dataset is empty"),
    (text_preference_dataset().to_iterable_dataset(), "map-style train_dataset"),
])
def test_datasets_user_sampling_cannot_use_fail_in_one_line(tmp_path, trainer_cls, config_cls, dataset, match):
    tokenizer = tiny_tokenizer()
    args = config_cls(output_dir=str(tmp_path), max_steps=1, **COMMON)
    with pytest.raises(ValueError, match=match):
        trainer_cls(model=tiny_reward_model(tokenizer) if trainer_cls is UserDPRewardTrainer else tiny_llama_lm(len(tokenizer)),
                    args=args, train_dataset=dataset, processing_class=tokenizer)


def test_users_per_batch_zero_is_refused_not_replaced(tmp_path):
    with pytest.raises(ValueError, match="users_per_batch must be a finite number > 0"):
        UserDPRewardConfig(output_dir=str(tmp_path), users_per_batch=0.0, **COMMON)


def test_a_numpy_budget_is_accepted(tmp_path):
    import numpy as np

    args = UserDPRewardConfig(output_dir=str(tmp_path), target_epsilon=np.float32(3.0), **COMMON)
    assert args.target_epsilon == 3.0


def test_a_large_delta_warns(tmp_path):
    with pytest.warns(UserWarning, match="not below 1/n_users"):
        reward_script(UserDPRewardTrainer, UserDPRewardConfig, str(tmp_path), steps=1, target_delta=0.2, accountant="rdp")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        from trl_userdp.validators import warn_if_delta_is_large

        warn_if_delta_is_large(1e-5, 8)


def test_an_aup_checkpoint_with_edited_above_threshold_state_is_refused(tmp_path):
    from .test_mechanisms import MECHANISMS

    aup = {k: v for k, v in MECHANISMS["aup"].items() if k != "dataset"}
    data = text_preference_dataset(n_users=40, pairs_per_user=1)
    reward_script(UserDPRewardTrainer, UserDPRewardConfig, str(tmp_path / "run"), steps=2, privacy_mechanism="aup",
                  save_strategy="steps", save_steps=2, dataset=data, **aup)
    checkpoint = str(tmp_path / "run" / "checkpoint-2")
    path = os.path.join(checkpoint, "privacy_state.pt")
    state = torch.load(path, weights_only=True)
    assert state["optimizer"]["queries"] == 2
    state["optimizer"]["queries"] = 0  # as if AboveThreshold had not been asked: a fresh threshold on resume
    torch.save(state, path)
    tokenizer = tiny_tokenizer()
    args = UserDPRewardConfig(output_dir=str(tmp_path / "run"), max_steps=2, privacy_mechanism="aup",
                              **{**COMMON, **aup})  # the same plan, so the same σ
    trainer = UserDPRewardTrainer(model=tiny_reward_model(tokenizer), args=args, processing_class=tokenizer,
                                  train_dataset=data)
    with pytest.raises(ValueError, match="0 AboveThreshold queries for 2 accounted steps"):
        trainer.train(resume_from_checkpoint=checkpoint)


def test_a_truncated_privacy_state_is_a_one_line_refusal(tmp_path):
    checkpoint = _checkpoint(tmp_path)
    path = os.path.join(checkpoint, "privacy_state.pt")
    with open(path, "r+b") as f:
        f.truncate(40)
    with pytest.raises(ValueError, match="is not a readable checkpoint"):
        _resume(tmp_path, checkpoint)


def test_aup_refuses_to_push_its_checkpoints(tmp_path):
    with pytest.raises(ValueError, match="secret AboveThreshold threshold"):
        UserDPRewardConfig(output_dir=str(tmp_path), privacy_mechanism="aup", concentration_radius=1.0,
                           push_to_hub=True, hub_strategy="checkpoint", **COMMON)


def test_kto_a_nan_row_does_not_rescale_other_users_gradients(tmp_path, monkeypatch):
    """TRL's KTO averages with nanmean: a NaN row would leave the divisor and scale every other row's gradient by
    B/(B − 1). Under DP the other users' per-user gradients are the same with or without the fault."""
    from trl_userdp.optimizers.user_optimizer import UserDPOptimizer

    from .test_kto import unpaired_dataset

    real, seen = UserDPOptimizer.unit_gradients, []

    def recording(self):
        grads = real(self)
        seen.append({u: torch.cat([g[i].flatten() for g in grads]) for i, u in enumerate(self.hooks.unit_ids)})
        return grads

    monkeypatch.setattr(UserDPOptimizer, "unit_gradients", recording)
    tokenizer = tiny_tokenizer()
    data = unpaired_dataset().to_dict()
    bad = [i for i, u in enumerate(data["user_id"]) if u == BAD_USER]
    for i in bad:
        data["completion"][i] = " the movie was<unk>"
    first_step = []
    for poison in (False, True):
        from trl_userdp.trainers import UserDPKTOConfig, UserDPKTOTrainer

        policy = tiny_llama_lm(len(tokenizer))
        reference = copy.deepcopy(policy)
        if poison:  # the bad user's reference log-probs become NaN
            with torch.no_grad():
                reference.model.embed_tokens.weight[tokenizer.unk_token_id] = float("nan")
        args = UserDPKTOConfig(output_dir=str(tmp_path / str(poison)), max_steps=1, loss_type="apo_zero_unpaired",
                               **{**COMMON, **NOISELESS_EVERY_USER})
        trainer = UserDPKTOTrainer(model=policy, ref_model=reference, args=args, train_dataset=Dataset.from_dict(data),
                                   processing_class=tokenizer)
        seen.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            trainer.train()
        first_step.append(seen[0])
    clean, faulty = first_step
    bad_code = trainer.privacy_engine.data_loader.user_index.keys.tolist().index(BAD_USER)
    assert torch.count_nonzero(faulty[bad_code]) == 0 < torch.count_nonzero(clean[bad_code])  # zeroed, as NaN
    others = [u for u in clean if u != bad_code]
    assert len(others) == 7
    for u in others:
        assert torch.allclose(faulty[u], clean[u], rtol=1e-5, atol=1e-8), u
