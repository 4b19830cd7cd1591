# Sourced by scripts/main and scripts/test: create (once) and activate the project's virtualenv.
#   TRL_USERDP_VENV  where the virtualenv lives (default: .venv in the repository)
#   TORCH_SPEC       what to install as torch, first (default: torch==2.13.0, the local CPU wheel);
#                    GPU users: TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu126"
#   PYTHON           interpreter used to create the virtualenv (default: python3)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${TRL_USERDP_VENV:-$ROOT/.venv}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
if [ ! -x "$VENV/bin/python" ]; then
    echo "[setup] creating virtualenv $VENV"
    "${PYTHON:-python3}" -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
stamp="$VENV/.trl_userdp_installed"
want="$(cat "$ROOT/pyproject.toml" | sha256sum | cut -c1-16) $TORCH_SPEC"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "[setup] installing torch ($TORCH_SPEC), then trl_userdp with its dev, examples and tracking extras"
    python -m pip install --quiet --upgrade pip
    # torch first: otherwise a dependency may pull a multi-GB CUDA build
    # shellcheck disable=SC2086
    python -m pip install --quiet $TORCH_SPEC
    python -m pip install --quiet -e "$ROOT[dev,examples,tracking]"
    echo "$want" > "$stamp"
fi
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}" HF_HUB_DISABLE_TELEMETRY=1 TOKENIZERS_PARALLELISM=false
cd "$ROOT"
