"""The mechanism registry: every entry point takes its mechanisms from it, so a mechanism defined outside the package
(one class, registered) trains through the engine and the trainers unchanged."""

import pytest
import torch
from torch.utils.data import DataLoader
from trl.trainer.reward_trainer import DataCollatorForPreference

from trl_userdp import AdaptiveUserPrivacyEngine, PrivacyEngine, PrivacyReport
from trl_userdp.accountants.events import PoissonGaussian
from trl_userdp.optimizers import AUPOptimizer
from trl_userdp.mechanisms import (
    MECHANISM_REGISTRY,
    AUPRLHF,
    GroupPrivacy,
    UserDPSGD,
    get_mechanism,
    mechanism_names,
    register_mechanism,
)
from trl_userdp.trainers import UserDPRewardConfig, UserDPRewardTrainer

from ..tiny_models import MODELS, preference_dataset
from ..trainers.scripts import reward_script


class RelabelledUserDPSGD(UserDPSGD):
    """A mechanism added from outside the package: user-wise DP-SGD under another name."""

    name = "relabelled_user_dpsgd"
    summary = "user-wise DP-SGD, registered by a test"


@pytest.fixture
def relabelled(monkeypatch):
    monkeypatch.setitem(MECHANISM_REGISTRY, RelabelledUserDPSGD.name, RelabelledUserDPSGD)
    return RelabelledUserDPSGD


def test_the_built_in_mechanisms_are_registered_with_their_kinds():
    assert mechanism_names() == ("none", "randomized_response", "group", "user_dpsgd", "user_dpsgd_adaptive_clip", "aup")
    assert mechanism_names("gradient") == ("group", "user_dpsgd", "user_dpsgd_adaptive_clip", "aup")
    assert mechanism_names("labels") == ("randomized_response",)
    with pytest.raises(ValueError, match=r"privacy_mechanism must be one of \('none'"):
        get_mechanism("laplace")


def test_a_second_mechanism_under_a_taken_name_is_refused():
    class Impostor(UserDPSGD):
        name = "user_dpsgd"

    with pytest.raises(ValueError, match="already registered"):
        register_mechanism(Impostor)
    assert get_mechanism("user_dpsgd") is UserDPSGD


def _engine_call(engine, mechanism, **kwargs):
    model = MODELS["llama"]()
    return engine.make_private_user_level(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(preference_dataset(), collate_fn=DataCollatorForPreference(pad_token_id=0)),
        max_samples_per_user=3, users_per_batch=2.0, rows_per_example=2, mechanism=mechanism, **kwargs)


def test_the_engine_sets_up_gradient_mechanisms_only_and_asks_for_options_it_cannot_guess():
    with pytest.raises(ValueError, match="mechanism='aup' needs its options: pass a AUPRLHF"):
        _engine_call(PrivacyEngine(), "aup", target_epsilon=3.0, target_delta=1e-5, steps=2)
    with pytest.raises(ValueError, match="'randomized_response' is a 'labels' mechanism"):
        _engine_call(PrivacyEngine(), "randomized_response", max_grad_norm=1.0, noise_multiplier=1.0)
    with pytest.raises(ValueError, match=r"mechanism must be one of"):
        _engine_call(PrivacyEngine(), "laplace", max_grad_norm=1.0, noise_multiplier=1.0)
    with pytest.raises(ValueError, match="calibrates its noise to target_epsilon; it takes no noise_multiplier"):
        _engine_call(PrivacyEngine(), AUPRLHF(1.0), noise_multiplier=1.0)


