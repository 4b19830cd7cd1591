"""GRPO on the users' own prompts with user-level DP (issue 30): one step equals an independent per-user autograd
computation of the GRPO loss, an adversarial user moves the update by at most C/ñ, the noise is the accountant's, ε is
dp-accounting's and composes with a private reward model's, and what couples users is refused before training."""

import copy
import math
from typing import Dict, List

import dp_accounting as dpa
import pytest
import torch
from datasets import Dataset
from dp_accounting import pld
from scipy import stats

from trl_userdp import PrivacyReport
from trl_userdp.trainers import UserDPGRPOConfig, UserDPGRPOTrainer, UserDPRewardConfig, UserDPRewardTrainer
from trl_userdp.grad_sample.checks import active_dropout
from trl_userdp.trainers.mixin import USER_KEY

from ..tiny_models import tiny_gpt2_lm, tiny_llama_lm, tiny_tokenizer
from .scripts import reward_script

G = 4  # completions per prompt
BASE = dict(num_generations=G, max_completion_length=5, max_steps=1, use_cpu=True, bf16=False, report_to=[],
            save_strategy="no", disable_tqdm=True, logging_steps=1, seed=0, privacy_seed=1, optim="sgd",
            learning_rate=1.0, per_device_train_batch_size=8)


def _prompts(users: Dict[str, List[str]]) -> Dataset:
    rows = [(u, p) for u, prompts in users.items() for p in prompts]
    return Dataset.from_dict({"prompt": [p for _, p in rows], "user_id": [u for u, _ in rows]})


def id_reward(completion_ids, **kwargs):
    """A public rule of the completion's tokens (spreads rewards within a group)."""
    return [float(sum(ids) % 7) for ids in completion_ids]


def _with_attention_dropout(model):
    """A Llama whose attention layers drop out at 0.1 (a float rate TRL's ``disable_dropout_in_model`` misses)."""
    model.config.attention_dropout = 0.1
    for module in model.modules():
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = 0.1
    return model


MODELS = {"llama": tiny_llama_lm, "gpt2": tiny_gpt2_lm,
          "gpt2_dropout": lambda vocab: tiny_gpt2_lm(vocab, dropout=0.1),  # GPT-2's default dropout
          "llama_attention_dropout": lambda vocab: _with_attention_dropout(tiny_llama_lm(vocab))}


def _trainer(tmp_path, dataset, reward=id_reward, model="llama", **config):
    """The trainer on a tiny Llama or GPT-2 (saved to a folder when β > 0: TRL loads its reference copy from there)."""
    tokenizer = tiny_tokenizer()
    args = UserDPGRPOConfig(output_dir=str(tmp_path), **{**BASE, **config})
    policy = MODELS[model](len(tokenizer))
    if args.beta != 0.0:
        policy.save_pretrained(tmp_path / "initial")
        policy = str(tmp_path / "initial")
    return UserDPGRPOTrainer(model=policy, reward_funcs=reward, args=args,
                             train_dataset=dataset, processing_class=tokenizer, reward_model_is_public=True)


def _record_batches(trainer) -> List[dict]:
    """The private batches the loss sees (after generation and scoring), in order."""
    batches, prepare = [], trainer._prepare_inputs

    def recording(generation_batch):
        inputs = prepare(generation_batch)
        if trainer.model.training:
            batches.append({k: (v.clone() if torch.is_tensor(v) else v) for k, v in inputs.items()})
        return inputs

    trainer._prepare_inputs = recording
    return batches


def _params(model) -> Dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _row_tokens(batch, i):
    """Row ``i``'s prompt and completion tokens without padding."""
    prompt = batch["prompt_ids"][i][batch["prompt_mask"][i].bool()]
    completion = batch["completion_ids"][i][batch["completion_mask"][i].bool()]
    return prompt, completion


