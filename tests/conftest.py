import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

if os.environ.get("PYTEST_XDIST_WORKER"):  # workers share the cores: one thread each instead of each taking them all
    import torch

    torch.set_num_threads(1)


def pytest_collection_finish(session):
    """Freeze what the imports and the collection made (torch, transformers, TRL: millions of objects) out of the
    garbage collector's sight: ``Trainer.train`` runs ``gc.collect()`` (accelerate's ``free_memory``), which otherwise
    walks all of them, about 0.3 s a run here."""
    import gc

    gc.collect()
    gc.freeze()
