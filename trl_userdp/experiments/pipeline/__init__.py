"""End-to-end recipes on the embedded data (the main job of ``trl-userdp pipeline``).

Modules, each importing only those listed after it: :mod:`.run` (:func:`run_pipeline`, the orchestration),
:mod:`.report` (table and plot), :mod:`.policy` (SFT and GRPO), :mod:`.evaluation` (gold-reward evaluation, paired
tests), :mod:`.reward` (reward models, AUP-RLHF's public τ), :mod:`.data` (snippets, simulated users, prompts),
:mod:`.arguments` (:class:`PipelineArguments`); beside them :mod:`.embedding_reward` (the reward model) and
:mod:`.gold` (the gold reward).
"""

from .arguments import DEFAULT_MECHANISMS, PipelineArguments
from .data import imdb_preference_dataset
from .run import run_pipeline

__all__ = ["DEFAULT_MECHANISMS", "PipelineArguments", "imdb_preference_dataset", "run_pipeline"]