def _completion_logps(model, prompt, completion):
    """log π(completion | prompt) per token, from one unpadded row through the model's own forward."""
    ids = torch.cat([prompt, completion]).unsqueeze(0)
    logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1]
    return logits.float().log_softmax(-1).gather(-1, completion.unsqueeze(-1)).squeeze(-1)


def _independent_update(batches, beta, users_per_batch, lr, model="llama"):
    """−lr · Σ_u ∇ℓ_u / ñ, ℓ_u the mean over user u's completions of GRPO's per-completion loss (on-policy: the token
    loss is −A·π/π.detach() + β·KL(π‖π_ref), averaged over the completion's tokens), each user's gradient by its own
    autograd pass through a fresh copy of the initial policy; advantages recomputed from the reward rule, per prompt
    group. Also returns the advantages for comparison with the trainer's."""
    tokenizer = tiny_tokenizer()
    policy = MODELS[model](len(tokenizer))
    reference = copy.deepcopy(policy)
    rows = []  # (user, prompt, completion, advantage)
    advantages = []
    for batch in batches:
        n = batch["prompt_ids"].shape[0]
        tokens = [_row_tokens(batch, i) for i in range(n)]
        rewards = torch.tensor(id_reward([c.tolist() for _, c in tokens]))
        grouped = rewards.view(-1, G)
        adv = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).flatten()
        advantages.append(adv)
        rows += [(int(batch[USER_KEY][i]), *tokens[i], adv[i]) for i in range(n)]
    total = {n: torch.zeros_like(p) for n, p in policy.named_parameters()}
    for user in sorted({r[0] for r in rows}):
        losses = []
        for _, prompt, completion, a in (r for r in rows if r[0] == user):
            logp = _completion_logps(policy, prompt, completion)
            with torch.no_grad():
                ref = _completion_logps(reference, prompt, completion)
            kl = torch.exp(ref - logp) - (ref - logp) - 1
            losses.append((-a * torch.exp(logp - logp.detach()) + beta * kl).mean())
        grads = torch.autograd.grad(torch.stack(losses).mean(), list(policy.parameters()), allow_unused=True)
        for (name, _), g in zip(policy.named_parameters(), grads):
            if g is not None:
                total[name] += g
    return {n: -lr * g / users_per_batch for n, g in total.items()}, advantages


@pytest.mark.parametrize("model,accumulation,mode", [("llama", 1, "hooks"), ("llama", 2, "hooks"), ("llama", 1, "ghost"),
                                                   ("gpt2", 1, "hooks"), ("gpt2", 2, "ghost")])
def test_one_step_equals_a_per_user_autograd_computation(tmp_path, model, accumulation, mode):
    """σ = 0, a clip no user reaches, every user drawn (q = 1): the update is −lr·Σ_u ḡ_u/ñ exactly, ḡ_u user u's
    averaged GRPO gradient, each completion's loss from its own unpadded row (users with 1 and with 3 prompts, G = 4,
    a KL penalty against a reference model, prompts of different lengths so rows are left-padded: with GPT-2's learned
    absolute positions a row's loss would follow the other rows' padding unless its positions are its own)."""
    dataset = _prompts({"solo": ["the movie was"], "busy": ["i loved the acting and", "the plot", "great"]})
    trainer = _trainer(tmp_path, dataset, noise_multiplier=0.0, target_epsilon=None, per_user_max_grad_norm=1e6,
                       users_per_batch=2.0, max_samples_per_user=3, beta=0.1, gradient_accumulation_steps=accumulation,
                       grad_sample_mode=mode, model=model)
    batches = _record_batches(trainer)
    before = _params(trainer.model)
    trainer.train()
    assert trainer.privacy_engine.accountant.steps_taken == 1 and trainer.privacy_engine.data_loader.sample_rate == 1.0
    rows_per_user = torch.cat([b[USER_KEY] for b in batches]).bincount().tolist()
    assert sorted(rows_per_user) == [G, 3 * G]  # every prompt of both users, G completions each
    expected, advantages = _independent_update(batches, beta=0.1, users_per_batch=2.0, lr=1.0, model=model)
    for batch, adv in zip(batches, advantages):
        torch.testing.assert_close(batch["advantages"], adv, atol=1e-5, rtol=1e-5)
    after = _params(trainer.model)
    moved = 0.0
    for name, value in before.items():
        torch.testing.assert_close(after[name] - value, expected[name], atol=2e-6, rtol=1e-4, msg=name)
        moved += float(expected[name].norm() ** 2)
    assert moved > 1e-6  # the step is not trivially zero


