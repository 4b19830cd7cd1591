"""Mixed precision in the trainers (issue 24): ``bf16=True`` (autocast) trains the reward and DPO trainers privately in
both gradient modes, with gradient accumulation, and the two modes take the same update to bf16's precision."""

import pytest
import torch

from .scripts import SCRIPTS, bf16_updates_by_mode


@pytest.mark.parametrize("script,trainer_cls,config_cls",
                         [SCRIPTS[0], pytest.param(*SCRIPTS[1], marks=pytest.mark.slow)])  # DPO with -m slow
def test_bf16_autocast_trains_privately_in_both_modes(tmp_path, script, trainer_cls, config_cls):
    updates = bf16_updates_by_mode(script, trainer_cls, config_cls, str(tmp_path))
    for update in updates.values():
        assert torch.isfinite(update).all() and update.abs().sum() > 0
    diff = torch.linalg.vector_norm(updates["ghost"] - updates["hooks"]) / torch.linalg.vector_norm(updates["hooks"])
    assert diff < 2e-2, float(diff)
