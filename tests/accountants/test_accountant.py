"""The Opacus-registered accountants backed by dp-accounting."""

import opacus
import pytest
import torch
from opacus.accountants import create_accountant
from opacus.accountants.utils import get_noise_multiplier

from trl_userdp.accountants import DPPldAccountant, DPRdpAccountant, compute_epsilon, poisson_gaussian_event


@pytest.mark.parametrize("name,kind", [("dp_rdp", "rdp"), ("dp_pld", "pld")])
def test_registered_with_opacus_and_equal_to_dp_accounting(name, kind):
    acc = create_accountant(name)
    for _ in range(30):
        acc.step(noise_multiplier=1.1, sample_rate=0.05)
    assert acc.history == [(1.1, 0.05, 30)]
    assert acc.get_epsilon(1e-5) == pytest.approx(
        compute_epsilon(poisson_gaussian_event(1.1, 0.05, 30), 1e-5, accountant=kind), rel=1e-12
    )


def test_heterogeneous_history_composes_every_segment():
    acc = DPRdpAccountant()
    acc.step(noise_multiplier=1.0, sample_rate=0.02)
    acc.step(noise_multiplier=2.0, sample_rate=0.02)
    acc.step(noise_multiplier=2.0, sample_rate=0.02)
    assert acc.history == [(1.0, 0.02, 1), (2.0, 0.02, 2)]
    both = acc.get_epsilon(1e-5)
    only_first = compute_epsilon(poisson_gaussian_event(1.0, 0.02, 1), 1e-5)
    assert both > only_first


def test_opacus_privacy_engine_and_noise_search_accept_it():
    engine = opacus.PrivacyEngine(accountant="dp_pld")
    assert isinstance(engine.accountant, DPPldAccountant)
    sigma = get_noise_multiplier(target_epsilon=3.0, target_delta=1e-5, sample_rate=0.02, steps=250, accountant="dp_rdp")
    assert compute_epsilon(poisson_gaussian_event(sigma, 0.02, 250), 1e-5) <= 3.0


def test_state_dict_round_trip_keeps_relation_and_history():
    acc = DPPldAccountant(relation="replace")
    acc.step(noise_multiplier=1.0, sample_rate=0.1)
    state = acc.state_dict()
    fresh = DPPldAccountant(relation="replace")
    fresh.load_state_dict(state)
    assert fresh.history == acc.history and fresh.relation == "replace"
    assert fresh.get_epsilon(1e-5) == pytest.approx(acc.get_epsilon(1e-5))
    with pytest.raises(ValueError, match="not this run's"):
        DPRdpAccountant(relation="replace").load_state_dict(state)  # a pld history is not an rdp one
    with pytest.raises(ValueError, match="not this run's"):
        DPPldAccountant().load_state_dict(state)  # nor is a replace-one history an add/remove one (issue 11)


@pytest.mark.parametrize("history,match", [
    ([(1.0, 0.1, 0)], "step count 0"), ([(-1.0, 0.1, 3)], "noise_multiplier"), ([(1.0, 1.5, 3)], "sample_rate"),
    ([(1.0, 0.1)], "malformed"), ("x", "malformed"),
])
def test_a_malformed_history_is_refused(history, match):
    state = DPPldAccountant().state_dict()
    state["history"] = history
    with pytest.raises(ValueError, match=match):
        DPPldAccountant().load_state_dict(state)


def test_no_steps_means_no_privacy_spent_and_bad_delta_raises():
    acc = DPRdpAccountant()
    assert acc.get_epsilon(1e-5) == 0.0
    with pytest.raises(ValueError, match="delta"):
        acc.get_epsilon(1.5)
    with pytest.raises(ValueError, match="neighboring_relation"):
        DPRdpAccountant(relation="swap")
    with pytest.raises(ValueError, match="noise_multiplier"):
        acc.step(noise_multiplier=-1.0, sample_rate=0.1)
    with pytest.raises(ValueError, match="sample_rate"):
        acc.step(noise_multiplier=1.0, sample_rate=1.5)
    assert acc.history == []


def test_optimizer_hook_steps_the_accountant():
    model = torch.nn.Linear(3, 1)
    acc = DPRdpAccountant()
    hook = acc.get_optimizer_hook_fn(sample_rate=0.02)
    fake = type("Opt", (), {"noise_multiplier": 1.0, "accumulated_iterations": 1})()
    hook(fake)
    hook(fake)
    assert acc.history == [(1.0, 0.02, 2)]
    del model
