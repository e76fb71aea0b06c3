"""`kvbits analyze`: outlier channels per layer, range consumed, int4 SQNR, recommendation, CLI.

The main fixture is a tiny random Llama with one injected outlier channel (a row of one layer's
``k_proj.weight`` scaled by 30), so the right answer is known.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import re
import time
from pathlib import Path

import pytest
import torch
from _realmodel import unavailable

transformers = pytest.importorskip("transformers")

from _wordlevel import WORDS, save_word_tokenizer, write_word_text

from kvbits._json import dumps
from kvbits.analyze import (
    BlockReservoir,
    ChannelStats,
    analyze,
    int_sqnr,
    kv_hooks,
    outlier_channels,
    range_used_per_token,
    recommend,
)
from kvbits.analyze.outliers import smeared_pairs
from kvbits.analyze.sites import attention_sites
from kvbits.analyze.stats import blocks_in
from kvbits.quant.rope import RotaryTables, apply_rope

logging.getLogger("transformers").setLevel(logging.ERROR)

HEAD_DIM = 32
OUT_LAYER, OUT_HEAD, OUT_CH = 1, 1, 3  # a high-frequency RoPE channel: it rotates fast, so it smears


def tiny_llama(outlier: bool = True, seed: int = 0, max_positions: int = 1024):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=HEAD_DIM,
        num_hidden_layers=3,
        intermediate_size=128,
        vocab_size=len(WORDS) + 1,
        max_position_embeddings=max_positions,
    )
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    if outlier:
        with torch.no_grad():
            model.model.layers[OUT_LAYER].self_attn.k_proj.weight[OUT_HEAD * HEAD_DIM + OUT_CH] *= 30
    return model


@pytest.fixture(scope="module")
def result():
    model = tiny_llama()
    windows = torch.randint(0, model.config.vocab_size, (2, 256), generator=torch.Generator().manual_seed(1))
    return analyze(model, windows, sample_tokens=512, model_name="tiny", data_name="random")


# --------------------------------------------------------------------------------- the answer


def test_finds_exactly_the_injected_channel_pre_rope(result):
    got = {la.layer: la.key_pre_rope.outliers for la in result.layers}
    assert got == {0: [], 1: [[OUT_HEAD, OUT_CH]], 2: []}
    assert all(not la.value.outliers for la in result.layers)


def test_post_rope_outlier_smears_into_its_rotation_pair(result):
    la = result.layers[OUT_LAYER]
    partner = OUT_CH + HEAD_DIM // 2
    assert la.key_post_rope.outliers == [[OUT_HEAD, OUT_CH], [OUT_HEAD, partner]]
    row = la.to_dict()
    assert row["key_outliers_smeared_by_rope"] == [{"head": OUT_HEAD, "channel": OUT_CH, "partner": partner}]
    # the partner's magnitude is the outlier's, oscillating with position
    pre_abs, post_abs = la.key_pre_rope.absmax[OUT_HEAD], la.key_post_rope.absmax[OUT_HEAD]
    assert post_abs[partner] > 10 * pre_abs[partner]


def test_per_channel_beats_per_token_and_range_is_consumed(result):
    la = result.layers[OUT_LAYER]
    assert la.key_pre_rope.sqnr_channel > la.key_pre_rope.sqnr_token + 1.0
    used = la.key_pre_rope.range_used_by_head
    assert used[OUT_HEAD] < 0.25 and used[1 - OUT_HEAD] == 1.0  # ~2+ bits lost in the outlier head only
    assert la.key_pre_rope.summary()["range_used_per_channel"] == 1.0
    assert la.key_pre_rope.summary()["bits_lost_per_token"] > 2
    for other in (0, 2):
        assert result.layers[other].key_pre_rope.range_used_per_token == 1.0


def test_recommendation_is_computed_from_the_numbers(result):
    rec = result.recommendation
    assert rec["keys"] == "per-channel, pre-RoPE" and rec["values"] == "per-token"
    assert rec["layers_with_key_outliers_pre_rope"] == [OUT_LAYER]
    assert rec["scheme"] in ("int4-channel-prerope", "int4-channel")
    assert "1/3 layers" in rec["reason"] and "kvbits eval" in rec["next_steps"][-1]
    rows = result.to_dict()["layers"]
    strict = recommend(rows, layer_fraction=0.5)  # 1/3 of layers is not more than half
    assert strict["keys"] == "per-token" and strict["scheme"] == "int4-token" and strict["per_token_scheme"] is None
    clean = [dict(r, key_outlier_channels_pre_rope=[]) for r in rows]
    assert recommend(clean)["keys"] == "per-token"
    # no post-RoPE statistics (OPT, GPT-J's interleaved pairs): pre-RoPE schemes do not run there, so none is named
    no_rope = recommend([dict(r, key_post_rope=None, key_outlier_channels_post_rope=[]) for r in rows])
    assert no_rope["keys"] == "per-channel" and no_rope["scheme"] == "int4-channel"
    assert no_rope["calibrated_scheme"] is None and no_rope["per_token_scheme"] == "int4-token-smooth"
    assert "no pre-RoPE scheme" in no_rope["reason"] and "prerope" not in " ".join(no_rope["next_steps"])
    assert no_rope["reason"].startswith("key outlier channels") and "SQNR per-token" in no_rope["reason"]


def test_calibrated_schemes_follow_the_side_of_rope_that_measured_better(result):
    """Post-RoPE per-channel keys 3 dB better than pre-RoPE: before, the recommendation said "per-channel, post-RoPE"
    and still named the pre-RoPE kvquant-4 and int4-token-smooth-prerope to calibrate and verify; now only the
    post-RoPE int4-token-smooth, and the reason gives the comparison. Pre-RoPE better: unchanged."""
    rows = result.to_dict()["layers"]
    for r in rows:
        r["key_post_rope"] = dict(r["key_post_rope"], sqnr_int4_channel=r["key_pre_rope"]["sqnr_int4_channel"] + 3)
    rec = recommend(rows, model="m", data="d")
    assert rec["keys"] == "per-channel, post-RoPE" and rec["scheme"] == "int4-channel"
    assert rec["calibrated_scheme"] is None and rec["per_token_scheme"] == "int4-token-smooth"
    assert "prerope" not in " ".join(rec["next_steps"]) and "kvquant" not in " ".join(rec["next_steps"])
    assert "so quantize keys after RoPE" in rec["reason"] and "smoothed per channel after RoPE" in rec["reason"]
    for r in rows:
        r["key_post_rope"]["sqnr_int4_channel"] = r["key_pre_rope"]["sqnr_int4_channel"]  # a tie: pre-RoPE
    rec = recommend(rows)
    assert rec["keys"] == "per-channel, pre-RoPE" and rec["scheme"] == "int4-channel-prerope"
    assert rec["calibrated_scheme"] == "kvquant-4" and rec["per_token_scheme"] == "int4-token-smooth-prerope"


def test_recommend_at_other_bits_quotes_the_int4_figures_and_names_registered_schemes(result):
    """``recommend(rows, bits=8)`` quoted the rows' int4 SQNR as "mean int8 key SQNR", and ``bits=3`` (post-RoPE keys
    better) / ``bits=5`` recommended int3-channel / int5-channel, schemes that do not exist."""
    from kvbits.schemes import list_schemes

    rows = result.to_dict()["layers"]
    rec = recommend(rows, bits=8)
    assert rec["scheme"] in {s.name for s in list_schemes()} and rec["scheme"].startswith("int8-")
    assert "mean int4 key SQNR" in rec["reason"] and "mean int4 value SQNR" in rec["reason"]
    assert "int8 key SQNR" not in rec["reason"]
    for bits in (3, 5, True):
        with pytest.raises(ValueError, match=r"bits must be one of \[2, 4, 8\]"):
            recommend(rows, bits=bits)


def test_next_steps_are_commands_that_run_as_printed(result):
    """The eval step lacked --data (required) and --calibration (a kvquant scheme is refused without it)."""
    from kvbits.cli import build_parser

    rows = result.to_dict()["layers"]
    rec = recommend(rows, model="smollm2-135m", data="pride-and-prejudice")
    assert rec["calibrated_scheme"] == "kvquant-4" and rec["per_token_scheme"] == "int4-token-smooth-prerope"
    *calibs, verify = rec["next_steps"]
    outs = []
    for calib, scheme in zip(calibs, ("kvquant-4", "int4-token-smooth-prerope"), strict=True):
        argv = calib.split(": ", 1)[1].split()[1:]
        args = build_parser(only="calibrate").parse_args(argv)
        assert (args.model, args.data, args.scheme) == ("smollm2-135m", "war-and-peace", scheme)  # not the eval's
        outs.append(args.out)
    argv = verify.split(": ", 1)[1].split(" at several")[0].split()[1:]
    args = build_parser(only="eval").parse_args(argv)
    assert args.data == "pride-and-prejudice" and args.scheme == ["int4-channel-prerope", "kvquant-4",
                                                                   "int4-token-smooth-prerope"]  # fmt: skip
    assert args.calibration == outs  # the folders the calibrate steps write
    # eval matches each --calibration to the scheme its folder records, not by position: the step printed
    # "--scheme A --calibration X --scheme B --calibration Y", which reads as a positional pairing; now the schemes
    # come first, and --calibration's help says how they pair
    assert re.search(r"( --scheme \S+){3}( --calibration \S+){2}", verify), verify
    sub = next(a for a in build_parser(only="eval")._actions if isinstance(a, argparse._SubParsersAction))
    assert "not by position" in " ".join(sub.choices["eval"].format_help().split())
    assert "--data TEXT" in recommend(rows)["next_steps"][-1]  # no names known: placeholders, not gaps


def test_next_steps_quote_model_and_data_paths(result):
    """A --model / --data path with spaces was printed bare (``--model /my models/m.gguf``): the shell split it into
    two arguments, so the printed step was not runnable. Now shell-quoted; plain names print exactly as before."""
    import shlex

    from kvbits.cli import build_parser

    rows = result.to_dict()["layers"]
    model, data = "/my models/m.gguf", "/corpora/it's text.txt"
    *calibs, verify = recommend(rows, model=model, data=data, context=512)["next_steps"]
    assert calibs
    for calib in calibs:
        args = build_parser(only="calibrate").parse_args(shlex.split(calib.split(": ", 1)[1])[1:])
        assert (args.model, args.data, args.context) == (model, "pride-and-prejudice", 512)
    args = build_parser(only="eval").parse_args(shlex.split(verify.split(": ", 1)[1].split(" and at longer")[0])[1:])
    assert (args.model, args.data) == (model, data)
    assert " --model m --data d " in recommend(rows, model="m", data="d")["next_steps"][-1]  # unchanged


def test_next_steps_carry_the_analysis_context(result):
    """The suggested calibrate and eval dropped the --context the analysis ran at: after analyzing 256-token windows
    (or ``--context 512``) the printed calibrate took its default 2048 tokens. Now both carry the windows' length."""
    from kvbits.cli import build_parser

    assert result.context == 256
    *calibs, verify = result.recommendation["next_steps"]
    assert calibs  # the tiny model's outlier layer names calibrated schemes
    for calib in calibs:
        args = build_parser(only="calibrate").parse_args(calib.split(": ", 1)[1].split()[1:])
        assert (args.model, args.data, args.context) == ("tiny", "pride-and-prejudice", 256)
    args = build_parser(only="eval").parse_args(verify.split(": ", 1)[1].split(" and at longer")[0].split()[1:])
    assert (args.model, args.data, args.context) == ("tiny", "random", 256)
    rows = result.to_dict()["layers"]
    assert "--context" not in recommend(rows)["next_steps"][0]  # no context known: calibrate's own default
    assert recommend(rows)["next_steps"][-1].endswith(" at several --context lengths")


