"""Evaluation runner, review ``runnerrev``: ``evaluate``'s data argument and the texts ``--data`` refuses."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_evaluate_runner3 import VOCAB, _tiny_llama  # the same 2-layer Llama of 64 ids

pytestmark = pytest.mark.usefixtures("one_thread")


def test_numpy_token_ids_are_evaluated_as_the_same_tensor():
    """Token ids as a NumPy array (``np.load``'s) were taken for a text spec once the model had loaded: "this model
    has no tokenizer" for a bare module, "text spec must be a non-empty str" for one with a tokenizer. They are now
    the tensor of the same ids: the same summary, the same token fingerprint."""
    from kvbits.evaluate import evaluate

    model = _tiny_llama()
    ids = torch.randint(0, VOCAB, (130,), generator=torch.Generator().manual_seed(0))
    kw = {"attn_layers": [], "windows": 2}
    want = evaluate(model, ids, 64, ["int4-token"], **kw)
    got = evaluate(model, ids.numpy().astype(np.int32), 64, ["int4-token"], **kw)
    assert got["fingerprint"] == want["fingerprint"] and got["windows"] == 2
    assert got["results"][0]["kl"] == want["results"][0]["kl"]
    assert got["results"][0]["ppl_ref"] == want["results"][0]["ppl_ref"]


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (np.zeros(130, dtype=np.float32), "integer array, got a NumPy array of float32"),
        (torch.zeros(130), "integer tensor, got torch.float32"),
        (list(range(130)), "data must be a text spec .* got list"),
    ],
)
def test_data_of_the_wrong_kind_is_refused_before_the_model_loads(monkeypatch, data, match):
    """Float ids, and data that is no text spec nor ids, were refused only after the model had loaded (minutes for a
    large one); now before."""
    from kvbits.evaluate import evaluate, runner

    def load(*args, **kwargs):
        raise AssertionError("the model was loaded before the data was checked")

    monkeypatch.setattr(runner, "_load_checked_model", load)
    with pytest.raises(TypeError, match=match):
        evaluate(_tiny_llama(), data, 64, ["int4-token"], attn_layers=[])


def test_a_path_like_text_is_read_as_its_path(tmp_path, monkeypatch):
    """A ``pathlib.Path`` text was refused after the model loaded ("text spec must be a non-empty str"); it is
    read as the path it names, as ``kvbits needle`` reads one, and so a missing file is said before the model
    loads."""
    from kvbits.evaluate import evaluate, runner

    def load(*args, **kwargs):
        raise AssertionError("the model was loaded before the text was read")

    monkeypatch.setattr(runner, "_load_checked_model", load)
    with pytest.raises(ValueError, match="does not exist"):
        evaluate(_tiny_llama(), tmp_path / "missing.txt", 64, ["int4-token"], attn_layers=[])


@pytest.mark.parametrize("suffix", [".pt", ".npy", ".safetensors"])
def test_a_token_ids_file_given_as_text_is_named_a_tensor_file(tmp_path, suffix):
    """``--data ids.pt`` (token ids saved by ``torch.save``) was refused as "a zip archive: extract the text file",
    a ``.safetensors`` one as "UTF-16 or UTF-32 saved without a byte-order mark", a ``.npy`` one with no hint: now
    each is named a tensor file, with where token ids go."""
    from safetensors.torch import save_file

    from kvbits.evaluate.data import load_text

    ids = torch.arange(100)
    path = tmp_path / f"ids{suffix}"
    if suffix == ".pt":
        torch.save(ids, path)
    elif suffix == ".npy":
        np.save(path, ids.numpy())
    else:
        save_file({"ids": ids}, str(path))
    with pytest.raises(ValueError, match=r"not text but a tensor file .*token ids from Python") as err:
        load_text(str(path))
    assert "extract the text file" not in str(err.value) and "UTF-16" not in str(err.value)
