"""End-to-end recipes on the embedded data (the main job of ``trl-userdp pipeline``)."""

from .sentiment import DEFAULT_MECHANISMS, PipelineArguments, run_pipeline

__all__ = ["DEFAULT_MECHANISMS", "PipelineArguments", "run_pipeline"]