class FixedCompletions:
    """Stands in for sampling so that a step is deterministic and each user's completions do not depend on who else
    was drawn: completion k of a prompt is a fixed function of the prompt's tokens and k; the ``long_prefix`` prompt's
    run to ``max_completion_length`` without an EOS."""

    def __init__(self, trainer, long_prefix: str, vocab: int):
        self.trainer, self.vocab = trainer, vocab
        self.long = trainer.processing_class(text=long_prefix)["input_ids"]

    def __call__(self, prompt_ids, images, multimodal_fields, num_generations):
        out = []
        for i, ids in enumerate(prompt_ids):
            k, seed = i % num_generations, sum(ids)
            if ids[:len(self.long)] == self.long:
                out.append([3 + (seed + 5 * k + j) % (self.vocab - 3) for j in range(self.trainer.max_completion_length)])
            else:
                out.append([3 + (seed + 11 * k + j) % (self.vocab - 3) for j in range(1 + k)] + [2])  # ends with EOS
        return out, None


def adversarial_reward(kind):
    def reward(prompts, completion_ids, **kwargs):
        out = []
        for prompt, ids in zip(prompts, completion_ids):
            if not prompt.startswith("zz"):
                out.append(float(sum(ids) % 7))
            elif kind == "huge":
                out.append(1e6 * (sum(ids) % 7))
            elif kind == "nan":
                out.append(float("nan") if sum(ids) % 7 < 3 else 1e6 * (sum(ids) % 7))
            else:  # "inf"
                out.append(float("inf") if sum(ids) % 7 < 3 else -1e38)
        return out
    return reward


HONEST = {"a": ["the movie was"], "b": ["i loved the acting", "the plot"]}
ADVERSARY = {"z": ["zz the movie was", "zz great", "zz i hated the plot and"]}


def _clipped_sum(tmp_path, users, reward, clip, scale_rewards):
    """Σ_u clip(ḡ_u) for one deterministic step with every user drawn, read off the SGD update as (θ₀ − θ₁)·ñ/lr."""
    trainer = _trainer(tmp_path, _prompts(users), reward=reward, noise_multiplier=0.0, target_epsilon=None,
                       per_user_max_grad_norm=clip, users_per_batch=float(len(users)), max_samples_per_user=3,
                       max_completion_length=24, scale_rewards=scale_rewards, beta=0.0)
    trainer._generate_single_turn = FixedCompletions(trainer, "zz", len(trainer.processing_class))
    before = _params(trainer.model)
    trainer.train()
    after = _params(trainer.model)
    return torch.cat([(before[n] - after[n]).flatten() for n in before]) * len(users)


@pytest.mark.parametrize("kind,scale_rewards", [("huge", "none"), ("nan", "group"), ("inf", "none"),
                                                pytest.param("huge", "group", marks=pytest.mark.slow),
                                                pytest.param("nan", "none", marks=pytest.mark.slow),
                                                pytest.param("inf", "group", marks=pytest.mark.slow)])