def test_next_steps_calibrate_on_another_text_than_the_one_evaluated(result):
    """The steps calibrated on the analysis' --data and evaluated on it again: scales and codebooks fitted to the
    very windows eval scores flatter the scheme (measured on SmolLM2: ``kvbits.evaluate.calib_text.MEASURED``). Now
    calibrate takes another registry text, and says why."""
    import shlex

    from kvbits.analyze.outliers import calibration_text

    rows = result.to_dict()["layers"]
    for data, calib_on in (("wikitext2", "pride-and-prejudice"), ("pride-and-prejudice", "war-and-peace"),
                           ("/data/gutenberg/pride_and_prejudice.txt", "war-and-peace"), (None, "pride-and-prejudice")):
        *calibs, verify = recommend(rows, model="m", data=data)["next_steps"]
        assert calibs and calibration_text(data) == calib_on
        for calib in calibs:
            why, cmd = calib.split(": ", 1)
            assert "which would flatter the calibrated scheme" in why
            argv = shlex.split(cmd)
            assert argv[argv.index("--data") + 1] == calib_on
        evaluated = shlex.split(verify.split(": ", 1)[1])
        assert evaluated[evaluated.index("--data") + 1] == (data or "TEXT") != calib_on


def test_json_schema(result):
    d = result.to_dict()
    from kvbits._json import loads

    d = loads(dumps(d))  # strict JSON: NaN/inf spelled "NaN"/"+Inf", read back as floats
    for key in ("model", "data", "context", "threshold", "layers", "recommendation", "version"):
        assert key in d
    assert d["threshold"] == 4.0 and d["context"] == 256 and len(d["layers"]) == 3
    figures = {
        "absmax_max",
        "kurtosis_mean",
        "range_used_per_token",
        "range_used_per_channel",
        "sqnr_int4_token",
        "sqnr_int4_channel",
    }
    for row in d["layers"]:
        assert {
            "layer",
            "key_outlier_channels_pre_rope",
            "key_outlier_channels_post_rope",
            "value_outlier_channels",
        } <= set(row)
        for name in ("key_pre_rope", "key_post_rope", "value"):
            assert figures <= set(row[name])
            assert all(isinstance(row[name][f], float) for f in figures)
        for pair in row["key_outlier_channels_pre_rope"]:
            assert isinstance(pair, list) and len(pair) == 2
    assert {"keys", "values", "reason"} <= set(d["recommendation"])
    tensors = result.channel_tensors()
    assert tensors["layer1.key_pre_rope.absmax"].shape == (2, HEAD_DIM)
    assert {k.split(".")[-1] for k in tensors} == {"absmax", "mean", "std", "p1", "p99", "kurtosis"}


# ------------------------------------------------------------------------------ collection


