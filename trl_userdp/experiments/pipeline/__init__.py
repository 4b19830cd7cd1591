"""End-to-end recipes on the embedded data (the main job of ``trl-userdp pipeline``)."""

from .sentiment import MECHANISMS, PipelineArguments, run_pipeline

__all__ = ["MECHANISMS", "PipelineArguments", "run_pipeline"]