def test_an_adversarial_user_moves_the_update_by_at_most_c_over_n(tmp_path, kind, scale_rewards):
    """Huge, NaN or infinite rewards, and 24-token completions without an EOS (the others have 2 to 5 tokens): the
    clipped sums with and without the adversary differ by at most C in norm, so the update by at most C/ñ. Without clipping (C = 1e9) the same
    adversary's huge rewards move it by far more, so the test can fail."""
    clip = 0.05
    reward = adversarial_reward(kind)
    with_adversary = _clipped_sum(tmp_path / "with", {**HONEST, **ADVERSARY}, reward, clip, scale_rewards)
    without = _clipped_sum(tmp_path / "without", HONEST, reward, clip, scale_rewards)
    influence = float((with_adversary - without).norm())
    assert influence <= clip * (1 + 1e-4), influence
    assert float(without.norm()) > 0  # the honest users moved the model
    if kind == "huge" and scale_rewards == "none":
        unclipped = _clipped_sum(tmp_path / "unclipped", {**HONEST, **ADVERSARY}, reward, 1e9, scale_rewards)
        honest = _clipped_sum(tmp_path / "honest", HONEST, reward, 1e9, scale_rewards)
        assert not torch.isfinite(unclipped).all() or float((unclipped - honest).norm()) > 100 * clip


def _sampled_clipped_sum(tmp_path, users, clip, model, **config):
    """Σ_u clip(ḡ_u) of one step with every user drawn and σ = 0, the completions sampled by the trainer itself (the
    public seed 0, one privacy_seed); also the completions each user got."""
    trainer = _trainer(tmp_path, _prompts(users), noise_multiplier=0.0, target_epsilon=None, per_user_max_grad_norm=clip,
                       users_per_batch=float(len(users)), max_samples_per_user=3, max_completion_length=8, beta=0.0,
                       model=model, **config)
    batches = _record_batches(trainer)
    before = _params(trainer.model)
    trainer.train()
    after = _params(trainer.model)
    keys = trainer._private_loader.user_index.keys
    completions = {}
    for batch in batches:
        for i, user in enumerate(batch[USER_KEY].tolist()):
            completions.setdefault(str(keys[user]), []).append(_row_tokens(batch, i)[1].tolist())
    return torch.cat([(before[n] - after[n]).flatten() for n in before]) * len(users), completions


ORDINARY = {"a": ["the movie was"], "b": ["i loved the acting", "the plot"], "c": ["great and"]}


@pytest.mark.parametrize("model", ["llama", "gpt2_dropout"])
def test_with_the_trainers_own_sampling_an_added_user_moves_the_clipped_sum_by_at_most_c(tmp_path, model):
    """Issue 39, findings 1 and 2: three ordinary users plus z, σ = 0, every user drawn, C = 0.05, the trainer's real
    sampling from the public seed 0. Each user's completions come from their own stream (the run's secret, the step,
    their id), so z's rows neither shift the others' completions nor, with GPT-2's default dropout (which
    UserDPGRPOConfig turns off), their dropout masks: the clipped sums differ by z's clipped gradient alone. Sampled
    from torch's global stream the others' completions moved, and the sums by 2.24·C; with dropout, by 1.30·C."""
    clip = 0.05
    with_z, sampled_with = _sampled_clipped_sum(tmp_path / "with", {**ORDINARY, **ADVERSARY}, clip, model)
    without, sampled_without = _sampled_clipped_sum(tmp_path / "without", ORDINARY, clip, model)
    assert {u: sampled_with[u] for u in ORDINARY} == sampled_without
    assert float((with_z - without).norm()) <= clip * (1 + 1e-4)
    assert float(without.norm()) > clip  # the ordinary users moved the model, each by up to C


def test_completions_are_not_drawn_from_the_public_seed(tmp_path):
    """The public ``seed`` does not decide the completions: two runs with the same seed and no privacy_seed (each
    drawing its secret from the OS) sample different ones, and the global stream the seed set is left where it was."""
    sampled = []
    for run in range(2):
        trainer = _trainer(tmp_path / str(run), _prompts(ORDINARY), noise_multiplier=0.0, target_epsilon=None,
                           users_per_batch=3.0, max_samples_per_user=3, max_completion_length=8, privacy_seed=None)
        batch = next(iter(trainer.get_train_dataloader()))
        state = torch.get_rng_state()
        with torch.no_grad():
            sampled.append(trainer._prepare_inputs(batch)["completion_ids"])
        assert torch.equal(torch.get_rng_state(), state)
    assert not torch.equal(sampled[0], sampled[1])