def test_hooks_give_the_keys_attention_rotates_and_leave_nothing_behind():
    """Hooked pre-RoPE keys, rotated with RotaryTables, equal the keys the model cached; for a plain
    family (Llama), one whose k_norm sees (B, T, H, D) (Qwen3) and one whose k_norm sees (B, H, T, D)
    (Gemma3)."""
    base = {
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_hidden_layers": 2,
        "intermediate_size": 64,
        "vocab_size": 64,
    }
    for cfg in (
        transformers.LlamaConfig(**base),
        transformers.Qwen3Config(**base),
        transformers.Gemma3TextConfig(**base, sliding_window=64),
    ):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
        got: dict[tuple[int, str], torch.Tensor] = {}

        def keep(layer, kind, x, got=got):
            got[layer, kind] = x.clone()

        with torch.no_grad(), kv_hooks(model, keep):
            out = model(input_ids=torch.randint(0, 64, (1, 9)), use_cache=True)
        cache = out.get("cache") or out.get("past_key_values")
        tables = RotaryTables.from_model(model)
        for layer in range(2):
            cos, sin = tables.tables_for_layer(layer).cos_sin(torch.arange(9))
            torch.testing.assert_close(
                apply_rope(got[layer, "key"], cos, sin),
                cache.layers[layer].keys,
                atol=1e-5,
                rtol=1e-5,
                msg=cfg.model_type,
            )
            torch.testing.assert_close(got[layer, "value"], cache.layers[layer].values, msg=cfg.model_type)
        assert all(not m._forward_hooks for m in model.modules())


@pytest.mark.parametrize("calibrating", [False, True])
def test_keys_normed_after_rope_are_refused(calibrating):
    """HunYuan-Dense applies ``key_layernorm`` after RoPE: the cache holds ``norm(rope(k_proj))``, the hooks read
    ``k_proj``. Before, analyze reported "post-RoPE" statistics 79-85 % off the cached keys (and outlier channels
    that are not there) and calibrate fitted scales on them; both now refuse the model before their passes."""
    if not hasattr(transformers, "HunYuanDenseV1Config"):
        pytest.skip(f"transformers {transformers.__version__} has no HunYuan-Dense")
    from kvbits.calibrate import collect_samples

    cfg = transformers.HunYuanDenseV1Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                            num_hidden_layers=2, intermediate_size=64, vocab_size=64, pad_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    windows = torch.randint(1, 64, (1, 40), generator=torch.Generator().manual_seed(1))
    match = r"layer 0\): the keys kvbits reads .* differ from the keys the model caches by \d+\.\d% .*not supported"
    with pytest.raises(ValueError, match=match):
        if calibrating:
            collect_samples(model, windows, context=40, windows=1, fisher=False)
        else:
            analyze(model, windows, sample_tokens=64, channel_group=32)
    assert all(not m._forward_hooks for m in model.modules())


def test_keys_of_a_model_without_rope_are_checked_against_its_cache(monkeypatch):
    """Without RoPE the cached keys are the hooked ones, and the probe compares them (as kvbits calibrate's does).
    Before, analyze passed no key tables at all for such a model, the probe's "keys not compared", so a cache
    holding 2 x k_proj (a family changing its keys after the projection) was analyzed, 50 % off, without a word."""
    from transformers import cache_utils

    update = cache_utils.DynamicLayer.update
    monkeypatch.setattr(cache_utils.DynamicLayer, "update", lambda self, k, v, *a, **kw: update(self, 2 * k, v, *a, **kw))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.OPTConfig(
        hidden_size=64, num_attention_heads=4, num_hidden_layers=2, ffn_dim=64, vocab_size=64, word_embed_proj_dim=64))
    match = r"layer 0\): the keys kvbits reads \(the output of its Linear\) differ from the keys the model caches by 50\.0%"
    with pytest.raises(ValueError, match=match):  # no "rotated by the model's RoPE tables": there is none
        analyze(model.eval(), torch.randint(1, 64, (1, 64)), sample_tokens=64, channel_group=32)


def test_interleaved_rope_keys_are_labelled_as_before_rope():
    """GLM rotates interleaved pairs, which kvbits can not reproduce: no post-RoPE statistics. Before, the JSON said
    ``key_outlier_channels_post_rope: []`` (read as "none found") and the recommendation called the pre-RoPE figures
    the keys "as the model caches them" (found by a review session); now null, and the reason says which they are."""
    cfg = transformers.GlmConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                 num_hidden_layers=2, intermediate_size=64, vocab_size=64, pad_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    res = analyze(model, torch.randint(1, 64, (1, 64), generator=torch.Generator().manual_seed(1)), sample_tokens=64,
                  channel_group=32)  # fmt: skip
    d = json.loads(dumps(res.to_dict()))
    assert all(r["key_outlier_channels_post_rope"] is None and r["key_post_rope"] is None for r in d["layers"])
    reason = d["recommendation"]["reason"]
    assert "pre-RoPE key outlier channels" in reason and "interleaved pairs" in reason and "stores keys after" in reason
    plain = transformers.AutoModelForCausalLM.from_config(transformers.OPTConfig(
        hidden_size=64, num_attention_heads=4, num_hidden_layers=2, ffn_dim=64, vocab_size=64, word_embed_proj_dim=64))
    no_rope = analyze(plain.eval(), torch.randint(1, 64, (1, 64)), sample_tokens=64, channel_group=32)
    assert "interleaved" not in no_rope.recommendation["reason"]  # no RoPE at all: the keys are the cached ones


def test_plots_of_a_model_without_rope_show_no_post_rope_figures(result, tmp_path, monkeypatch):
    """OPT has no RoPE: the layer summary drew a "post-RoPE keys" bar of 0 per layer (read as "no outlier after RoPE"
    while the JSON says null, not computed) beside "pre-RoPE keys", and the heatmap called the keys "before RoPE"
    (found by a review session: layer 0's planted channel, 1 pre-RoPE bar, 0 post-RoPE). Now the keys are "keys", with
    no post-RoPE series; a model with RoPE keeps all three."""
    pytest.importorskip("matplotlib")
    from kvbits.analyze import plots

    figs = []
    save = plots._save
    monkeypatch.setattr(plots, "_save", lambda plt, fig, path: (figs.append(fig), save(plt, fig, path))[1])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.OPTConfig(
        hidden_size=64, num_attention_heads=4, num_hidden_layers=2, ffn_dim=64, vocab_size=64, word_embed_proj_dim=64))
    with torch.no_grad():
        model.model.decoder.layers[0].self_attn.k_proj.weight[3] *= 30
    no_rope = analyze(model.eval(), torch.randint(1, 64, (1, 64)), sample_tokens=64, channel_group=32)
    assert no_rope.layers[0].key_pre_rope.outliers == [[0, 3]]

    def labels(fig):
        return [[t.get_text() for t in ax.get_legend().get_texts()] if ax.get_legend() else ax.get_title()
                for ax in fig.axes if ax.get_legend() or ax.get_title()]

    plots.plot_layer_summary(no_rope, tmp_path / "a.png")
    plots.plot_key_heatmaps(no_rope, tmp_path / "b.png")
    plots.plot_layer_summary(result, tmp_path / "c.png")
    assert labels(figs[0]) == [["keys", "values"], ["cached keys, per-token", "cached keys, per-channel"]]
    assert [t.split("\n")[0] for t in labels(figs[1])] == ["|K|", "|V|"]
    assert labels(figs[2])[0] == ["pre-RoPE keys", "post-RoPE keys", "values"]
    assert "post-RoPE, per-channel" in labels(figs[2])[1]


