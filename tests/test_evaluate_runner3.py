"""Evaluation runner, review 3: which stored runs ``evaluate(out_dir=...)`` reuses (``kvbits.evaluate.request``)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 64


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)  # fmt: skip
    return LlamaForCausalLM(cfg).eval()


def test_a_loaded_model_in_another_dtype_does_not_reuse_the_stored_run(tmp_path, monkeypatch):
    """A ``LoadedModel``'s fingerprint identifies its weight files, not the dtype it runs in: the run of the same
    folder loaded in bfloat16 was served the stored float32 run (reference PPL 64.30208 where its own is 64.30393),
    and ``evaluate(loaded, dtype=...)`` casts the object in place, so a later call without ``dtype`` hit the same.
    The dtype an object runs in is now part of the request: the folder is refused, naming ``dtype``."""
    from kvbits.evaluate import evaluate, runner
    from kvbits.evaluate.models import load_model
    from kvbits.evaluate.outputs import OtherRunError

    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(runner, "_write_report", lambda out: None)
    folder = tmp_path / "model"
    _tiny_llama().save_pretrained(folder)
    ids = torch.randint(0, VOCAB, (200,), generator=torch.Generator().manual_seed(0))
    kw = {"attn_layers": [], "out_dir": tmp_path / "run"}
    first = evaluate(load_model(str(folder)), ids, 64, ["int4-token"], **kw)
    skipped: list = []
    assert evaluate(load_model(str(folder)), ids, 64, ["int4-token"], on_skip=skipped.append, **kw) == first
    assert skipped  # the same model in the same dtype: reused
    bf16 = load_model(str(folder), dtype=torch.bfloat16)
    with pytest.raises(OtherRunError, match="differs in dtype") as err:
        evaluate(bf16, ids, 64, ["int4-token"], **kw)
    assert err.value.differs == ["dtype"]
    cast = load_model(str(folder))
    evaluate(cast, ids, 64, ["int4-token"], attn_layers=[], dtype="bfloat16")  # casts it in place
    with pytest.raises(OtherRunError, match="differs in dtype"):
        evaluate(cast, ids, 64, ["int4-token"], **kw)


def test_the_request_of_a_model_object_records_its_dtype_and_a_non_cpu_device():
    """Given as an object, a model runs in its own dtype and on its own device when neither is asked for: the
    request says which (a CPU model as None, as a spec loads there); what was asked for stays as asked."""
    from kvbits.evaluate.request import _object_runs_in

    model = _tiny_llama()
    assert _object_runs_in(model, None, None) == ("float32", None)
    assert _object_runs_in(model.to(torch.bfloat16), None, None) == ("bfloat16", None)
    assert _object_runs_in(model, "float16", "cpu") == ("float16", "cpu")
    assert _object_runs_in(object(), None, None) == (None, None)
    meta = _tiny_llama().to("meta")
    assert _object_runs_in(meta, None, None) == ("float32", "meta")