@pytest.mark.parametrize("model", ["gpt2_dropout", "llama_attention_dropout"])
def test_dropout_under_dp_is_off_by_default_and_refused_when_asked_for(tmp_path, model):
    """GRPO's dropout is off under DP by default (TRL's GRPOConfig leaves it on), also where TRL's own switch misses it
    (Llama's attention rate); ``disable_dropout=False`` with dropout in the model is refused before training."""
    trainer = _trainer(tmp_path, _prompts(HONEST), model=model)
    assert not active_dropout(trainer.model)
    with pytest.raises(ValueError, match="disable_dropout=False with dropout in the model"):
        _trainer(tmp_path, _prompts(HONEST), model=model, disable_dropout=False)


def test_the_update_is_the_accountants_noise(tmp_path):
    """One step at σ = 10: the update is N(0, (σC/ñ)²) per coordinate (the clipped sum, ≤ 2C in norm, is negligible)."""
    sigma, clip, n_tilde = 10.0, 1.0, 2.0
    trainer = _trainer(tmp_path, _prompts(HONEST), noise_multiplier=sigma, target_epsilon=None,
                       per_user_max_grad_norm=clip, users_per_batch=n_tilde)
    before = _params(trainer.model)
    trainer.train()
    after = _params(trainer.model)
    update = torch.cat([(after[n] - before[n]).flatten() for n in before]).double()
    n = update.numel()
    stat = (n - 1) * float(update.var()) / (sigma * clip / n_tilde) ** 2
    lo, hi = stats.chi2.interval(0.999, n - 1)
    assert lo <= stat <= hi


def test_epsilon_is_dp_accountings_and_the_saved_report_says_what_was_spent(tmp_path):
    trainer = _trainer(tmp_path, _prompts({**HONEST, "c": ["great"], "d": ["bad and"]}), max_steps=3,
                       users_per_batch=2.0, noise_multiplier=0.8, target_epsilon=None, accountant="pld")
    trainer.train()
    trainer.save_model()
    report = PrivacyReport.load(str(tmp_path))
    assert report.mechanism == "user_dpsgd" and report.steps_taken == 3 and report.n_users == 4
    assert report.sample_rate == pytest.approx(0.5) and report.noise_multiplier == 0.8
    independent = pld.PLDAccountant().compose(
        dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(0.5, dpa.GaussianDpEvent(0.8)), 3)).get_epsilon(1e-5)
    assert report.epsilon == pytest.approx(independent, rel=1e-9)
    logged = [h for h in trainer.state.log_history if "epsilon" in h]
    assert logged and logged[-1]["epsilon"] == pytest.approx(report.epsilon)
    assert not any(k.startswith(("reward", "completions", "kl", "entropy")) for h in logged for k in h)
    assert trainer.state.num_input_tokens_seen == 0  # TRL's count of the private prompts' tokens is not saved


@pytest.fixture(scope="module")
def private_reward(tmp_path_factory):
    out = tmp_path_factory.mktemp("rm")
    trainer = reward_script(UserDPRewardTrainer, UserDPRewardConfig, str(out), steps=2, accountant="rdp")
    return trainer.model, str(out)