def test_recommendation_from_saved_rows_keeps_the_before_rope_caveat(tmp_path):
    """``recommend()`` re-run on ``analysis.json``'s rows of an interleaved-RoPE model (GLM here; GPT-J, Cohere) lost
    the caveat that the key figures are from before RoPE: the flag was an argument only, not in the file. Now each
    row says ``keys_rotated_unseen``; a file written before it (no such key) still reads, as before."""
    cfg = transformers.GlmConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                 num_hidden_layers=2, intermediate_size=64, vocab_size=64, pad_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    res = analyze(model, torch.randint(1, 64, (1, 64)), sample_tokens=64, channel_group=32)
    rows = json.loads(res.save(tmp_path)["json"].read_text())["layers"]
    assert all(r["keys_rotated_unseen"] is True for r in rows)
    again = recommend(rows, threshold=res.threshold, layer_fraction=res.layer_fraction, model=res.model, data=res.data,
                      context=res.context)
    assert again == res.recommendation and "interleaved pairs" in again["reason"]
    old = [{k: v for k, v in r.items() if k != "keys_rotated_unseen"} for r in rows]  # an analysis.json from before
    assert "interleaved" not in recommend(old)["reason"]
    assert "interleaved" in recommend(old, keys_rotated_unseen=True)["reason"]


def test_every_family_the_hooks_read_right_passes_the_probe():
    """The probe (``kvbits.analyze.verify``) accepts what the hooks read right: a plain family, norms in three
    layouts, partial rotary, sliding layers shorter than the probe, and a model without RoPE (values only)."""
    from kvbits.analyze.verify import verify_taps

    base = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
            "intermediate_size": 64, "vocab_size": 64}  # fmt: skip
    for cfg in (transformers.LlamaConfig(**base, head_dim=16), transformers.Qwen3Config(**base, head_dim=16),
                transformers.Gemma3TextConfig(**base, head_dim=16, sliding_window=8),
                transformers.PhiConfig(**{**base, "num_key_value_heads": 4}, partial_rotary_factor=0.5, qk_layernorm=True),
                transformers.OPTConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, ffn_dim=64,
                                       vocab_size=64, word_embed_proj_dim=64)):  # fmt: skip
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
        try:
            tables = RotaryTables.from_model(model)
        except ValueError:  # no RoPE: the cached keys are the hooked ones
            tables = None
        sites = attention_sites(model)
        key_tables = [None if tables is None else tables.tables_for_layer(s.layer_idx) for s in sites]
        verify_taps(model, torch.randint(1, 64, (1, 20)), key_tables)


def test_the_probe_reads_the_cache_without_a_deprecation_warning(monkeypatch):
    """The probe asked the model output for ``past_key_values`` first, which transformers 5.24+ answers with
    "`past_key_values`/`cache_params` are deprecated. Use `cache` instead." on stderr: a line on every kvbits
    analyze and kvbits calibrate run."""
    from transformers.utils import generic

    from kvbits.analyze.verify import verify_taps

    said: list[str] = []
    monkeypatch.setattr(generic.logger, "warning_once", lambda msg, *a, **k: said.append(str(msg)))
    model = tiny_llama()
    tables = RotaryTables.from_model(model)
    key_tables = [tables.tables_for_layer(s.layer_idx) for s in attention_sites(model)]
    verify_taps(model, torch.randint(1, model.config.vocab_size, (1, 20)), key_tables)
    assert not [m for m in said if "deprecated" in m], said


def test_non_finite_kv_anywhere_in_a_window_is_refused():
    """A NaN embedding row used at position 190 of a 200-token window (outside the sample's whole blocks): before,
    nothing was said, absmax turned NaN, no outlier channel was found and the recommendation flipped from
    per-channel pre-RoPE keys to per-token. Now a ValueError names the window, the layer and the position."""
    model = tiny_llama()
    windows = torch.randint(1, model.config.vocab_size, (1, 200), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model.model.embed_tokens.weight[0] = float("nan")
    windows[0, 190] = 0
    with pytest.raises(ValueError, match=r"window 0, layer 0 key_pre_rope: \d+ non-finite values .* position 190"):
        analyze(model, windows, sample_tokens=4096)


def test_kv_beyond_float16_range_is_refused_by_name():
    """Values of a float32 model up to ~1e5 (finite, beyond float16's 65504): the sample is float16, so it held inf,
    and after every forward pass the SQNR refused a "K/V block [that] contains non-finite values (0 NaN, .. inf)",
    blaming the model for the analysis's own storage and naming no layer. kvbits' quantizers keep float16 scales and
    refuse such K/V anyway: now the pass says so, naming the window, the layer and the position."""
    model = tiny_llama()
    with torch.no_grad():
        model.model.layers[1].self_attn.v_proj.weight.mul_(1e6)
    windows = torch.randint(1, model.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match=r"window 0, layer 1 value: \|x\| up to .*float16's range"):
        analyze(model, windows, sample_tokens=64, channel_group=32)


def _qwen3() -> torch.nn.Module:
    """A tiny Qwen3: its keys pass a ``k_norm`` (input ``(B, T, H, D)``) before RoPE."""
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=16, vocab_size=96)  # fmt: skip
    return transformers.Qwen3ForCausalLM(cfg).eval()


@pytest.mark.parametrize("calibrating", [False, True])
@pytest.mark.parametrize(("build", "bad"), [(tiny_llama, float("inf")), (_qwen3, float("nan"))], ids=["llama", "qwen3"])
def test_non_finite_kv_in_the_first_tokens_is_not_blamed_on_the_family(calibrating, build, bad):
    """NaN / inf K/V within the 16 tokens ``verify_taps`` probes (a NaN weight, a float16 overflow): before, the
    relative error was NaN and analyze / calibrate refused the model as a family that "transforms its keys after
    RoPE ... (e.g. HunYuan's key_layernorm)", "differ by nan%"; a model with a key norm (Qwen3) was refused earlier
    still, its norm's input "not a reshape of the projection's output" (NaN != NaN): "this model family is not
    supported". Now a NonFiniteKV names the layer and the cause."""
    from kvbits.analyze.stats import NonFiniteKV
    from kvbits.calibrate import collect_samples

    model = build()
    with torch.no_grad():
        model.model.layers[1].self_attn.k_proj.weight[3, 5] = bad
    windows = torch.randint(1, model.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(1))
    with pytest.raises(NonFiniteKV, match=r"layer 1\): \d+ non-finite keys \(NaN / inf\).*float16 overflow"):
        if calibrating:
            collect_samples(model, windows, context=64, windows=1, fisher=False)
        else:
            analyze(model, windows, sample_tokens=64, channel_group=32)
    assert all(not m._forward_hooks for m in model.modules())


def test_the_last_partial_block_of_a_window_is_sampled():
    """T = 200, blocks of 128: before, the sample held positions 0-127 only (p99 2.07 against 101.85 over all
    tokens, the last 72 shifted by +100); now a second block ends at the window's last token."""
    stats, reservoir = ChannelStats(1, 4, capacity=100, block=128), BlockReservoir(100)
    data = torch.randn(2, 1, 200, 4, generator=torch.Generator().manual_seed(0))
    data[:, :, 128:] += 100
    for w in range(2):
        stats.update(data[w : w + 1], reservoir.offer(blocks_in(200, 128)))
    assert sorted(stats.positions[: reservoir.size].tolist()) == [0, 0, 72, 72]
    assert float(stats.sampled(reservoir.size).amax()) > 90


def test_recommend_takes_the_rows_of_a_saved_analysis(result):
    """``recommend(Analysis.to_dict()["layers"])``, as its docstring offers: an exact int4 reconstruction (SQNR inf)
    is written as null there, and ``_mean`` raised TypeError on it."""
    rows = result.to_dict()["layers"]
    rows[0]["value"]["sqnr_int4_token"] = None
    rows[1]["key_pre_rope"]["range_used_per_token"] = None
    assert recommend(rows)["scheme"] == result.recommendation["scheme"]


