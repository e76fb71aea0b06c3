"""``artifact_from_samples`` refuses malformed samples and gradients up front, with a ``TypeError`` /
``ValueError`` that names the argument and layer and says what was expected, instead of an
``IndexError`` / unpacking error from deep inside the fit, or a silent NaN fit. Model-free."""

from __future__ import annotations

import dataclasses
import json
import logging
import re

import pytest
import torch

from kvbits.calibrate import artifact_from_samples
from kvbits.calibrate.artifact import load_calibration
from kvbits.schemes import KVScheme, TensorSpec, get_scheme

H, N, D = 2, 64, 16


def samples(layers: int = 2, shape: tuple[int, ...] = (H, N, D), seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=gen) for _ in range(layers)]


def with_layer(ts: list[torch.Tensor], i: int, t: torch.Tensor) -> list[torch.Tensor]:
    out = list(ts)
    out[i] = t
    return out


def non_finite(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    t.view(-1)[0] = float("nan")
    t.view(-1)[1] = float("inf")
    t.view(-1)[2] = float("-inf")
    return t


def test_well_formed_samples_still_fit():
    k, v = samples(), samples(seed=1)
    art = artifact_from_samples("kvquant-4", k, v, key_grads=samples(seed=2), value_grads=samples(seed=3))
    assert art.num_kv_heads == H and art.head_dim == D and art.num_layers == 2
    # (B, H_kv, T, D) blocks, mixed with (H_kv, N, D) ones, and float64 / bfloat16 samples are taken
    blocks = [k[0].reshape(H, 2, N // 2, D).transpose(0, 1), k[1].double()]
    assert artifact_from_samples("kvquant-4", blocks, [v[0].bfloat16(), v[1]]).num_layers == 2


def test_calibrated_context_is_the_window_length_of_4d_blocks():
    """8 windows of 16 tokens as (B, H_kv, T, D) blocks: calibrated up to 16 tokens, not 8 * 16 = 128 (serving 100
    tokens is beyond calibration); layers of different windows: the shortest. (H_kv, N, D) samples do not say their
    window: N."""
    blocks = samples(shape=(8, H, 16, D))
    art = artifact_from_samples("fp8-e4m3", blocks, samples(shape=(8, H, 16, D), seed=1))
    assert art.max_calibrated_length == 16 and art.meta["data"]["tokens"] == 128
    shorter = with_layer(blocks, 1, torch.randn(16, H, 8, D))
    assert artifact_from_samples("fp8-e4m3", shorter, shorter).max_calibrated_length == 8
    assert artifact_from_samples("fp8-e4m3", samples(), samples(seed=1)).max_calibrated_length == N


def test_3d_samples_without_a_context_say_the_length_is_a_guess(caplog):
    """(H_kv, N, D) samples record N as the calibrated context (4 windows of 128 tokens: 512, so the length warning
    stayed silent up to 512 tokens although nothing past position 127 was seen): now said in a WARNING, which
    a given ``meta['data']['context']`` or (B, H_kv, T, D) blocks silence."""
    with caplog.at_level(logging.WARNING, logger="kvbits.calibrate"):
        artifact_from_samples("fp8-e4m3", samples(), samples(seed=1))
        assert len(caplog.records) == 1 and "recorded as the sample count N = 64" in caplog.records[0].getMessage()
        caplog.clear()
        given = artifact_from_samples("fp8-e4m3", samples(), samples(seed=1), meta={"data": {"context": 32}})
        artifact_from_samples("fp8-e4m3", samples(shape=(8, H, 16, D)), samples(shape=(8, H, 16, D), seed=1))
    assert caplog.records == [] and given.max_calibrated_length == 32


def test_the_recorded_sample_count_and_context_are_those_of_the_fitted_sides(tmp_path):
    """``data.tokens`` / ``data.context`` came from ``keys[0]``: a layer the scheme does not calibrate, whose samples
    are not read and may be empty, wrote ``tokens: 0`` / ``context: 0``, a calibration that saved but did not load
    ("data.context must be a positive integer, got 0"). Now from the first fitted side with samples; with no
    samples at all (static FP8 sides fitted from their ``*_absmax``) the context must be given."""
    k, empty = samples(), torch.randn(H, 0, D)
    art = artifact_from_samples("kvquant-4,0=fp16", with_layer(k, 0, empty), with_layer(k, 0, empty))
    assert art.meta["data"]["tokens"] == N and art.max_calibrated_length == N
    blocks = with_layer(samples(shape=(4, H, 16, D)), 0, torch.randn(1, H, 3, D))  # layer 0's window: not read
    art = artifact_from_samples("kvquant-4,0=fp16", blocks, blocks)
    assert art.meta["data"]["tokens"] == 64 and art.max_calibrated_length == 16
    assert load_calibration(art.save(tmp_path / "a")).max_calibrated_length == 16
    nothing = [empty, empty]
    with pytest.raises(ValueError, match=r"no samples say how long the calibration windows were.*'context'"):
        artifact_from_samples("fp8-e4m3", nothing, nothing, key_absmax=[1.0, 2.0], value_absmax=[1.0, 2.0])
    art = artifact_from_samples(
        "fp8-e4m3", nothing, nothing, key_absmax=[1.0, 2.0], value_absmax=[1.0, 2.0], meta={"data": {"context": 9}}
    )
    assert art.meta["data"]["tokens"] is None
    assert load_calibration(art.save(tmp_path / "b")).max_calibrated_length == 9


def test_meta_model_and_data_fields_replace_the_defaults_one_by_one(tmp_path):
    """``meta={"data": {"name": ...}}`` replaced the whole ``data`` record, dropping ``context``: the artifact's
    ``max_calibrated_length`` raised ``KeyError: 'context'`` (so did ``save``); ``meta={"model": {"name": ...}}``
    dropped the model's shape (``KeyError: 'num_layers'``). Given fields now override the defaults one by one."""
    blocks = samples(shape=(4, H, 16, D))
    art = artifact_from_samples("kvquant-4", blocks, blocks, meta={"data": {"name": "wiki"}, "model": {"name": "m"}})
    assert art.meta["data"] == {"name": "wiki", "tokens": 64, "context": 16}
    assert art.meta["model"]["name"] == "m" and art.num_kv_heads == H and art.head_dim == D
    loaded = load_calibration(art.save(tmp_path))
    assert loaded.max_calibrated_length == 16 and loaded.num_layers == 2


def test_a_single_tensor_is_not_a_list_of_layers():
    k = samples()
    with pytest.raises(TypeError, match=r"keys must be a list with one \(H_kv, N, D\) .*got a tensor of shape \(2, 2, 64, 16\)"):
        artifact_from_samples("kvquant-4", torch.stack(k), k)
    with pytest.raises(TypeError, match=r"value_grads must be a list .*got a tensor"):
        artifact_from_samples("kvquant-4", k, k, value_grads=k[0])


@pytest.mark.parametrize("shape", [(N, D), (1, 1, H, N, D)], ids=["2-dims", "5-dims"])
def test_wrong_number_of_dims_names_the_layer(shape):
    k = samples()
    bad = with_layer(k, 1, torch.randn(*shape))
    with pytest.raises(ValueError, match=rf"keys\[1\] \(layer 1\) must be \(H_kv, N, D\) or \(B, H_kv, T, D\), got {len(shape)} dims"):
        artifact_from_samples("kvquant-4", bad, k)
    with pytest.raises(ValueError, match=r"values\[1\] \(layer 1\) must be"):
        artifact_from_samples("kvquant-4", k, bad)


def test_head_count_or_head_dim_differing_between_layers_or_sides():
    k = samples()
    with pytest.raises(ValueError, match=r"keys\[1\] \(layer 1\) has 3 KV heads of dim 16 .*keys\[0\] has 2 of dim 16"):
        artifact_from_samples("kvquant-4", with_layer(k, 1, torch.randn(3, N, D)), k)
    with pytest.raises(ValueError, match=r"values\[0\] \(layer 0\) has 2 KV heads of dim 8 .*keys\[0\] has 2 of dim 16"):
        artifact_from_samples("kvquant-4", k, with_layer(k, 0, torch.randn(H, N, 8)))
    # a block (B, H_kv, T, D) with another head count
    with pytest.raises(ValueError, match=r"values\[1\] \(layer 1\) has 4 KV heads"):
        artifact_from_samples("kvquant-4", k, with_layer(k, 1, torch.randn(1, 4, N, D)))
    with pytest.raises(ValueError, match=r"keys\[0\] \(layer 0\) has shape \(0, 64, 16\): no KV heads or no channels"):
        artifact_from_samples("kvquant-4", samples(shape=(0, N, D)), samples(shape=(0, N, D)))


def test_shape_against_the_model_record_and_the_scheme():
    k = samples()
    model = {"num_layers": 2, "num_kv_heads": H, "head_dim": D}
    assert artifact_from_samples("kvquant-4", k, k, meta={"model": model}).num_kv_heads == H
    with pytest.raises(ValueError, match=r"do not match meta\['model'\] \(num_kv_heads 4 vs 2 \[meta vs samples\]\)"):
        artifact_from_samples("kvquant-4", k, k, meta={"model": {**model, "num_kv_heads": 4}})
    # an FP8 per-tensor scale has no per-head shape, so nothing later would notice
    with pytest.raises(ValueError, match=r"do not match meta\['model'\] \(num_kv_heads 8 vs 2"):
        artifact_from_samples("fp8-e4m3", k, k, meta={"model": {**model, "num_kv_heads": 8}})
    with pytest.raises(ValueError, match=r"head_dim 128 vs 16; num_layers 3 vs 2|num_layers 3 vs 2; head_dim 128 vs 16"):
        artifact_from_samples("kvquant-4", k, k, meta={"model": {**model, "head_dim": 128, "num_layers": 3}})
    # a Hadamard-rotated side needs a power-of-two head dim
    k12 = samples(shape=(H, N, 12))
    with pytest.raises(ValueError, match=r"scheme 'fp8-e4m3-hadamard' can not store head_dim 12: .*power-of-two"):
        artifact_from_samples("fp8-e4m3-hadamard", k12, k12)
    # RoPE pairs need an even head dim
    k15 = samples(shape=(H, N, 15))
    with pytest.raises(ValueError, match=r"tie_rope_pairs .*even head dim, got 15"):
        artifact_from_samples("int4-token-smooth-prerope", k15, k15, tie_rope_pairs=True)


def test_gradients_must_match_their_samples():
    k, v = samples(), samples(seed=1)
    with pytest.raises(ValueError, match=r"key_grads\[1\] \(layer 1\) has shape \(2, 63, 16\), but its samples keys\[1\] have \(2, 64, 16\)"):
        artifact_from_samples("kvquant-4", k, v, key_grads=with_layer(k, 1, torch.randn(H, N - 1, D)))
    with pytest.raises(ValueError, match=r"value_grads\[0\] \(layer 0\) has shape \(64, 2, 16\)"):
        artifact_from_samples("kvquant-4", k, v, value_grads=with_layer(v, 0, v[0].transpose(0, 1)))
    with pytest.raises(ValueError, match=r"key_grads needs one gradient tensor per layer \(2\), got 1"):
        artifact_from_samples("kvquant-4", k, v, key_grads=k[:1])
    with pytest.raises(TypeError, match=r"value_grads\[1\] \(layer 1\) must be a torch.Tensor, got NoneType"):
        artifact_from_samples("kvquant-4", k, v, value_grads=[v[0], None])
    with pytest.raises(TypeError, match=r"key_grads\[0\] \(layer 0\) must be a floating tensor, got torch.int64"):
        artifact_from_samples("kvquant-4", k, v, key_grads=[torch.ones(H, N, D, dtype=torch.long), k[1]])


@pytest.mark.parametrize("bad", [0, -5, True, 2.5])
def test_kmeans_and_token_counts_below_one_are_refused_up_front(bad, tmp_path):
    """``kmeans_points`` / ``kmeans_iterations`` / ``max_tokens`` that are not ints >= 1: a ValueError naming the
    argument before any fitting (0 points failed with an IndexError inside k-means, -5 dropped points silently and
    was recorded) and, through ``calibrate`` / ``collect_samples``, before the model is even loaded (this one
    does not exist)."""
    from kvbits.calibrate import calibrate, collect_samples, weighted_kmeans_1d

    k = samples()
    with pytest.raises(ValueError, match=rf"kmeans_points must be an int >= 1 .*got {re.escape(repr(bad))}"):
        artifact_from_samples("kvquant-4", k, k, kmeans_points=bad)
    with pytest.raises(ValueError, match=rf"kmeans_iterations must be an int >= 1 .*got {re.escape(repr(bad))}"):
        artifact_from_samples("kvquant-4", k, k, kmeans_iterations=bad)
    with pytest.raises(ValueError, match="max_points must be an int >= 1"):
        weighted_kmeans_1d(torch.randn(100), 4, max_points=bad)
    missing = str(tmp_path / "no-such-model")
    for kw, name in (({"kmeans_points": bad}, "kmeans_points"), ({"kmeans_iterations": bad}, "kmeans_iterations"),
                     ({"max_tokens": bad}, "max_tokens")):  # fmt: skip
        with pytest.raises(ValueError, match=f"{name} must be an int >= 1"):
            calibrate(missing, "pride-and-prejudice", "kvquant-4", context=64, windows=1, **kw)
    with pytest.raises(ValueError, match="max_tokens must be an int >= 1"):
        collect_samples(missing, "pride-and-prejudice", context=64, windows=1, max_tokens=bad)


@pytest.mark.parametrize("bad", [101.0, 10.0, float("inf"), float("nan"), True, "99"])
def test_a_percentile_outside_50_to_100_is_refused_before_the_model_loads(bad, tmp_path):
    """``calibrate(percentile=...)``: checked with the other arguments, before the model is loaded (this one does
    not exist). Before, the fit refused it only after every forward (and Fisher backward) pass had run."""
    from kvbits.calibrate import calibrate

    with pytest.raises(ValueError, match=r"percentile must be a number in \[50, 100\]"):
        calibrate(str(tmp_path / "no-such-model"), "pride-and-prejudice", "kvquant-4", context=64, windows=1,
                  percentile=bad)  # fmt: skip


@pytest.mark.parametrize("bad", [-1, 2**32, 2**64 - 1, True, 1.0])
def test_a_seed_outside_the_cli_bound_is_refused_before_the_model_loads(bad, tmp_path):
    """``calibrate(seed=...)`` from Python: the bound of the CLI's ``--seed`` (``[0, 2**32 - 1]``), checked before the
    model is loaded (this one does not exist). Before, any seed passed: ``2**64 - 1`` failed in ``torch.manual_seed``
    (the layers' k-means seeds ``seed + i``) only after every pass had run."""
    from kvbits.calibrate import calibrate, collect_samples

    missing = str(tmp_path / "no-such-model")
    with pytest.raises(ValueError, match=r"seed must be an int in \[0, 4294967295\]"):
        calibrate(missing, "pride-and-prejudice", "kvquant-4", context=64, windows=1, seed=bad)
    with pytest.raises(ValueError, match=r"seed must be an int in \[0, 4294967295\]"):
        collect_samples(missing, "pride-and-prejudice", context=64, windows=1, seed=bad)
    k = samples()
    with pytest.raises(ValueError, match=r"seed must be an int in \[0, 4294967295\]"):
        artifact_from_samples("kvquant-4", k, k, seed=bad)


def test_samples_without_tokens_are_refused():
    k = samples()
    empty = torch.randn(H, 0, D)
    with pytest.raises(ValueError, match=r"keys\[1\] \(layer 1\) has no tokens \(shape \(2, 0, 16\)\); .*at least one sample"):
        artifact_from_samples("kvquant-4", with_layer(k, 1, empty), k)
    with pytest.raises(ValueError, match=r"values\[0\] \(layer 0\) has no tokens"):
        artifact_from_samples("fp8-e4m3", k, with_layer(k, 0, torch.randn(0, H, 5, D)))
    # a static FP8 side given its largest |x| is fitted from that alone
    art = artifact_from_samples("fp8-e4m3", with_layer(k, 1, empty), k, key_absmax=[4.0, 8.0])
    assert float(art.tensors["layers.1.key_scale"]) * 448 == pytest.approx(8.0)
    # a layer the scheme does not calibrate (fp16 there) is not read
    art = artifact_from_samples("kvquant-4,1=fp16", with_layer(k, 1, empty), with_layer(k, 1, empty))
    assert "layers.1.key_scale" not in art.tensors


def test_non_floating_samples_are_refused():
    k = samples()
    with pytest.raises(TypeError, match=r"values\[1\] \(layer 1\) must be a floating tensor, got torch.int32"):
        artifact_from_samples("kvquant-4", k, with_layer(k, 1, k[1].to(torch.int32)))
    with pytest.raises(TypeError, match=r"keys\[0\] \(layer 0\) must be a torch.Tensor, got list"):
        artifact_from_samples("kvquant-4", [k[0].tolist(), k[1]], k)


@pytest.mark.parametrize("scheme", ["kvquant-4", "fp8-e4m3", "int4-token-smooth"])
def test_non_finite_samples_and_gradients_are_refused(scheme):
    k, v = samples(), samples(seed=1)
    msg = r"contains non-finite values \(1 NaN, 2 inf\); refusing to calibrate from it"
    with pytest.raises(ValueError, match=r"keys\[1\] \(layer 1\) " + msg):
        artifact_from_samples(scheme, with_layer(k, 1, non_finite(k[1])), v)
    if get_scheme(scheme).value.calibratable:  # int4-token-smooth: dynamic values, not read
        with pytest.raises(ValueError, match=r"values\[0\] \(layer 0\) " + msg):
            artifact_from_samples(scheme, k, with_layer(v, 0, non_finite(v[0])))
    if get_scheme(scheme).key.kind == "nuq":  # Fisher weights: the gradients are read
        with pytest.raises(ValueError, match=r"key_grads\[1\] \(layer 1\) " + msg):
            artifact_from_samples(scheme, k, v, key_grads=with_layer(k, 1, non_finite(k[1])))


def test_non_finite_samples_of_a_side_not_calibrated_are_not_read():
    """A float value side fits nothing: its samples are shape-checked only."""
    nuq = TensorSpec(kind="nuq", bits=4, fmt=None, granularity="channel", static=True, pre_rope=True)
    scheme = KVScheme("k-only", key=nuq)
    k = samples()
    art = artifact_from_samples(scheme, k, [non_finite(t) for t in k])
    assert re.fullmatch(r"layers\.\d\.key_(scale|zero|codebook)", next(iter(art.tensors)))


@pytest.mark.parametrize(
    ("scheme", "said", "unsaid"),
    [("kvquant-4", ["clip rate:", "gain: weighted MSE"], ["absmax:"]), ("fp8-e4m3", ["clip rate:", "absmax:"], ["gain:"])],
)
def test_the_summary_caption_explains_the_columns_it_has(scheme, said, unsaid, capsys):
    """`kvbits calibrate`'s table caption explained an absmax column a kvquant table does not have."""
    from kvbits.calibrate.cli import _summary
    from kvbits.calibrate.fit import artifact_from_samples

    g = torch.Generator().manual_seed(0)
    k = [torch.randn(2, 64, 16, generator=g) for _ in range(2)]
    art = artifact_from_samples(scheme, k, k)
    art.meta["data"]["windows"] = 1
    _summary(art)
    out = capsys.readouterr().out
    caption = out[out.index("per-layer calibration") :].split("\n\n")[0]
    assert all(s in caption for s in said) and not any(s in caption for s in unsaid), caption


def test_the_fp8_summary_caption_states_the_scale_calibrate_chose(capsys):
    """With --fp8-scale centred (the default) the caption said "FP8 scale = absmax / fp8 max" and explained the mse
    gain column as "a uniform codebook over the fitted one": on smollm2-135m layer 0's exported k_scale was 0.0358,
    absmax / 448 = 0.0232 (step 20: x 2^(20/32)). It now gives the stepped formula, which the scales obey."""
    import re

    from kvbits.calibrate.cli import _summary
    from kvbits.calibrate.fit import FP8_PHASES, artifact_from_samples

    g = torch.Generator().manual_seed(0)
    k = [torch.randn(2, 64, 16, generator=g) for _ in range(2)]
    art = artifact_from_samples("fp8-e4m3", k, k, fp8_scale="centred", meta={"data": {"context": 64}})
    art.meta["data"]["windows"] = 1
    _summary(art)
    out = capsys.readouterr().out
    caption = " ".join(out[out.index("per-layer calibration") :].split("\n\n")[0].split())
    assert f"absmax / fp8 max x 2^(step / {FP8_PHASES})" in caption and "codebook" not in caption, caption
    assert "mse gain:" in caption and "step:" in caption, caption
    row = art.layer_stats[0]
    scale = float(art.tensors["layers.0.key_scale"])
    assert re.search(r"\bstep\b", caption) and row["key_scale_step"] > 0
    assert scale == pytest.approx(row["key_absmax"] / 448 * 2 ** (row["key_scale_step"] / FP8_PHASES), rel=1e-5)


@pytest.mark.parametrize(
    ("points", "weights", "bits"),
    [(torch.zeros(1000), None, 4), (torch.tensor([-0.5, 0.0, 0.7]), None, 4),
     (torch.linspace(-1, 1, 100), torch.eye(100)[3], 2), (torch.tensor([0.999, 0.9991, 0.9992, -0.2]), None, 3)],
)  # fmt: skip
def test_codebooks_of_degenerate_data_have_distinct_entries(points, weights, bits):
    """All-zero data, 3 distinct points, one weighted point, points float16 merges: k-means left copies of one
    centroid (all zeros: 1 distinct entry of 16; one weighted point: 1 of 4), wasted levels that served data
    then decoded to fewer values. The copies now take unused grid levels; the points' weighted error is no larger."""
    from kvbits.calibrate import fit_codebook, weighted_kmeans_1d
    from kvbits.calibrate.kmeans import weighted_mse

    cb = fit_codebook(points, bits, weights)
    assert cb.dtype == torch.float16 and cb.unique().numel() == 2**bits
    assert bool((cb[1:] > cb[:-1]).all()) and float(cb.abs().max()) <= 1
    raw = weighted_kmeans_1d(points, 2**bits, weights).clamp(-1, 1).half().float()
    assert weighted_mse(points, cb.float(), weights) <= weighted_mse(points, raw, weights) + 1e-12


@pytest.mark.parametrize(("points", "max_gap", "mse"), [(torch.zeros(1000), 0.25, 0.002), (torch.tensor([-0.5, 0.0, 0.7]), 0.1875, 0.002)])
def test_codebook_fill_in_levels_spread_over_the_largest_gaps(points, max_gap, mse):
    """The levels replacing repeated centroids were ranked once by their distance to the kept ones, so they bunched
    at the ends: all-zero data gave [-1, -0.9375, ..., -0.5625, 0, 0.5625, ..., 1], adjacent fill-ins 1/16 apart
    around a 0.5625 hole, and 10x the uniform codebook's error on data served later (0.0179 vs 0.0015). Each
    fill-in now takes the level farthest from every level so far: the largest gap is 0.25, the error 0.0018."""
    from kvbits.calibrate import fit_codebook
    from kvbits.calibrate.kmeans import weighted_mse

    cb = fit_codebook(points, 4).float()
    assert cb.unique().numel() == 16 and float(cb.diff().max()) <= max_gap
    later = torch.linspace(-1, 1, 10_001)  # data the codebook meets when serving
    assert weighted_mse(later, cb) < mse


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda m: m["data"].update(context=0), "data.context must be a positive integer (the calibrated length in tokens), got 0"),
        (lambda m: m["model"].update(name=5), "model.name must be a string or null, got 5"),
        (lambda m: m.update(stats={"a": 1}), "stats must be a list of per-layer JSON objects"),
        (lambda m: m.pop("model"), "the 'model' field is missing"),
    ],
    ids=["context-0", "name-int", "stats-dict", "no-model"],
)
def test_save_refuses_what_load_would_refuse_before_writing(tmp_path, edit, message):
    """``save`` validated the tensors only: an artifact whose JSON ``load_calibration`` refuses (``data.context`` 0, as
    an earlier defect wrote) saved, and failed only at load; a ``meta`` without ``model`` was a ``KeyError``. Now the
    same check and words as the loader, before anything is written."""
    blocks = samples(shape=(4, H, 16, D))
    art = artifact_from_samples("kvquant-4", blocks, blocks)
    edit(art.meta)
    with pytest.raises(ValueError, match=re.escape(message) + ".*load_calibration would refuse it"):
        art.save(tmp_path / "bad")
    assert not (tmp_path / "bad").exists()
    meta = {**art.meta, "format_version": 1, "scheme": art.scheme.to_dict()}
    meta["files"] = {"calibration.safetensors": {"bytes": 0, "sha256": "0" * 64}}
    (tmp_path / "edited").mkdir()
    (tmp_path / "edited" / "calibration.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"calibration\.json is malformed: " + re.escape(message)):  # the same words
        load_calibration(tmp_path / "edited")


def test_save_with_meta_that_is_not_json_leaves_the_artifact_there_whole(tmp_path):
    """``save`` replaced ``calibration.safetensors`` first and then failed writing the JSON (``TypeError: Object of
    type device is not JSON serializable``): the artifact already in the folder no longer loaded (its sha256 no
    longer matched). Now a ``ValueError`` before anything is replaced."""
    blocks = samples(shape=(4, H, 16, D))
    good = artifact_from_samples("kvquant-4", blocks, blocks).save(tmp_path)
    other = artifact_from_samples("kvquant-4", [b * 2 for b in blocks], blocks)
    other.meta["device"] = torch.device("cpu")
    with pytest.raises(ValueError, match="meta is not JSON: Object of type device is not JSON serializable"):
        other.save(tmp_path)
    assert load_calibration(good).max_calibrated_length == 16


def test_a_percentile_that_is_in_effect_the_max_is_logged(caplog):
    """99.9 over 100 samples per channel: ``channel_percentiles`` interpolates at 0.999 * 99 = 98.9, 90 % of the way
    from the second largest sample to the largest, so the "percentile range" kept the outliers it exists to trim, and
    nothing said so. Now a WARNING below ``1 + 50 / (100 - p)`` samples (501 for 99.9, 51 for 99); not for 100 (the
    max, as asked) nor for sides the percentile does not fit (FP8 scales)."""
    blocks = samples(shape=(5, H, 20, D))  # 100 samples per channel, windows of 20
    with caplog.at_level(logging.WARNING, logger="kvbits.calibrate"):
        artifact_from_samples("kvquant-4", blocks, blocks)
        said = [r.getMessage() for r in caplog.records]
        assert len(said) == 1 and "percentile 99.9 over 100 samples per channel is in effect the max" in said[0]
        assert "that takes 501 samples per channel" in said[0]
        caplog.clear()
        artifact_from_samples("kvquant-4", blocks, blocks, percentile=100.0)
        artifact_from_samples("kvquant-4", blocks, blocks, percentile=99.0)  # 51 samples are enough for 99
        artifact_from_samples("fp8-e4m3", blocks, blocks)
        assert caplog.records == []
        short = samples(shape=(2, H, 20, D))  # 40 samples per channel: under 51
        artifact_from_samples("kvquant-4", short, short, percentile=99.0)
    assert len(caplog.records) == 1 and "percentile 99 over 40 samples" in caplog.records[0].getMessage()


def test_the_percentile_warning_reads_each_entrys_own_layer_scheme(caplog):
    """With ``layers`` (a hybrid model's attention layers), entry ``i`` is model layer ``layers[i]``, but the warning
    looked up ``scheme.for_layer(i)``: samples [layer 1: FP8, layer 3: kvquant-4 with 50 tokens] said nothing,
    though layer 3's 99.9 percentile over 50 samples is the max. Now the entry's own layer's scheme is read."""
    base = get_scheme("fp8-e4m3")
    scheme = dataclasses.replace(base, layers=((3, dataclasses.replace(get_scheme("kvquant-4"), layers=())),))
    blocks = samples(shape=(1, H, 50, D))
    with caplog.at_level(logging.WARNING, logger="kvbits.calibrate"):
        artifact_from_samples(scheme, blocks, blocks, layers=[1, 3], kmeans_points=2000)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "percentile 99.9 over 50 samples per channel is in effect the max" in said[0]


def test_a_calibration_from_a_newer_kvbits_says_to_upgrade(tmp_path):
    """A ``format_version`` above this kvbits' said only "re-run kvbits calibrate with this version", as for an older
    file; a file from a newer kvbits is read by upgrading. Both say which kvbits reads what."""
    import kvbits
    from kvbits.calibrate.artifact import ARTIFACT_FORMAT_VERSION

    blocks = samples(shape=(4, H, 16, D))
    out = artifact_from_samples("kvquant-4", blocks, blocks).save(tmp_path)
    meta = json.loads((out / "calibration.json").read_text())
    for version, upgrade in ((ARTIFACT_FORMAT_VERSION + 1, True), (0, False)):
        (out / "calibration.json").write_text(json.dumps({**meta, "format_version": version}))
        with pytest.raises(ValueError, match=re.escape(f"this kvbits reads format_version 1 or {ARTIFACT_FORMAT_VERSION} (written by kvbits {kvbits.__version__}, read by kvbits {kvbits.__version__})")) as e:
            load_calibration(out)
        assert ("upgrade kvbits to read it, or re-run" in str(e.value)) is upgrade, str(e.value)


def test_a_format_1_calibration_still_loads_as_every_layer(tmp_path):
    """Format 2 records ``model.kv_layers`` (a hybrid model's attention layers); a format 1 file, which has none,
    holds every layer and still loads; a ``kv_layers`` that is not ascending layer indices is refused."""
    blocks = samples(shape=(4, H, 16, D))
    out = artifact_from_samples("kvquant-4", blocks, blocks).save(tmp_path)
    meta = json.loads((out / "calibration.json").read_text())
    assert meta["format_version"] == 2 and meta["model"]["kv_layers"] == [0, 1]
    del meta["model"]["kv_layers"], meta["meta_sha256"]  # a format 1 file records neither
    (out / "calibration.json").write_text(json.dumps({**meta, "format_version": 1}))
    assert load_calibration(out).kv_layers == [0, 1]
    meta["model"]["kv_layers"] = [1, 0]
    (out / "calibration.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=re.escape("model.kv_layers must be ascending distinct layer indices in [0, 2)")):
        load_calibration(out)


@pytest.mark.parametrize(
    ("scheme", "name", "value", "decoded"),
    [("fp8-e4m3", "layers.0.key_scale", torch.tensor(150.0), "65504 as 67200"),  # 448 * 150: inf in float16
     ("kvquant-4", "layers.1.key_scale", torch.full((H, D), 65504.0).half(), None)],  # zero + scale past 65504
)  # fmt: skip
def test_static_scales_decoding_past_float16_are_refused_in_the_artifact(tmp_path, scheme, name, value, decoded):
    """An artifact edited (or written by another tool) with a static scale whose levels decode the largest K/V past
    float16 was validated, saved and loaded: its keys then decoded to inf at serving. ``validate`` (so ``save`` and
    ``load_calibration``) refuses it, naming the tensor."""
    art = artifact_from_samples(scheme, samples(), samples(seed=1))
    art.tensors[name] = value
    if decoded is None:  # asymmetric NUQ keys: 65504 codes onto the entry 1, which decodes zero + scale = 66504
        art.tensors[name.replace("scale", "zero")] = torch.full((H, D), 1000.0).half()
        art.tensors[name.replace("scale", "codebook")] = torch.linspace(-1, 1, 16).half()
    match = f"calibration \\(in memory\\): {name}: .*decode past float16" + ("" if decoded is None else f".*{decoded}")
    with pytest.raises(ValueError, match=match):
        art.validate()
    with pytest.raises(ValueError, match=match):
        art.save(tmp_path / "a")
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("kind", ["int", "nuq"])
def test_static_ranges_past_float16_are_refused_at_the_fit_naming_layer_and_side(kind):
    """Keys of layer 1 around 4e4 * randn: a static asymmetric range's minimum below -65504 made a float16
    zero-point of -inf and the artifact was refused as "layers.1.key_scale holds non-finite values" (int), or
    with "a group spans inf" and no layer (NUQ). Now the fit names the layer, side, channel and range."""
    key = TensorSpec(kind=kind, bits=4, granularity="channel", static=True, pre_rope=True)
    scheme = KVScheme(name=f"{kind}4-static", key=key, value=TensorSpec(kind="int", bits=4, group_size=16))
    keys = with_layer(samples(), 1, 4e4 * samples(seed=2)[1])
    with pytest.raises(ValueError, match=rf"layer 1 key: static {kind} scales and zero-points are float16, and \d+ "
                                         r"channel range\(s\) overflow them \(head \d channel \d+: \[-\d+"):  # fmt: skip
        artifact_from_samples(scheme, keys, samples(seed=1), meta={"data": {"context": N}})
    artifact_from_samples(scheme, samples(), samples(seed=1), meta={"data": {"context": N}})  # in range: fitted