def test_the_report_composes_the_prompts_and_the_reward_models_epsilon(tmp_path, private_reward):
    reward_model, reward_dir = private_reward
    tokenizer = tiny_tokenizer()
    args = UserDPGRPOConfig(output_dir=str(tmp_path), **{**BASE, "max_steps": 2, "accountant": "rdp",
                                                         "users_per_batch": 1.0})
    trainer = UserDPGRPOTrainer(model=tiny_llama_lm(len(tokenizer)), reward_funcs=reward_model, args=args,
                                train_dataset=_prompts(HONEST), processing_class=tokenizer,
                                reward_processing_classes=tokenizer)
    trainer.train()
    trainer.save_model()
    report, reward = PrivacyReport.load(str(tmp_path)), PrivacyReport.load(reward_dir)
    own = trainer.privacy_engine.get_epsilon(1e-5)
    assert report.epsilon == pytest.approx(own + reward.epsilon) and report.delta == pytest.approx(1e-5 + reward.delta)
    assert report.extra["prompts_report"]["epsilon"] == pytest.approx(own)
    assert report.extra["reward_model_reports"][0]["epsilon"] == pytest.approx(reward.epsilon)
    card = (tmp_path / "README.md").read_text()
    assert f"(ε = {report.epsilon:.4g}, δ = {report.delta:g})" in card and "composed" in card
    assert trainer.state.log_history[-1]["epsilon"] == pytest.approx(report.epsilon)


def test_a_reward_model_without_a_report_is_refused(tmp_path):
    tokenizer = tiny_tokenizer()
    with pytest.raises(ValueError, match="no privacy report"):
        UserDPGRPOTrainer(model=tiny_llama_lm(len(tokenizer)), reward_funcs=tiny_llama_lm(len(tokenizer)),
                          args=UserDPGRPOConfig(output_dir=str(tmp_path), **BASE), train_dataset=_prompts(HONEST),
                          processing_class=tokenizer)


@pytest.mark.parametrize("setting,match", [
    (dict(num_iterations=2), "num_iterations=2"),
    (dict(steps_per_generation=2), "steps_per_generation=2"),
    (dict(scale_rewards="batch"), "scale_rewards='batch'"),
    (dict(multi_objective_aggregation="normalize_then_sum"), "normalize_then_sum"),
    (dict(loss_type="dapo"), "loss_type='dapo'"),
    (dict(loss_type="bnpo"), "loss_type='bnpo'"),
    (dict(entropy_coef=0.01), "entropy bonus"),
    (dict(top_entropy_quantile=0.5), "top_entropy_quantile"),
    (dict(log_completions=True), "log_completions"),
    (dict(cast_lm_head_to_fp32=True), "cast_lm_head_to_fp32"),
    (dict(privacy_mechanism="randomized_response"), "no de-biased loss"),
])
def test_what_couples_users_or_reuses_a_draw_is_refused_before_training(tmp_path, setting, match):
    with pytest.raises(ValueError, match=match):
        _trainer(tmp_path, _prompts(HONEST), **setting)


def test_tools_are_refused_and_the_defaults_are_per_completion(tmp_path):
    def lookup(word: str) -> str:
        """Look a word up.

        Args:
            word: the word.
        """
        return word

    with pytest.raises(ValueError, match="Tools, environment_factory and rollout_func"):
        tokenizer = tiny_tokenizer()
        UserDPGRPOTrainer(model=tiny_llama_lm(len(tokenizer)), reward_funcs=id_reward, tools=[lookup],
                          args=UserDPGRPOConfig(output_dir=str(tmp_path), **BASE), train_dataset=_prompts(HONEST),
                          processing_class=tokenizer, reward_model_is_public=True)
    args = UserDPGRPOConfig(output_dir=str(tmp_path), **BASE)
    assert args.loss_type == "grpo"


def test_without_privacy_it_is_trls_grpo(tmp_path):
    """privacy_mechanism='none' (the non-private baseline): TRL's own loader, buffering and loss, ε = ∞."""
    trainer = _trainer(tmp_path, _prompts(HONEST), privacy_mechanism="none", loss_type="dapo", max_steps=2)
    trainer.train()
    assert trainer.privacy_engine is None and trainer.current_epsilon() == math.inf
    assert trainer.state.global_step == 2


