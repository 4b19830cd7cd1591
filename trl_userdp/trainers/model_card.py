"""The privacy statement in TRL's model card: every model a trainer of this package saves says in its ``README.md`` what
is protected and what is not (docs/privacy_model.md), from the same :class:`~trl_userdp.PrivacyReport` as
``privacy_report.json``."""

from __future__ import annotations

import json
import os
from typing import List, Optional, Union

from ..accountants import PrivacyReport
from ..models import describe_packaged_model

#: tags added to TRL's own in every card
TAGS = ["trl_userdp", "user-level-dp"]
#: the method each TRL trainer's ``_name`` stands for, where the name alone does not say it
METHODS = {"Reward": "reward modeling"}


class PrivacyModelCardMixin:
    """Extends TRL's ``create_model_card`` (its model-card hook): the card gets :data:`TAGS` and, once the run has a
    report (:meth:`card_privacy_report`), a "Privacy" section; ``save_model`` writes the card with the final report."""

    def card_privacy_report(self) -> Optional[PrivacyReport]:
        """The report the card states; every trainer defines it.

        Returns:
            The :class:`~trl_userdp.PrivacyReport`, or None (nothing to state yet).
        """
        raise NotImplementedError

    #: markdown naming the model the run started from, for a base that is not a hub id (the command line sets it for
    #: its packaged models); None: described from the model's config (:meth:`card_base_model`)
    base_model_description: Optional[str] = None

    def card_base_model(self) -> str:
        """What the card says the model was fine-tuned from, where TRL's card (which links hub ids only) would say
        "[None](https://huggingface.co/None)": :attr:`base_model_description`, else a packaged model by its origin
        (:func:`~trl_userdp.models.describe_packaged_model`), else the local folder the model was loaded from, else the
        architecture built from a config.

        Returns:
            The markdown.
        """
        if self.base_model_description:
            return self.base_model_description
        config = self.model.config
        name = getattr(config, "_name_or_path", "") or ""
        if name:
            return describe_packaged_model(name) or f"the model in `{name}`"
        return f"a `{getattr(config, 'model_type', type(self.model).__name__)}` model built from its configuration"

    def create_model_card(self, model_name: Optional[str] = None, dataset_name: Optional[str] = None,
                          tags: Union[str, List[str], None] = None):
        """TRL's card with :data:`TAGS`, the base model named (:meth:`card_base_model`), a quick start that loads the
        output folder, and the "Privacy" section of :meth:`card_privacy_report`.

        Args:
            model_name: as TRL's.
            dataset_name: as TRL's.
            tags: further tags (one or a list), as TRL's.
        """
        tags = [tags] if isinstance(tags, str) else list(tags or [])
        super().create_model_card(model_name=model_name, dataset_name=dataset_name, tags=[*tags, *TAGS])
        path = os.path.join(self.args.output_dir, "README.md")
        if not self.is_world_process_zero() or not os.path.isfile(path):
            return
        with open(path) as f:
            card = f.read()
        # TRL links the base and loads the hub id in its quick start; a local run has neither: name the base, and
        # load the folder the model was saved in
        card = card.replace("[None](https://huggingface.co/None)", self.card_base_model())
        card = card.replace('model="None"', f"model={json.dumps(self.args.output_dir)}")
        # the reward card's pipeline infers its task from the hub, which a local folder (or an offline machine) lacks
        card = card.replace("pipeline(model=", 'pipeline("text-classification", model=')
        # TRL's "This model was trained with Reward." names its trainer's method, not the private one that ran
        name = getattr(self, "_name", None)
        if name:
            card = card.replace(f"This model was trained with {name}",
                                f"This model was trained with trl_userdp's `{type(self).__name__}`: user-level "
                                f"differentially private {METHODS.get(name, name)}")
        report = self.card_privacy_report()
        if report is not None:
            card += "\n" + report.to_markdown()
        with open(path, "w") as f:
            f.write(card)

    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False):
        """TRL's save, then the card rewritten with the final report when the model is saved to ``output_dir``."""
        super().save_model(output_dir, _internal_call)
        if output_dir is None or os.path.abspath(output_dir) == os.path.abspath(self.args.output_dir):
            self.create_model_card(model_name=os.path.basename(os.path.normpath(self.args.output_dir)))