def test_analysis_json_spells_non_finite_figures_as_every_kvbits_json(result, tmp_path):
    """``analysis.json`` wrote every non-finite figure as null, where every other kvbits JSON writes ``"NaN"`` /
    ``"+Inf"``: an exact int4 reconstruction (SQNR inf) and ordinary channels using no range (``bits_lost_per_token``
    inf, "every bit lost") read the same as NaN and "not computed". Now spelled, read back by ``kvbits._json.loads``,
    and ``recommend`` takes the rows of new files and of old (null) ones, read by a plain JSON parser."""
    import copy

    from kvbits._json import loads

    res = copy.deepcopy(result)
    res.layers[0].value.sqnr_token = math.inf
    res.layers[1].key_pre_rope.range_used_by_head = [0.0]  # bits_lost_per_token inf
    res.layers[2].key_pre_rope.range_used_by_head = [math.nan]  # a head of zeros: unknown
    text = (Path(res.save(tmp_path)["json"])).read_text()
    plain = json.loads(text)  # strict JSON: any parser reads it
    rows = plain["layers"]
    assert rows[0]["value"]["sqnr_int4_token"] == "+Inf"
    assert (rows[1]["key_pre_rope"]["bits_lost_per_token"], rows[2]["key_pre_rope"]["bits_lost_per_token"]) == (
        "+Inf", "NaN")
    back = loads(text)["layers"]
    assert back[0]["value"]["sqnr_int4_token"] == math.inf and math.isnan(back[2]["key_pre_rope"]["range_used_per_token"])
    old = json.loads(text.replace('"+Inf"', "null").replace('"NaN"', "null"))["layers"]  # as written before
    expected = recommend([la.to_dict() for la in res.layers])
    for layers in (rows, back, old):
        assert recommend(layers) == expected
    with pytest.raises(ValueError, match="a figure is a string \\('abc'\\)"):
        recommend([{**rows[0], "value": {**rows[0]["value"], "sqnr_int4_token": "abc"}}, *rows[1:]])


@pytest.mark.parametrize(("name", "value"), [("threshold", float("nan")), ("threshold", 1.0),
                                             ("layer_fraction", float("nan")), ("layer_fraction", 1.0)])  # fmt: skip
def test_nan_threshold_or_layer_fraction_is_refused(name, value):
    """NaN compared False: ``threshold=nan`` found no outlier channel and the recommendation went per-token."""
    model = tiny_llama(outlier=False)
    with pytest.raises(ValueError, match=f"{name} must be a"):
        analyze(model, torch.zeros(1, 8, dtype=torch.long), **{name: value})
    if name == "threshold":
        with pytest.raises(ValueError, match="threshold must be a finite number > 1"):
            outlier_channels(torch.ones(2, 4), value)


@pytest.mark.parametrize(("kw", "message"), [({"channel_group": 1}, "channel_group must be an int >= 3, got 1"),
                                             ({"sample_tokens": 100.5}, "sample_tokens must be an int >= 1, got 100.5"),
                                             ({"channel_group": 32.0}, "channel_group must be an int >= 3, got 32.0")])  # fmt: skip
def test_bad_channel_group_or_sample_tokens_is_named(kw, message):
    """channel_group=1 was refused as "windows must hold at least 2 tokens, got T=64"; a float sample_tokens or
    channel_group raised torch's TypeError from inside ChannelStats."""
    model = tiny_llama(outlier=False)
    with pytest.raises(ValueError, match=message):
        analyze(model, torch.zeros(1, 64, dtype=torch.long), **kw)


@pytest.mark.parametrize("bad", [-1, 2**32, True])
def test_a_seed_outside_the_cli_bound_is_refused(bad):
    """``analyze(seed=...)`` from Python: the bound of the CLI's ``--seed`` (``[0, 2**32 - 1]``). Before, ``-1`` sampled
    the tokens of seed 1 (``random.Random`` seeds with ``abs``) and ``True`` those of 1."""
    with pytest.raises(ValueError, match=r"seed must be an int in \[0, 4294967295\]"):
        analyze(tiny_llama(outlier=False), torch.zeros(1, 64, dtype=torch.long), seed=bad)


def test_empty_windows_are_refused():
    with pytest.raises(ValueError, match="at least one window"):
        analyze(tiny_llama(outlier=False), torch.zeros(0, 64, dtype=torch.long))


def test_hooks_removed_after_an_error():
    model = tiny_llama(outlier=False)

    def boom(layer, kind, x):
        raise RuntimeError("stop")

    with pytest.raises(RuntimeError, match="stop"), kv_hooks(model, boom):
        model(input_ids=torch.zeros(1, 4, dtype=torch.long))
    assert all(not m._forward_hooks for m in model.modules())


def test_unsupported_model_says_why():
    gpt2 = transformers.AutoModelForCausalLM.from_config(
        transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2)
    )
    with pytest.raises(ValueError, match="k_proj"):
        analyze(gpt2, torch.zeros(1, 8, dtype=torch.long))


def test_windows_must_be_token_ids_of_the_model():
    """The check evaluate and calibrate make: ids past the embedding table raised inside torch, bools ran."""
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=100, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1,
        intermediate_size=64,
    )).eval()  # fmt: skip
    with pytest.raises(ValueError, match=r"windows must lie in \[0, 100\)"):
        analyze(model, torch.full((1, 32), 100))
    with pytest.raises(TypeError, match="windows must be an integer tensor, got torch.bool"):
        analyze(model, torch.ones(1, 32, dtype=torch.bool))


# ----------------------------------------------------------------------------- statistics


