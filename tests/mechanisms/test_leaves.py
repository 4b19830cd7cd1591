"""The mechanisms are the lowest layer that knows privacy: importing them imports no engine, optimizer, per-sample
gradient hook or trainer (of this package or of Opacus), and no import in them waits inside a function."""

import ast
import pathlib
import subprocess
import sys

import trl_userdp.mechanisms

HIGHER = ("trl_userdp.privacy_engine", "trl_userdp.adaptive_engine", "trl_userdp.optimizers", "trl_userdp.grad_sample",
          "trl_userdp.trainers")
#: whole libraries above the mechanisms (Opacus's package import loads its engine and optimizers)
LIBRARIES = ("opacus", "transformers", "trl")


def test_importing_the_mechanisms_imports_no_engine_optimizer_or_trainer():
    code = ("import sys, trl_userdp.mechanisms; print('\\n'.join(m for m in sys.modules if m.split('.')[0] in "
            f"{LIBRARIES!r} or m.startswith({HIGHER!r})))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert loaded == []


def test_no_import_inside_a_function_in_the_mechanisms():
    package = pathlib.Path(trl_userdp.mechanisms.__file__).parent
    for path in sorted(package.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                inner = [n for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom))]
                assert not inner, f"{path.name}:{inner[0].lineno} imports inside {node.name}()"
