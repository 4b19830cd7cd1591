"""The model card names the model a run started from and its quick start loads the saved model (issue 25, item 5):
TRL's card links hub ids only, so a local run's card said "fine-tuned version of [None](https://huggingface.co/None)"
and loaded `model="None"`."""

import re

from trl_userdp.trainers import UserDPRewardConfig, UserDPRewardTrainer

from .scripts import reward_script


def test_the_card_names_the_base_and_its_quick_start_loads_the_saved_model(tmp_path, monkeypatch):
    out = tmp_path / "rm"
    reward_script(UserDPRewardTrainer, UserDPRewardConfig, str(out), steps=1, accountant="rdp")
    card = (out / "README.md").read_text()
    assert "None" not in card.split("## Training procedure")[0]
    assert "fine-tuned version of a `llama` model built from its configuration" in card
    # issue 44, item 6: the card says which trainer ran, not TRL's "This model was trained with Reward."
    assert "This model was trained with trl_userdp's `UserDPRewardTrainer`: user-level differentially private reward" \
        " modeling" in card
    assert "trained with Reward." not in card
    (quick_start,) = re.findall(r"## Quick start\n\n```python\n(.*?)```", card, re.S)
    assert f'model="{out}"' in quick_start
    monkeypatch.chdir(tmp_path)
    names: dict = {}
    exec(quick_start, names)  # as a reader pastes it: the reward of a text from the saved model
    assert isinstance(names["output"]["score"], float)