def test_streaming_moments_equal_direct_computation():
    g = torch.Generator().manual_seed(0)
    chunks = [torch.randn(2, 3, 40, 8, generator=g) * torch.linspace(0.5, 5, 8) + 3.0 for _ in range(3)]
    chunks[1][:, :, :, 2] += 40 * torch.rand(2, 3, 40, generator=g)  # skewed, heavy channel
    st = ChannelStats(3, 8, capacity=100, block=8)
    res = BlockReservoir(100)
    for c in chunks:
        st.update(c, res.offer(c.shape[0] * (c.shape[2] // 8)))
    x = torch.cat([c.permute(1, 3, 0, 2).reshape(3, 8, -1) for c in chunks], dim=-1).double()  # (H, D, N)
    mu = x.mean(-1)
    var = x.var(-1, unbiased=False)
    kurt = ((x - mu[..., None]) ** 4).mean(-1) / var**2
    torch.testing.assert_close(st.mean, mu.float())
    torch.testing.assert_close(st.std, var.sqrt().float())
    torch.testing.assert_close(st.kurtosis, kurt.float(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(st.absmax, x.abs().amax(-1).float())
    assert st.count == 240
    # the reservoir held every block, in arrival order: the sample is all the data (float16)
    assert res.size == 30
    sample = st.sampled(res.size).permute(1, 3, 0, 2).reshape(3, 8, -1)
    torch.testing.assert_close(sample, x.float(), rtol=1e-3, atol=2e-2)
    p = st.percentiles(res.size, (0.5,))[0]
    torch.testing.assert_close(p, x.float().quantile(0.5, dim=-1), rtol=1e-3, atol=2e-2)


def test_moments_of_a_long_window_hold_no_float64_copy_of_it(monkeypatch):
    """``ChannelStats.update`` held three float64 copies of a whole window (x, x - shift, its powers): 774 MiB beside
    a 32K-token window of 8 x 128 (128 MiB), per layer and tensor. Now the powers go ``MOMENT_CHUNK`` tokens at a
    time (130 MiB measured); the moments are unchanged."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from kvbits.analyze import stats as stats_mod

    monkeypatch.setattr(stats_mod, "MOMENT_CHUNK", 64, raising=False)
    largest = [0]

    class Float64Sizes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.dtype == torch.float64:
                    largest[0] = max(largest[0], t.numel())
            return out

    x = torch.randn(1, 2, 1000, 4, generator=torch.Generator().manual_seed(0)) * 3 + 5  # T = 1000: a ragged last chunk
    st = ChannelStats(2, 4, capacity=4, block=8)
    with Float64Sizes():
        st.update(x)
    assert largest[0] <= 64 * 2 * 4  # one chunk, not the 8000 values of the window
    xd = x.double()
    torch.testing.assert_close(st.mean, xd.mean((0, 2)).float())
    torch.testing.assert_close(st.std, xd.std((0, 2), unbiased=False).float())
    kurt = ((xd - xd.mean((0, 2))[None, :, None]) ** 4).mean((0, 2)) / xd.var((0, 2), unbiased=False) ** 2
    torch.testing.assert_close(st.kurtosis, kurt.float(), rtol=1e-5, atol=1e-5)


def test_percentiles_ask_torch_on_the_samples_device():
    # torch.quantile refuses q on another device than its input (CUDA: 'q tensor must be on the same device');
    # the meta device runs the same check on a CPU-only machine. Before, q was built on the CPU: --device cuda failed
    st = ChannelStats(2, 4, capacity=2, block=3)
    st.update(torch.randn(1, 2, 6, 4), BlockReservoir(2).offer(2))
    st.sample = st.sample.to("meta")
    assert st.percentiles(2).device.type == "meta"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_analyze_and_plots_on_cuda(tmp_path):
    pytest.importorskip("matplotlib")
    from kvbits.analyze.plots import plot_key_heatmaps

    model = tiny_llama().cuda()
    windows = torch.randint(0, model.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(1))
    res = analyze(model, windows, sample_tokens=64)
    assert res.layers[OUT_LAYER].key_pre_rope.outliers == [[OUT_HEAD, OUT_CH]]
    assert all(t.device.type == "cpu" for la in res.layers for t in la.samples.values())
    assert plot_key_heatmaps(res, tmp_path / "k.png").exists()


def test_reservoir_is_uniform():
    counts = torch.zeros(20)
    for seed in range(400):
        r = BlockReservoir(5, seed=seed)
        slots = {}
        for start in range(0, 20, 4):
            for slot, i in r.offer(4):
                slots[slot] = start + i
        for v in slots.values():
            counts[v] += 1
    assert counts.sum() == 400 * 5
    assert counts.min() > 0.6 * 100 and counts.max() < 1.4 * 100  # each block kept with p = 5/20


def test_outlier_rule_and_range_used_by_hand():
    absmax = torch.tensor([[1.0, 1.1, 0.9, 4.5, 1.0], [1.0, 1.0, 1.0, 3.9, 1.0]])
    assert outlier_channels(absmax, 4.0) == [[0, 3]]  # 4.5 > 4 x 1.0; 3.9 is not
    assert outlier_channels(absmax, 3.0) == [[0, 3], [1, 3]]
    with pytest.raises(ValueError, match="threshold"):
        outlier_channels(absmax, 1.0)
    x = torch.tensor([[0.5, -0.2, 10.0, 0.1], [0.3, 0.4, -2.0, 0.1], [0.1, 0.0, 0.2, 0.0]]).reshape(
        1, 1, 3, 4
    )
    mask = torch.tensor([[False, False, True, False]])  # (N, H, T, D) above; channel 2 is the outlier
    assert range_used_per_token(x, mask) == [pytest.approx(0.2)]  # median of 0.05, 0.2, 0.5
    assert range_used_per_token(x, torch.zeros_like(mask)) == [1.0]
    assert smeared_pairs([[0, 3]], [[0, 3], [0, 19]], 32) == [{"head": 0, "channel": 3, "partner": 19}]


def test_dead_channels_make_no_live_channel_an_outlier():
    """A KV head whose channels are half zero at every token (dead): before, the median channel absmax was 0 (the
    lower middle of 8), every live channel (absmax ~3, none above 4x another) an outlier, the head's range used 0.0,
    bits lost NaN, and the recommendation said "~19.9 bits lost" while int4 per-token SQNR beat per-channel. Now the
    median is over the live channels; a head of zeros has none; a range used of 0 loses every bit (inf)."""
    from kvbits.analyze.stats import TensorReport

    torch.manual_seed(0)
    x = torch.randn(1, 2, 256, 8)
    x[:, 0, :, :4] = 0  # head 0: channels 0-3 dead
    x[:, 1] = 0  # head 1: all zero
    st = ChannelStats(2, 8, 2, 128, "layer 0 value")
    res = BlockReservoir(2)
    st.update(x, res.offer(blocks_in(256, 128)))
    rep = TensorReport.from_stats(st, res.size, 4.0)
    assert rep.outliers == [] and rep.range_used_by_head == [1.0, 1.0]
    assert rep.summary()["bits_lost_per_token"] == 0.0
    absmax = torch.tensor([[0.0, 0.0, 0.0, 1.0, 1.2, 0.9, 5.0]])  # live median 1.0: channel 6 still an outlier
    assert outlier_channels(absmax, 4.0) == [[0, 6]]
    rep.range_used_by_head = [0.0, 1.0]
    assert rep.summary()["bits_lost_per_token"] == math.inf


def test_threshold_help_says_the_median_is_over_live_channels():
    """``kvbits analyze --help`` said the threshold multiplies "the median channel absmax of its head", but the
    median is over the head's live channels only (above: with 3 of 7 channels dead the median is 1.0, not 0.9):
    the help, the description and the table caption now say so."""
    import argparse

    from kvbits.cli import build_parser

    (sub,) = (a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    analyze = sub.choices["analyze"]
    (threshold,) = (a for a in analyze._actions if "--threshold" in a.option_strings)
    assert "live" in threshold.help and "live" in analyze.description


def test_int4_sqnr_prefers_channels_on_outlier_channels():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 2, 128, 64, generator=g)
    x[:, :, :, 5] *= 40
    tok, ch = int_sqnr(x, "token"), int_sqnr(x, "channel", group=128)
    assert ch > tok + 3
    assert int_sqnr(torch.randn(1, 1, 128, 64, generator=g), "token", bits=8) > 40


# -------------------------------------------------------------------------------------- CLI


def _cli_argv(tmp_path, monkeypatch, words: int, windows: int, max_positions: int = 1024) -> list[str]:
    """``kvbits analyze`` arguments for the tiny Llama saved as a local folder (word-level tokenizer)
    and a text of ``words`` words, at 128-token windows; hashes go to a private cache."""
    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path / "cache"))
    model_dir = tmp_path / "model"
    save_word_tokenizer(model_dir)
    tiny_llama(max_positions=max_positions).save_pretrained(model_dir)
    text = write_word_text(tmp_path / "book.txt", words)
    return ["analyze", "--model", str(model_dir), "--data", str(text), "--context", "128", "--windows", str(windows)]


def test_cli_json_table_and_plots(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    from kvbits.cli import main

    argv = _cli_argv(tmp_path, monkeypatch, words=800, windows=2)
    out = tmp_path / "out"
    assert main(argv + ["--json", "--out", str(out)]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["layers"][OUT_LAYER]["key_outlier_channels_pre_rope"] == [[OUT_HEAD, OUT_CH]]
    assert d["recommendation"]["keys"] == "per-channel, pre-RoPE"
    for name in ("analysis.json", "channel_stats.safetensors", "key_heatmap.png", "layers.png"):
        assert (out / name).stat().st_size > 0
    assert json.loads((out / "analysis.json").read_text())["layers"] == d["layers"]
    from safetensors import safe_open

    with safe_open(str(out / "channel_stats.safetensors"), "pt") as f:
        assert f.metadata()["version"] == "1" and f.metadata()["fingerprint"]
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "threshold 4" in table and "per-channel, pre-RoPE" in table and "h1:c3" in table
    with pytest.raises(SystemExit):  # argparse rejects a threshold that is not a multiple > 1
        main(argv + ["--threshold", "1"])


def test_table_shows_an_exact_reconstruction_as_inf_not_as_missing():
    from kvbits.analyze.cli import _db

    # a layer of zeros is stored exactly (SQNR +inf, "+Inf" in analysis.json); before, the table printed "-" as for NaN
    assert (_db(math.inf), _db(math.nan), _db(None), _db(21.34)) == ("inf", "-", "-", "21.3")


def test_heatmap_of_a_chosen_layer_or_head_defaults_to_its_strongest_outlier(result, tmp_path, monkeypatch):
    """``--plot-layer 0`` alone: before, the head was the strongest of the whole model (layer 1's head 1), so layer 0
    was drawn at a head without its outlier channel (head 0 here); now the strongest head of the layer asked for."""
    pytest.importorskip("matplotlib")
    import copy

    from kvbits.analyze import plots

    res = copy.deepcopy(result)
    ratio = lambda a: a.max(-1).values / a.median(-1).values
    a0 = res.layers[0].key_pre_rope.absmax
    a0[0, 7] = 0.5 * float(ratio(res.layers[OUT_LAYER].key_pre_rope.absmax)[OUT_HEAD]) * float(a0[0].median())
    assert plots.pick_layer_head(res) == (OUT_LAYER, OUT_HEAD)  # still the strongest overall
    titles: list[str] = []
    monkeypatch.setattr(plots, "_save", lambda plt, fig, path: titles.append(fig._suptitle.get_text()) or plt.close(fig))
    plots.plot_key_heatmaps(res, tmp_path / "a.png", layer=0)
    plots.plot_key_heatmaps(res, tmp_path / "b.png", head=0)
    assert "layer 0, KV head 0 " in titles[0] and "layer 0, KV head 0 " in titles[1], titles
    assert plots.pick_layer_head(res, layer=2, head=1) == (2, 1)


@pytest.mark.parametrize(("max_positions", "warned"), [(64, True), (128, False)])
def test_cli_warns_when_the_context_exceeds_max_position_embeddings(
    tmp_path, monkeypatch, capsys, caplog, max_positions, warned
):
    from kvbits.cli import main

    argv = _cli_argv(tmp_path, monkeypatch, words=300, windows=1, max_positions=max_positions)
    with caplog.at_level(logging.WARNING, logger="kvbits"):
        assert main(argv + ["--json", "--sample-tokens", "128"]) == 0
    assert json.loads(capsys.readouterr().out)["context"] == 128
    message = "context 128 exceeds the model's max_position_embeddings 64: positions beyond it are extrapolation"
    assert (message in caplog.text) is warned, caplog.text


def test_python_api_warns_when_the_context_exceeds_max_position_embeddings(caplog):
    """analyze() itself warns (the CLI calls it), as evaluate() and calibrate() do."""
    model = tiny_llama(max_positions=64)
    windows = torch.randint(0, model.config.vocab_size, (1, 128), generator=torch.Generator().manual_seed(1))
    with caplog.at_level(logging.WARNING, logger="kvbits"):
        analyze(model, windows, sample_tokens=128, model_name="tiny", data_name="random")
    assert "context 128 exceeds the model's max_position_embeddings 64" in caplog.text


@pytest.mark.parametrize(
    "flag,value,message",
    [("--plot-layer", "9", "--plot-layer must be one of the attention layers"), ("--plot-head", "5", "--plot-head")],
)
def test_cli_bad_plot_arguments_refused_before_writing(tmp_path, monkeypatch, capsys, flag, value, message):
    from kvbits.cli import main

    argv = _cli_argv(tmp_path, monkeypatch, words=300, windows=1)
    out = tmp_path / "out"
    assert main(argv + ["--out", str(out), flag, value]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()  # refused before the analysis wrote anything


# --------------------------------------------------------------------------------- real model


@pytest.mark.realmodel
def test_real_model_has_key_outlier_channels():
    """Qwen2.5-Coder-0.5B (bias on k_proj: large outlier key channels) at 512 tokens of WikiText-2."""
    from kvbits.evaluate.data import load_text, make_windows, tokenize
    from kvbits.evaluate.models import load_model

    t0 = time.perf_counter()
    try:
        lm = load_model("qwen2.5-coder-0.5b")
        text = load_text("wikitext2")
    except (RuntimeError, FileNotFoundError) as exc:
        unavailable(f"offline model or text not available: {exc}")
    windows = make_windows(tokenize(text, lm.tokenizer), 512, 1)
    res = analyze(lm.model, windows, model_name="qwen2.5-coder-0.5b", data_name="wikitext2")
    d = res.to_dict()
    pre = d["recommendation"]["layers_with_key_outliers_pre_rope"]
    post = d["recommendation"]["layers_with_key_outliers_post_rope"]
    logging.getLogger(__name__).warning(
        "qwen2.5-coder-0.5b: key outlier channels pre-RoPE in %d/%d layers %s, post-RoPE in %d %s (%.0f s)",
        len(pre),
        len(d["layers"]),
        pre,
        len(post),
        post,
        time.perf_counter() - t0,
    )
    assert len(pre) >= len(d["layers"]) // 2
    assert d["recommendation"]["keys"].startswith("per-channel")
    tok = [r["key_pre_rope"]["sqnr_int4_token"] for r in d["layers"]]
    ch = [r["key_pre_rope"]["sqnr_int4_channel"] for r in d["layers"]]
    assert sum(ch) / len(ch) > sum(tok) / len(tok)
    assert all(math.isfinite(v) for v in tok + ch)


def test_the_json_records_the_tokens_actually_sampled(caplog):
    """``sample_tokens`` is a cap in whole blocks: 2 windows x 512 tokens offer 8 blocks of 128 (1,024 tokens) under a
    cap of 4,096, and 200 rounds down to one block. Before, the JSON's only figure was the cap (4096, 200), with
    nothing said about the rounding; now ``sampled_tokens`` is what the samples hold, and the rounding is logged."""
    model = tiny_llama()
    windows = torch.randint(1, model.config.vocab_size, (2, 512), generator=torch.Generator().manual_seed(0))
    for cap, sampled, rounded in ((4096, 1024, False), (200, 128, True)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kvbits"):
            res = analyze(model, windows, sample_tokens=cap)
        d = res.to_dict()
        assert (d["sample_tokens"], d["sampled_tokens"]) == (cap, sampled)
        assert res.layers[0].samples["value"].shape[0] * res.channel_group == sampled
        assert ("sample_tokens 200 rounds down to 128" in caplog.text) is rounded, caplog.text


def test_cli_says_when_it_raises_sample_tokens(tmp_path, monkeypatch, capsys, caplog):
    """``--sample-tokens 16`` at 128-token windows is raised to one block of 128: said, not silent, and recorded."""
    from kvbits.cli import main

    argv = _cli_argv(tmp_path, monkeypatch, words=300, windows=1)
    with caplog.at_level(logging.WARNING, logger="kvbits"):
        assert main(argv + ["--json", "--sample-tokens", "16"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert (d["sample_tokens"], d["sampled_tokens"]) == (128, 128)
    assert "--sample-tokens 16 raised to 128" in caplog.text


@pytest.mark.parametrize("context", [1, 2])
def test_cli_says_a_context_is_too_short(tmp_path, monkeypatch, capsys, context):
    """``kvbits analyze --context 2`` failed with TensorSpec's "an asymmetric group of 2 is lossless ... group_size
    must be >= 3" (the user gave no group size); --context 1 with "windows must hold at least 2 tokens". Now one
    message names --context, before the model loads."""
    from kvbits.cli import main

    argv = _cli_argv(tmp_path, monkeypatch, words=300, windows=1)
    argv[argv.index("--context") + 1] = str(context)
    assert main(argv + ["--json"]) == 2
    assert f"--context {context} is too short: the analysis needs at least 3 tokens per window" in capsys.readouterr().err


@pytest.mark.parametrize(("kw", "T", "message"), [({"channel_group": 2}, 64, "channel_group must be an int >= 3, got 2"),
                                                  ({}, 2, "windows of 2 token.s. are too short")])  # fmt: skip
def test_a_group_of_two_tokens_is_refused_by_name(kw, T, message):
    """``channel_group=2`` (or 2-token windows) raised the scheme layer's "asymmetric group of 2" error."""
    with pytest.raises(ValueError, match=message):
        analyze(tiny_llama(outlier=False), torch.ones(1, T, dtype=torch.long), **kw)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_layers_with_the_same_rope_share_one_cos_sin_table(monkeypatch, family):
    """analyze kept a cos/sin pair per layer although a Llama's layers all rotate alike: 32 layers at 32K tokens
    and D=128 held 1 GiB of float32 copies (measured 64 MiB for 32 layers at 2048 tokens; now 2 MiB). Layers with
    the same RoPE now share one pair, layers with their own base (Gemma 3's global layers) keep theirs, and every
    layer's keys are rotated bit for bit as with its own tables."""
    from kvbits.quant import rope

    base = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "num_hidden_layers": 4, "intermediate_size": 64, "vocab_size": 64}  # fmt: skip
    if family == "llama":
        cfg = transformers.LlamaConfig(**base)
    else:
        types = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
        cfg = transformers.Gemma3TextConfig(**base, sliding_window=8, layer_types=types)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    T = 40
    own = RotaryTables.from_model(model)
    fresh = [own.tables_for_layer(i).cos_sin(torch.arange(T), torch.float32) for i in range(4)]
    calls: list[tuple[int, int]] = []  # (layer, cos storage) per rotation, in hook order (layers 0..3)
    storages: dict[int, int] = {}
    orig = rope.apply_rope

    def spy(x, cos, sin):
        if x.shape[2] != T:  # RotaryTables' convention probe
            return orig(x, cos, sin)
        layer = len(calls) % 4
        assert torch.equal(orig(x, cos, sin), orig(x, *fresh[layer]))  # the keys the statistics see, bit for bit
        calls.append((layer, cos.untyped_storage().data_ptr()))
        for t in (cos, sin):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return orig(x, cos, sin)

    monkeypatch.setattr(rope, "apply_rope", spy)
    res = analyze(model, torch.randint(1, 64, (2, T), generator=torch.Generator().manual_seed(1)), sample_tokens=64,
                  channel_group=8)  # fmt: skip
    assert len(calls) == 8 and all(la.key_post_rope is not None for la in res.layers)
    table_of = {layer: ptr for layer, ptr in calls}
    groups = [[0, 1, 2, 3]] if family == "llama" else [[0, 2], [1, 3]]
    assert sorted(sorted(i for i in table_of if table_of[i] == table_of[g[0]]) for g in groups) == groups
    assert len(set(table_of.values())) == len(groups)
    assert sum(storages.values()) == len(groups) * 2 * T * 16 * 4  # one float32 cos and sin (T, D) per group


def test_a_refused_model_gets_no_post_rope_warning_first(caplog):
    """``analyze`` of a DeepSeek-V3 (multi-head latent attention, ``rope_interleave=True``) logged "no post-RoPE
    statistics ... rope_interleave" before refusing the model for its latent attention, as if the analysis would run
    without post-RoPE figures. The sites are checked first now: the refusal alone. A model that runs with keys
    rotated in a way kvbits can not reproduce still gets the warning."""
    cfg = transformers.AutoConfig.for_model(
        "deepseek_v3", hidden_size=64, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=1,
        intermediate_size=64, vocab_size=128, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=16, first_k_dense_replace=1,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with caplog.at_level(logging.WARNING, logger="kvbits"), pytest.raises(ValueError, match="latent attention"):
        analyze(model, torch.randint(0, 64, (1, 16)))
    assert "post-RoPE" not in caplog.text, caplog.text
    glm = transformers.AutoModelForCausalLM.from_config(transformers.GlmConfig(
        hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_hidden_layers=1,
        intermediate_size=32, vocab_size=64, pad_token_id=0)).eval()  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="kvbits"):
        analyze(glm, torch.randint(1, 64, (1, 8)), sample_tokens=8, channel_group=4)
    assert "no post-RoPE statistics" in caplog.text and "interleaved" in caplog.text


def test_no_pre_rope_scheme_recommended_for_multimodal_rope(tmp_path, caplog):
    """A Qwen2-VL model (multimodal RoPE: ``mrope_section``) whose keys have consistent outlier channels before RoPE
    got ``int4-channel-prerope`` and ``int4-token-smooth-prerope`` from ``analyze`` (per-channel SQNR 62.0 dB pre vs
    24.4 dB post in the review's reproducer), schemes the planner and both caches refuse for it. ``RotaryTables``
    rotates its text tokens all the same, so the post-RoPE figures stay; the answer now names post-RoPE schemes,
    says why (a warning too), and so does ``recommend()`` re-run on the saved rows."""
    cfg = transformers.Qwen2VLConfig(
        text_config={"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
                     "vocab_size": 128, "intermediate_size": 128, "max_position_embeddings": 256,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [4, 2, 2]}},
        vision_config={"depth": 1, "embed_dim": 32, "hidden_size": 64, "num_heads": 2},
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Qwen2VLForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for layer in model.model.language_model.layers:
            layer.self_attn.k_proj.bias[::16] += 50  # one constant outlier channel per head: pre-RoPE keys win
    with caplog.at_level(logging.WARNING, logger="kvbits"):
        res = analyze(model, torch.randint(0, 128, (2, 64)), sample_tokens=64, channel_group=16)
    rec = res.recommendation
    assert "multimodal RoPE" in caplog.text
    assert rec["keys"] == "per-channel, post-RoPE" and rec["scheme"] == "int4-channel"
    assert rec["calibrated_scheme"] is None and rec["per_token_scheme"] in (None, "int4-token-smooth")
    assert "prerope" not in " ".join(rec["next_steps"]) and "multimodal RoPE" in rec["reason"]
    assert all(r.get("key_post_rope") for r in res.to_dict()["layers"])  # text tokens: post-RoPE figures kept
    rows = json.loads(res.save(tmp_path)["json"].read_text())["layers"]
    assert recommend(rows, context=res.context, model=res.model, data=res.data) == rec
