"""Scheme strings, review: mixed-scheme layer overrides checked before any compute, and one name per scheme."""

from __future__ import annotations

import pytest
import torch
from _tinyllama import tiny_llama

from kvbits.schemes import get_scheme

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("mode", ["simulate", "stream"])
def test_a_mixed_override_beyond_the_model_is_refused_before_any_forward(mode):
    """``evaluate(..., ["int4-token", "int4-token,5=fp16"])`` on a 2-layer model ran the reference's forward pass
    (and the first scheme) before the simulator or the cache refused layer 5: minutes on a real model at a long
    context. ``check_schemes_fit`` (eval, speed, needle) now refuses it once the config is read, no forward run."""
    from kvbits.evaluate import evaluate

    model = tiny_llama()
    forwards = []
    model.register_forward_hook(lambda *a: forwards.append(1))
    ids = torch.randint(0, 200, (100,), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"overrides layers \[5\], beyond the model's 2 layers"):
        evaluate(model, ids, 32, ["int4-token", "int4-token,5=fp16"], attn_layers=[], mode=mode)
    assert forwards == []


def test_an_override_naming_the_base_is_no_override():
    """``"int4-token,0=int4-token"`` stores what ``"int4-token"`` stores but was a mixed scheme of another name (and
    ``"int4-token,0-1=fp16,2=int4-token"`` another name than ``"int4-token,0-1=fp16"``): results are told apart by
    name, so one scheme gave two rows and ``check_unique_names`` could not see the repeat. Such overrides are now
    dropped: one name per scheme, and the name parses back to the same scheme."""
    assert get_scheme("int4-token,0=int4-token") is get_scheme("int4-token")
    assert get_scheme(" int4-token , 0-3 = int4-token ").name == "int4-token"
    mixed = get_scheme("int4-token,0-1=fp16,2=int4-token")
    assert mixed.name == "int4-token,0-1=fp16"
    assert mixed == get_scheme("int4-token,0-1=fp16")
    assert get_scheme(mixed.name) == mixed
    with pytest.raises(ValueError, match=r"mixed scheme 'bogus,0=bogus': unknown scheme 'bogus'"):
        get_scheme("bogus,0=bogus")


def test_a_scheme_file_named_as_its_flat_preset_with_a_redundant_override_is_accepted(tmp_path):
    """A scheme JSON named ``"int4-token,0=int4-token"`` storing exactly that (layer 0 as the base) now resolves by
    that name to ``int4-token``; the preset-name check compares storage, so it is not refused as differing."""
    import json

    base = get_scheme("int4-token")
    d = base.replace(name="int4-token,0=int4-token").to_dict()
    d["layers"] = {"0": base.to_dict()}
    path = tmp_path / "s.json"
    path.write_text(json.dumps(d))
    assert get_scheme(str(path)).name == "int4-token,0=int4-token"
    d["layers"] = {"0": get_scheme("fp16").to_dict()}  # layer 0 in fp16 under that name: still refused
    path.write_text(json.dumps(d))
    with pytest.raises(ValueError, match="differs from it"):
        get_scheme(str(path))
