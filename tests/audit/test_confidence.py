"""An audit's confidence lies in (0, 1) at every entry point, refused before any training or scoring (issue 39,
finding 6): at 0 or below the "lower bound" held with probability 0 and was printed as consistent with the claim;
1.5 was refused only after training, naming the per-test value."""

import numpy as np
import pytest

from trl_userdp.audit import PreferenceCanaries, audit_gradient_canaries
from trl_userdp.audit.bounds import audit_scores, each_test_confidence, epsilon_lower_bound
from trl_userdp.audit.planning import plan_guesses
from trl_userdp.scripts.audit import AuditArguments

from ..tiny_models import tiny_tokenizer

BAD = [0.0, -0.5, 1.0, 1.5, float("nan")]


class _NoModel:
    def __getattr__(self, name):
        raise AssertionError("the model was used before the confidence was checked")


@pytest.mark.parametrize("confidence", BAD)
def test_every_entry_point_refuses_a_confidence_outside_0_1_before_any_work(confidence, monkeypatch):
    match = "must lie in \\(0, 1\\)"
    with pytest.raises(ValueError, match=match):
        each_test_confidence(confidence, 2)
    with pytest.raises(ValueError, match=match):
        epsilon_lower_bound(100, 10, 9, delta=1e-5, confidence=confidence)
    with pytest.raises(ValueError, match=match):
        audit_scores(np.zeros(10), np.arange(10) % 2 == 0, 1e-5, confidence)
    with pytest.raises(ValueError, match=match):
        plan_guesses(1.0, 1e-5, 100, confidence)
    with pytest.raises(ValueError, match="--confidence must lie"):
        AuditArguments(confidence=confidence)
    canaries = PreferenceCanaries.make(tiny_tokenizer(), 4, seed=0)
    monkeypatch.setattr(PreferenceCanaries, "scores", lambda *a, **k: pytest.fail("scored before the check"))
    with pytest.raises(ValueError, match=match):
        canaries.audit(_NoModel(), tiny_tokenizer(), delta=1e-5, epsilon_claimed=1.0, confidence=confidence)
    import trl_userdp.audit.whitebox as whitebox
    monkeypatch.setattr(whitebox, "PrivacyEngine", lambda *a, **k: pytest.fail("trained before the check"))
    with pytest.raises(ValueError, match=match):
        audit_gradient_canaries(8, steps=1, noise_multiplier=1.0, confidence=confidence, seed=0)