def test_trls_own_grpo_script_runs_with_the_class_swapped_and_a_user_column(tmp_path):
    """TRL's ``trl/scripts/grpo.py``, its trainer and config classes swapped for ours (nothing else changed), run
    through its own parser and ``main`` as its ``__main__`` does: a local model folder, a local prompt dataset with a
    user column, one of TRL's rule rewards."""
    import importlib.util
    import json

    import trl.scripts.grpo as trl_script

    source = open(trl_script.__file__).read()
    swaps = [("from trl import GRPOTrainer, ", "from trl_userdp.trainers import UserDPGRPOTrainer\n    from trl import "),
             ("trainer = GRPOTrainer(", "trainer = UserDPGRPOTrainer("),
             ("from trl import DatasetMixtureConfig, GRPOConfig, ModelConfig, TrlParser",
              "from trl import DatasetMixtureConfig, ModelConfig, TrlParser\n"
              "    from trl_userdp.trainers import UserDPGRPOConfig as GRPOConfig")]
    for old, new in swaps:
        assert source.count(old) == 1, old
        source = source.replace(old, new)
    script = tmp_path / "grpo.py"
    script.write_text(source)
    tokenizer = tiny_tokenizer()
    model_dir, data_dir = tmp_path / "model", tmp_path / "data"
    tiny_llama_lm(len(tokenizer)).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    data_dir.mkdir()
    with open(data_dir / "train.jsonl", "w") as f:
        for user, prompts in {**HONEST, "c": ["great", "bad and"]}.items():
            for prompt in prompts:
                f.write(json.dumps({"prompt": prompt, "user_id": user}) + "\n")
    out = tmp_path / "out"
    command = ["--model_name_or_path", str(model_dir), "--dataset_name", str(data_dir),
               "--reward_funcs", "get_soft_overlong_punishment", "--output_dir", str(out), "--max_steps", "2",
               "--per_device_train_batch_size", "8", "--num_generations", "4", "--max_completion_length", "8",
               "--users_per_batch", "2", "--accountant", "rdp", "--use_cpu", "true", "--bf16", "false", "--report_to", "none",
               "--save_strategy", "no", "--logging_steps", "1", "--disable_tqdm", "true"]
    spec = importlib.util.spec_from_file_location("swapped_grpo_script", script)
    swapped = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(swapped)
    swapped.main(*swapped.make_parser().parse_args_and_config(args=command, fail_with_unknown_args=False))
    report = PrivacyReport.load(str(out))
    assert report.mechanism == "user_dpsgd" and report.steps_taken == 2 and report.n_users == 3
    assert report.sample_rate == pytest.approx(2 / 3) and report.epsilon <= 8.0  # the defaults: ε = 8, ñ from the flag
    assert "Privacy" in (out / "README.md").read_text()


def test_a_reward_report_under_another_relation_is_refused_before_training(tmp_path, private_reward):
    reward_model, _ = private_reward
    tokenizer = tiny_tokenizer()
    with pytest.raises(ValueError, match="their ε cannot be added"):
        UserDPGRPOTrainer(model=tiny_llama_lm(len(tokenizer)), reward_funcs=reward_model,
                          args=UserDPGRPOConfig(output_dir=str(tmp_path), neighboring_relation="replace", **BASE),
                          train_dataset=_prompts(HONEST), processing_class=tokenizer)


def test_each_reward_call_sees_one_users_completions(tmp_path):
    """Rewards are scored one user at a time: a reward function (or model) never sees two users' completions, so it
    cannot couple them (e.g. by normalising over the batch)."""
    calls = []

    def recording(prompts, completion_ids, **kwargs):
        calls.append(list(prompts))
        return id_reward(completion_ids)

    users = {"a": ["the movie was", "great"], "b": ["i loved the acting"], "c": ["the plot", "bad and"]}
    owner = {p: u for u, prompts in users.items() for p in prompts}
    trainer = _trainer(tmp_path, _prompts(users), reward=recording, users_per_batch=3.0, max_samples_per_user=2,
                       noise_multiplier=0.0, target_epsilon=None)
    trainer.train()
    assert sorted(len(c) for c in calls) == [G, 2 * G, 2 * G]  # q = 1: every user, each in one call
    assert all(len({owner[p] for p in call}) == 1 for call in calls)
