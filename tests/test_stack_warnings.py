"""The stack's FutureWarnings for TRL's own use of transformers' renamed API (trl_userdp/stack_warnings.py): dropped
by the configs, the trainers' ``train()`` and the commands, and nothing else is."""

import re
import warnings

from trl_userdp.stack_warnings import STACK_DEPRECATIONS, without_stack_deprecations
from trl_userdp.trainers import UserDPDPOConfig, UserDPDPOTrainer

from .trainers.scripts import dpo_script


def test_the_filter_drops_only_the_named_deprecations():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with without_stack_deprecations():
            warnings.warn("`is_gradient_checkpointing` is deprecated and will be removed in v6.", FutureWarning)
            warnings.warn("`gradient_checkpointing_enable` is deprecated and will be removed in v6.", FutureWarning)
            warnings.warn("`my_option` is deprecated", FutureWarning)
            warnings.warn("`gradient_checkpointing` is deprecated", UserWarning)
    assert [str(w.message) for w in seen] == ["`my_option` is deprecated", "`gradient_checkpointing` is deprecated"]


def test_a_private_dpo_run_from_python_shows_none_of_them(tmp_path):
    """Issue 44, item 6: a DPO run printed transformers' FutureWarning for TRL's `is_gradient_checkpointing()`."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        dpo_script(UserDPDPOTrainer, UserDPDPOConfig, str(tmp_path), steps=2,
                   accountant="rdp")  # calibrated in a second, not PLD's eight
    assert not [str(w.message) for w in seen if re.match(STACK_DEPRECATIONS, str(w.message))]
