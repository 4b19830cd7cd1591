"""What the command tests share: the CLI in a subprocess, and small preference files."""

import json
import subprocess
import sys


def run_cli(*args):
    """``trl-userdp`` as a shell runs it (a fresh process: no traceback may reach its stderr)."""
    return subprocess.run([sys.executable, "-m", "trl_userdp.cli", *args], capture_output=True, text=True, timeout=600)


def pairs(users, per_user=2, conversational=False):
    """Preference rows, ``per_user`` for each of ``users``: plain prompts, or conversational messages."""
    if conversational:
        return [{"prompt": [{"role": "user", "content": "Review?"}],
                 "chosen": [{"role": "assistant", "content": "good film"}],
                 "rejected": [{"role": "assistant", "content": "bad movie"}], "user_id": u}
                for u in users for _ in range(per_user)]
    return [{"prompt": "Review:", "chosen": " good film", "rejected": " bad movie", "user_id": u}
            for u in users for _ in range(per_user)]


def write_jsonl(path, rows):
    """``rows`` as a jsonl file at ``path``; returns ``path``."""
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path