def test_aup_rlhf_goes_through_the_set_up_every_mechanism_goes_through():
    """PrivacyEngine with the AUPRLHF object and AdaptiveUserPrivacyEngine (which adds only Alg. 1's phases) build the
    same run: σ, noise scale, budget, loader draws, report."""
    run = dict(target_epsilon=3.0, target_delta=1e-5, steps=3, sampling_seed=0, noise_seed=0)
    plain = PrivacyEngine(accountant="pld")
    _, opt_plain, loader_plain = _engine_call(plain, AUPRLHF(1.0, svt_fraction=0.4), **run)
    adaptive = AdaptiveUserPrivacyEngine()
    model = MODELS["llama"]()
    _, opt_adaptive, loader_adaptive = adaptive.make_private_user_level(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(preference_dataset(), collate_fn=DataCollatorForPreference(pad_token_id=0)),
        max_samples_per_user=3, users_per_batch=2.0, rows_per_example=2, concentration_radius=1.0, svt_fraction=0.4,
        **run)
    assert type(opt_plain) is type(opt_adaptive) is AUPOptimizer
    assert opt_plain.noise_multiplier == opt_adaptive.noise_multiplier and opt_plain.noise_std == opt_adaptive.noise_std
    assert plain.budget == adaptive.budget and plain.accountant.events == adaptive.accountant.events
    draws = ([], [])
    for drawn, loader, opt in zip(draws, (loader_plain, loader_adaptive), (opt_plain, opt_adaptive)):
        for _ in loader:
            drawn.append(loader.last_row_users.tolist())
            opt.hooks.set_row_users(None)  # discarded: nothing accounted
    assert draws[0] == draws[1] and len(draws[0]) == 3
    report_plain, report_adaptive = plain.privacy_report(1e-5).to_dict(), adaptive.privacy_report(1e-5).to_dict()
    assert report_adaptive["extra"].pop("phase_users") == "all"
    assert report_plain == report_adaptive


def test_a_mechanism_object_is_accepted_and_configures_the_accountant():
    engine = PrivacyEngine(accountant="pld")
    _engine_call(engine, GroupPrivacy("els"), max_grad_norm=1.0, noise_multiplier=2.0)
    assert engine.accountant.events.to_dict() == {"name": "els_gaussian", "max_samples_per_user": 3}
    assert engine.privacy_report(1e-5).mechanism == "group_els"
    with pytest.raises(ValueError, match="PLD accountant only"):
        _engine_call(PrivacyEngine(accountant="rdp"), GroupPrivacy("els"), max_grad_norm=1.0, noise_multiplier=2.0)


def test_a_registered_mechanism_trains_through_the_trainer_and_is_accounted_by_its_event(tmp_path, relabelled):
    trainer = reward_script(UserDPRewardTrainer, UserDPRewardConfig, str(tmp_path), steps=2,
                            privacy_mechanism=relabelled.name, accountant="pld", privacy_seed=11)
    report = PrivacyReport.load(str(tmp_path))
    assert report.mechanism == relabelled.name and report.steps_taken == 2
    accountant = trainer.privacy_engine.accountant
    assert isinstance(trainer.privacy_engine.mechanism, RelabelledUserDPSGD)
    assert report.epsilon == pytest.approx(PoissonGaussian().epsilon(accountant.history, report.delta), rel=1e-12)
    with pytest.raises(ValueError, match="privacy_mechanism must be one of"):
        UserDPRewardConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, privacy_mechanism="not_registered")


def test_the_adaptive_clip_mechanisms_old_name_is_still_accepted_with_a_warning():
    """Issue 43: one name per concept. ``user_dpsgd_adaptive`` (adaptive clipping) read like AUP-RLHF's
    ``AdaptiveUserPrivacyEngine``; it is now ``user_dpsgd_adaptive_clip``, and the old name still sets it up."""
    with pytest.warns(FutureWarning, match="'user_dpsgd_adaptive' is now 'user_dpsgd_adaptive_clip'"):
        assert get_mechanism("user_dpsgd_adaptive") is get_mechanism("user_dpsgd_adaptive_clip")
    with pytest.warns(FutureWarning, match="is now 'user_dpsgd_adaptive_clip'"):
        config = UserDPRewardConfig(output_dir="unused", privacy_mechanism="user_dpsgd_adaptive", target_epsilon=3.0,
                                    accountant="rdp", report_to="none")
    assert config.privacy_mechanism == "user_dpsgd_adaptive_clip"
