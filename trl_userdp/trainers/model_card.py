"""The privacy statement in TRL's model card: every model a trainer of this package saves says in its ``README.md`` what
is protected and what is not (docs/privacy_model.md), from the same :class:`~trl_userdp.PrivacyReport` as
``privacy_report.json``."""

from __future__ import annotations

import os
from typing import List, Optional, Union

from ..accountants import PrivacyReport

#: tags added to TRL's own in every card
TAGS = ["trl_userdp", "user-level-dp"]


class PrivacyModelCardMixin:
    """Extends TRL's ``create_model_card`` (its model-card hook): the card gets :data:`TAGS` and, once the run has a
    report (:meth:`card_privacy_report`), a "Privacy" section; ``save_model`` writes the card with the final report."""

    def card_privacy_report(self) -> Optional[PrivacyReport]:
        """The report the card states (None: nothing to state yet)."""
        raise NotImplementedError

    def create_model_card(self, model_name: Optional[str] = None, dataset_name: Optional[str] = None,
                          tags: Union[str, List[str], None] = None):
        tags = [tags] if isinstance(tags, str) else list(tags or [])
        super().create_model_card(model_name=model_name, dataset_name=dataset_name, tags=[*tags, *TAGS])
        report = self.card_privacy_report()
        path = os.path.join(self.args.output_dir, "README.md")
        if self.is_world_process_zero() and report is not None and os.path.isfile(path):
            with open(path, "a") as f:
                f.write("\n" + report.to_markdown())

    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False):
        super().save_model(output_dir, _internal_call)
        if output_dir is None or os.path.abspath(output_dir) == os.path.abspath(self.args.output_dir):
            self.create_model_card(model_name=os.path.basename(os.path.normpath(self.args.output_dir)))
