"""``needle_eval``: passkey retrieval of each scheme against the unquantized model, by context and depth.

The trials and their scoring are :mod:`kvbits.evaluate.needle`; this is the loop. Two semantics:

- ``"prefill"`` (the default): the document (haystack and needle, ``trial.doc_len`` tokens) is
  prefilled once in full precision (``DynamicCache``); its K/V are loaded into each scheme's real
  cache (``QuantizedKVCache``, or a peer's), which stores and flushes them as during generation; the
  question and the key are then decoded one token per forward through that cache. This is a server
  that attends the prompt exactly and answers from the stored cache: a chat's next turn, a cached
  prefix, a document prefilled before the question. The reference decodes the same tokens over the
  unquantized K/V. Cost per trial: one prefill shared by all schemes, plus ~20 decode steps each.
  On CUDA with Triton the decode steps run the fused kernel (``fused_decode="auto"``), as in
  ``kvbits eval --mode stream``.
- ``"decode"``: every token, the document's included, attends over the quantized history, as in
  token-by-token generation, computed in one pass by the simulator (``kvbits.evaluate.simulate``,
  held to the real cache by the tests); the reference is a plain forward. Cost: one forward per
  trial and scheme. This is the harsher case, and the semantics of ``kvbits eval``'s perplexity.

Per (context, depth) cell the summary gives the fraction of trials retrieved, by the reference and by
each scheme; per scheme also ``kept`` (of the trials the reference retrieved, the fraction the scheme
retrieved too), the key's mean NLL and its change against the reference, and the KL at the key positions.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvbits._argtypes import runs_on_device
from kvbits._model import check_cache_holds, check_model_arg
from kvbits._spelling import spell
from kvbits.evaluate.generation import _mean
from kvbits.evaluate.needle import (
    DEFAULT_DEPTHS,
    NeedleTask,
    Trial,
    build_trials,
    check_contexts,
    check_depths,
    check_seed,
    score_key,
)
from kvbits.evaluate.stream import PeerScheme, base_model, cache_bytes, check_schemes_fit, resolve_schemes
from kvbits.schemes import check_unique_names

logger = logging.getLogger(__name__)

__all__ = ["NEEDLE_SEMANTICS", "NEEDLE_VERSION", "needle_eval", "reference_result", "scheme_result"]

NEEDLE_SEMANTICS = ("prefill", "decode")
NEEDLE_VERSION = 1


_DEFAULT_CHUNK = 256  # needle_eval's chunk_size default


def _check_args(semantics: str, schemes: list, fused_decode: Any, trials: Any, chunk_size: Any) -> None:
    if semantics not in NEEDLE_SEMANTICS:
        raise ValueError(f"semantics must be one of {NEEDLE_SEMANTICS}, got {semantics!r}")
    if not schemes:
        raise ValueError("give at least one scheme to measure against the unquantized model")
    check_unique_names([s.name for s in schemes], "measured")
    peers = [s.name for s in schemes if isinstance(s, PeerScheme)]
    if peers and semantics != "prefill":
        raise ValueError(
            f"{', '.join(peers)} exist only as a cache: use semantics='prefill' (the real cache), "
            "not 'decode' (the simulator)"
        )
    if semantics == "decode" and fused_decode != "auto":
        raise ValueError(
            f"fused_decode={fused_decode!r} needs semantics='prefill': 'decode' runs the simulator, which never "
            "decodes through the cache"
        )
    # numpy's ints too, as build_trials takes them (a np.int64 was refused as "not a positive int")
    if isinstance(trials, bool) or not isinstance(trials, (int, np.integer)) or trials < 1:
        raise ValueError(f"trials must be a positive int (trials per context and depth), got {trials!r}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if semantics == "prefill" and chunk_size != _DEFAULT_CHUNK:  # as kvbits eval refuses it with mode='stream'
        decode = spell("semantics='decode'", "--semantics decode")
        raise ValueError(
            f"{spell(f'chunk_size={chunk_size}', f'--chunk-size {chunk_size}')} needs {decode}: it sets the simulator's "
            "queries per attention chunk, and 'prefill' prefills the document into the real cache and decodes the "
            f"question through it, so the setting would be ignored; leave it at {_DEFAULT_CHUNK}"
            f"{spell('', ' (no --chunk-size)')} or use {decode}"
        )


def check_decode_simulates(model: Any, schemes: Sequence[Any]) -> None:
    """``semantics="decode"`` runs the simulator, which hooks attention modules per layer: on a model whose
    attention block several layers share (:func:`kvbits._model.shared_attention`) it can not find Zamba's at all
    (no ``layer_idx``) nor apply a mixed scheme's per-layer schemes to Zamba2's (``layer_idx`` -1). Refused before
    the first trial, naming ``semantics="prefill"`` (the real cache, which the model tells the layer); it was the
    simulator's refusal, after the first trial's reference pass, naming ``evaluate``'s ``mode='stream'``."""
    from kvbits._model import attention_modules, shared_attention, shared_attention_note

    if not shared_attention(model):
        return
    works = spell("semantics='prefill'", "--semantics prefill") + " runs it through the real cache, which holds it"
    if not attention_modules(model):  # Zamba: no layer_idx anywhere
        raise ValueError(f"kvbits needle: semantics='decode' runs the simulator: {shared_attention_note(model)}; {works}")
    mixed = [s.name for s in schemes if getattr(s, "is_mixed", False)]
    if mixed:  # Zamba2: one scheme for every call of the shared block
        raise ValueError(
            f"kvbits needle: semantics='decode' runs the simulator, which can not apply mixed schemes {mixed} to "
            f"{type(model).__name__}'s attention block, shared by several layers (it can not tell which layer calls "
            f"it); {works}"
        )


def _haystack(data: Any, data_path: str | None) -> Any:
    """The haystack's ``TextSource`` from ``data`` (a text spec, a path-like, or a ``TextSource``); ``TypeError``
    for anything else (token ids among them), before the model loads."""
    from kvbits.evaluate.data import TextSource, load_text

    if isinstance(data, TextSource):
        return data
    if isinstance(data, os.PathLike):
        data = os.fspath(data)
    if not isinstance(data, str):
        raise TypeError(
            "data must be a registered text (war-and-peace, ...), a text file or a TextSource: the trials are built "
            f"from text (sentence ends, the key's digits), so token ids can not serve; got {type(data).__name__}"
        )
    return load_text(data, data_path)


def _logprobs(head: Any, hidden: torch.Tensor) -> torch.Tensor:
    from kvbits.evaluate.metrics import exact_log_softmax

    return exact_log_softmax(head(hidden))


def _key_slice(trial: Trial, first: int) -> slice:
    """Rows of hidden states that start at position ``first`` and predict the key's tokens."""
    return slice(trial.answer_start - 1 - first, trial.context - 1 - first)


@torch.no_grad()
def _run_prefill(
    model, head, trial, schemes, calibrations, fused_mode, stats, clipped
) -> tuple[dict, dict, float, dict]:
    """Reference and scheme scores of one trial, prefill semantics (module docstring); decode counts are added to
    ``stats[name]``, what each scheme's cache clipped to ``clipped[name]``."""
    from transformers import DynamicCache

    from kvbits.evaluate.measures import add_clipping
    from kvbits.evaluate.stream import (
        _fused_attention,
        add_decode_counts,
        decode_hidden,
        fuses,
        load_kv,
        make_cache,
        prefill_kv,
    )

    dev = next(model.parameters()).device
    ids = trial.ids[None].to(dev)
    suffix = ids[:, trial.doc_len : trial.context - 1]  # every token after the document but the last
    targets = trial.ids[trial.answer_start :]
    rows = _key_slice(trial, trial.doc_len)
    t0 = time.perf_counter()
    _, kv = prefill_kv(model, ids[:, : trial.doc_len])
    ref_cache = DynamicCache(config=model.config)  # the model's own layer kinds: a sliding layer keeps W - 1 tokens
    load_kv(ref_cache, kv)
    lp_ref = _logprobs(head, decode_hidden(model, suffix, ref_cache)[0, rows]).cpu()
    ref = score_key(lp_ref, targets)
    ref["cache_bytes"] = cache_bytes(ref_cache)
    del ref_cache
    ref_seconds = time.perf_counter() - t0
    out, seconds = {}, {}
    for scheme in schemes:
        t0 = time.perf_counter()
        fused = not isinstance(scheme, PeerScheme) and fuses(model, fused_mode, dev)
        with _fused_attention(model) if fused else contextlib.nullcontext():
            # reserved for the context - 1 tokens the trial leaves in it: the same bytes at the end, no per-flush copy
            cache = make_cache(scheme, model, calibration=calibrations.get(scheme.name), fused_decode=fused,
                               max_cache_len=trial.context - 1, calibration_warnings=False)  # fmt: skip
            load_kv(cache, kv)
            lp = _logprobs(head, decode_hidden(model, suffix, cache)[0, rows]).cpu()
        out[scheme.name] = score_key(lp, targets, lp_ref)
        out[scheme.name]["cache_bytes"] = cache_bytes(cache)
        if not isinstance(scheme, PeerScheme):
            add_decode_counts(stats.setdefault(scheme.name, {}), cache.fused_report())
            add_clipping(clipped.setdefault(scheme.name, {}), cache)
        del cache
        seconds[scheme.name] = time.perf_counter() - t0
    return ref, out, ref_seconds, seconds


@torch.no_grad()
def _run_decode(model, head, trial, schemes, calibrations, chunk_size, clipped) -> tuple[dict, dict, float, dict]:
    """Reference and scheme scores of one trial, decode semantics (the simulator); what each scheme clipped is
    added to ``clipped[name]``."""
    from kvbits.evaluate.measures import add_counts
    from kvbits.evaluate.simulate import simulate

    base = base_model(model)
    dev = next(model.parameters()).device
    ids = trial.ids[None, :-1].to(dev)
    targets = trial.ids[trial.answer_start :]
    rows = _key_slice(trial, 0)
    t0 = time.perf_counter()
    lp_ref = _logprobs(head, base(input_ids=ids, use_cache=False).last_hidden_state[0, rows]).cpu()
    ref = score_key(lp_ref, targets)
    ref_seconds = time.perf_counter() - t0
    out, seconds = {}, {}
    for scheme in schemes:
        t0 = time.perf_counter()
        with simulate(model, scheme, calibration=calibrations.get(scheme.name), chunk_size=chunk_size) as sim:
            hidden = base(input_ids=ids, use_cache=False).last_hidden_state[0, rows]
        add_counts(clipped.setdefault(scheme.name, {}), sim.clipped)
        out[scheme.name] = score_key(_logprobs(head, hidden).cpu(), targets, lp_ref)
        seconds[scheme.name] = time.perf_counter() - t0
    return ref, out, ref_seconds, seconds


def _grid(records: list[dict], contexts: list[int], depths: list[float], pick) -> list[list[float | None]]:
    """``(contexts, depths)`` of the mean of ``pick(record)`` over each cell's trials."""
    return [
        [_mean([float(pick(r)) for r in records if r["context"] == c and r["depth"] == d]) for d in depths]
        for c in contexts
    ]


def scheme_result(
    name: str, bits: float, records: list[dict], contexts: list[int], depths: list[float]
) -> dict:
    """One scheme's summary from the trial records (module docstring)."""
    mine = [r["schemes"][name] for r in records]
    ref_hits = [r for r in records if r["reference"]["retrieved"]]
    by_context = []
    for c in contexts:
        rc = [r for r in records if r["context"] == c]
        sizes = [r["schemes"][name].get("cache_bytes") for r in rc]
        ref_sizes = [r["reference"].get("cache_bytes") for r in rc]
        by_context.append({
            "context": c,
            "trials": len(rc),
            "retrieved": _mean([r["schemes"][name]["retrieved"] for r in rc]),
            "retrieved_ref": _mean([r["reference"]["retrieved"] for r in rc]),
            "nll": _mean([r["schemes"][name]["nll"] for r in rc]),
            "nll_ref": _mean([r["reference"]["nll"] for r in rc]),
            "kl": _mean([r["schemes"][name]["kl"] for r in rc]),
            "cache_bytes": None if None in sizes else int(max(sizes)),
            "cache_bytes_ref": None if None in ref_sizes else int(max(ref_sizes)),
        })  # fmt: skip
    return {
        "scheme": name,
        "avg_bits": bits,
        "retrieved": _mean([m["retrieved"] for m in mine]),
        "kept": _mean([r["schemes"][name]["retrieved"] for r in ref_hits]) if ref_hits else None,
        "gained": sum(
            1 for r in records if r["schemes"][name]["retrieved"] and not r["reference"]["retrieved"]
        ),
        "token_acc": _mean([m["token_acc"] for m in mine]),
        "nll": _mean([m["nll"] for m in mine]),
        "delta_nll": _mean([r["schemes"][name]["nll"] - r["reference"]["nll"] for r in records]),
        "kl": _mean([m["kl"] for m in mine]),
        "by_context": by_context,
        "grid": _grid(records, contexts, depths, lambda r: r["schemes"][name]["retrieved"]),
    }


def reference_result(records: list[dict], contexts: list[int], depths: list[float]) -> dict:
    """The unquantized model's summary from the trial records: ``{"retrieved", "nll", "grid", "by_context"}``."""
    return {
        "retrieved": _mean([r["reference"]["retrieved"] for r in records]),
        "nll": _mean([r["reference"]["nll"] for r in records]),
        "grid": _grid(records, contexts, depths, lambda r: r["reference"]["retrieved"]),
        "by_context": [
            {
                "context": c,
                "retrieved": _mean([r["reference"]["retrieved"] for r in records if r["context"] == c]),
            }
            for c in contexts
        ],
    }


@runs_on_device
def needle_eval(
    model: Any,
    contexts: Sequence[int] | int,
    schemes: Sequence[str | dict | Any],
    *,
    data: Any = "war-and-peace",
    depths: Sequence[float] = DEFAULT_DEPTHS,
    trials: int = 1,
    task: NeedleTask | None = None,
    semantics: str = "prefill",
    calibration: Any = None,
    fused_decode: bool | str = "auto",
    data_path: str | None = None,
    dtype: str | torch.dtype | None = None,
    device: str | None = None,
    chunk_size: int = _DEFAULT_CHUNK,
    seed: int = 0,
    progress: bool = False,
    bos: str = "auto",
) -> dict[str, Any]:
    """Passkey retrieval of each scheme and of the unquantized model, by context length and depth.

    Args:
        model: registry name / path (``load_model``) or a ``LoadedModel``: the task writes text, so it
            needs the tokenizer, and a bare transformers module is refused.
        contexts: total tokens per trial (haystack, needle, question, key), one or several.
        schemes: kvbits schemes (names, dicts, JSON paths, objects) or peers (``hf-quanto-int4``;
            ``semantics="prefill"`` only).
        data: the haystack: a registered text (``war-and-peace``, ...), a file (a ``str`` or path-like), or a
            ``TextSource``; token ids are refused (the trials are built from text: sentence ends, the key's digits).
        depths: needle depths in [0, 1] of the haystack.
        trials: trials per (context, depth), each with its own key and haystack offset.
        task: the needle and question (default :class:`kvbits.evaluate.needle.NeedleTask`).
        semantics: ``"prefill"`` or ``"decode"`` (module docstring); ``"decode"`` (the simulator) is refused on a
            model whose attention block several layers share (Zamba; Zamba2 with a mixed scheme): ``"prefill"`` runs it.
        calibration: ``kvbits calibrate`` artifacts or folders for calibrated schemes, as ``evaluate``.
        fused_decode: prefill semantics: decode steps through the fused kernel (``"auto"``: on CUDA
            with Triton; ``True``, ``False``).
        data_path: a data root for registered texts.
        dtype, device: as ``evaluate``.
        chunk_size: queries per simulated attention chunk (decode semantics; another value than the default with
            ``semantics="prefill"`` is refused).
        seed: keys and haystack offsets, an int in ``[0, 2**32 - 1]``.
        progress: a progress bar on stderr.
        bos: ``"auto"`` (each trial starts with the tokenizer's BOS where ``tokenizer(text)`` adds one: Llama,
            Mistral, Gemma; SmolLM2 and Qwen2.5 add none), ``"always"`` or ``"never"``, as ``evaluate`` takes it: the
            BOS, then a haystack one token shorter. The summary's ``"bos"`` says what ran (``"always"`` / ``"never"``;
            a record without it: ``"never"``), and the tokens fingerprint names the BOS (``+bos<id>``), so runs with
            and without one do not merge.

    Returns:
        ``{"version", "task", "model", "data", "bos", "bos_token" and "bos_token_id" (with a BOS only), "semantics", "contexts", "depths", "trials", "seed",
        "fingerprint": {"model", "tokens"}, "reference": {"retrieved", "nll", "grid", "by_context"},
        "results": [{"scheme", "avg_bits", "retrieved", "kept", "gained", "token_acc", "nll",
        "delta_nll", "kl", "by_context": [...], "grid", "calibration", "seconds", "decode"}],
        "records": [one per trial: the trial, "reference" and "schemes" scores], "reference_seconds",
        "wall_seconds", "peak_rss_bytes", "date", "commit", "versions"}``. ``grid`` is ``(contexts, depths)`` of retrieved fractions.
        ``dtype``: the dtype the model ran in (``dtype`` when given, which the model is cast to; else the loaded
        model's own), as ``kvbits speed`` records it. ``kvbits eval`` records instead the ``dtype`` asked for (null:
        the model's own) in its hashed ``config.json`` request, which names stored runs before the model loads.
    """
    check_model_arg(model, "needle_eval")
    from kvbits.cache import attention_shape
    from kvbits.cache.fused import check_mode
    from kvbits.evaluate.calib_text import needle_text_record, warn_bos_mismatch, warn_calibrated_on_eval_text
    from kvbits.evaluate.data import (
        bos_record,
        check_bos,
        check_tokenized,
        resolve_bos,
        token_fingerprint,
        tokenize,
    )
    from kvbits.evaluate.inputs import (
        _check_before_loading,
        _data_arg,
        _load_checked_model,
        _model_arg,
        _run_dtype,
    )
    from kvbits.evaluate.measures import (
        _mismatch,
        _peak_rss_bytes,
        _warn_mismatch,
        long_run_avg_bits,
        model_dtype_bytes,
        plan_shape_of,
    )
    from kvbits.evaluate.metrics import LogitHead
    from kvbits.evaluate.outputs import _git_commit, _versions
    from kvbits.evaluate.runner import _check_head
    from kvbits.plan.config import check_context_fits

    task = task or NeedleTask()
    contexts = check_contexts(contexts)
    depths = check_depths(depths)
    resolved = resolve_schemes(schemes)
    _check_args(semantics, resolved, fused_decode, trials, chunk_size)
    chunk_size = int(chunk_size)
    seed = check_seed(seed)  # before the model loads; build_trials would refuse it only after
    check_bos(bos, model)
    fused_mode = check_mode(fused_decode)
    torch_dtype, dtype_name, calibrations = _check_before_loading(resolved, calibration, data_path, dtype, device)
    commit = _git_commit()  # the tree the run starts from (it may change while a long run goes on)

    text = _haystack(data, data_path)  # a wrong text fails before the model loads
    model_spec = model
    model, tokenizer, model_name, model_fp = _load_checked_model(
        model, torch_dtype, device, calibrations, lambda config: check_schemes_fit(resolved, config)
    )  # a scheme the config rules out (groups not dividing head_dim) is refused before the weights load
    if tokenizer is None:
        raise ValueError(
            "the retrieval task writes text, so it needs the model's tokenizer: pass a model name, path or "
            "LoadedModel (kvbits.evaluate.models.load_model) with one, not a bare transformers module or a "
            "model folder without tokenizer files"
        )
    bos_id = resolve_bos(tokenizer, bos)
    check_context_fits(model.config, contexts[-1])
    n_layers, _, kv_heads, head_dim = attention_shape(model.config)
    if semantics == "prefill":
        check_cache_holds(model, "semantics='prefill'")
    else:
        check_decode_simulates(model, resolved)
    check_schemes_fit(resolved, model.config)
    text_ids = tokenize(text, tokenizer)
    check_tokenized(text_ids, tokenizer, model, f"the haystack {text.name!r}")
    trial_list = build_trials(tokenizer, text_ids, contexts, depths, trials, task=task, seed=seed, bos_id=bos_id)
    for t in trial_list:  # the needle, question and key are tokenized too; on the host, before any forward
        check_tokenized(t.ids, tokenizer, model, f"trial {t.index} (context {t.context}, depth {t.depth:g})")
    head = LogitHead.from_model(model)
    _check_head(
        model, base_model(model), head, trial_list[0].ids[None, :64].to(next(model.parameters()).device)
    )
    # a calibration fitted on the haystack's text flatters its scheme's NLL and KL: said once before the run, recorded
    spans = [(t.offset, t.haystack_len) for t in trial_list]
    on_text = needle_text_record(calibrations, text, tokenizer, text_ids, spans)
    for name, rec in on_text.items():
        warn_calibrated_on_eval_text(name, calibrations[name], rec, 0, 0, total=sum(n for _, n in spans),
                                     what="haystack tokens of the trials")  # fmt: skip
    for name, art in calibrations.items():  # the BOS is the attention sink: scales fitted with or without it
        warn_bos_mismatch(name, art, "never" if bos_id is None else "always", served_as="this run's trials")

    from kvbits.evaluate.runner import _progress

    records: list[dict[str, Any]] = []
    seconds = {s.name: 0.0 for s in resolved}
    ref_seconds, stats = 0.0, {}
    clipped: dict[str, dict[str, int]] = {}  # per scheme, over all trials: as the simulator counts (add_clipping)
    t_wall = time.perf_counter()
    with _progress(progress, len(trial_list)) as bar:
        job = bar.add_task("needle", total=len(trial_list)) if bar is not None else None
        for trial in trial_list:
            if semantics == "prefill":
                ref, out, rs, ss = _run_prefill(model, head, trial, resolved, calibrations, fused_mode, stats, clipped)
            else:
                ref, out, rs, ss = _run_decode(model, head, trial, resolved, calibrations, chunk_size, clipped)
            ref_seconds += rs
            for name, s in ss.items():
                seconds[name] += s
            records.append({**trial.record(), "reference": ref, "schemes": out})
            logger.debug("needle %d tokens, depth %.2f, trial %d: reference %s, %s", trial.context, trial.depth,
                         trial.index, ref["retrieved"], {n: o["retrieved"] for n, o in out.items()})  # fmt: skip
            if bar is not None:
                bar.update(job, advance=1, description=f"needle {trial.context} @ {trial.depth:.2f}")
    wall = time.perf_counter() - t_wall

    results = []
    shape = plan_shape_of(model.config, model)
    for scheme in resolved:
        bits = long_run_avg_bits(scheme, shape, head_dim, kv_heads, n_layers, dtype_bytes=model_dtype_bytes(model))
        res = scheme_result(scheme.name, bits, records, contexts, depths)
        res["calibration"] = _mismatch(
            clipped.get(scheme.name, {}), calibrations.get(scheme.name), contexts[-1],
            "simulate" if semantics == "decode" else "stream", scheme,
        )
        _warn_mismatch(scheme.name, res["calibration"], contexts[-1])
        if res["calibration"] is not None and scheme.name in on_text:
            res["calibration"].update(on_text[scheme.name])
        res["seconds"] = seconds[scheme.name]
        res["decode"] = stats.get(scheme.name)
        results.append(res)
    reference = reference_result(records, contexts, depths)
    return {
        "version": NEEDLE_VERSION,
        "task": task.to_dict(),
        "model": _model_arg(model_spec, model_name),
        "data": _data_arg(os.fspath(data) if isinstance(data, os.PathLike) else data, text.name),
        **bos_record(tokenizer, bos_id),  # "bos", and with a BOS its "bos_token" / "bos_token_id"
        "semantics": semantics,
        "dtype": _run_dtype(model, dtype_name),
        "contexts": contexts,
        "depths": depths,
        "trials": int(trials),
        "seed": int(seed),
        "fingerprint": {
            "model": model_fp,
            "tokens": token_fingerprint(text, tokenizer) + ("" if bos_id is None else f"+bos{bos_id}"),
        },
        "reference": reference,
        "results": results,
        "records": records,
        "reference_seconds": ref_seconds,
        "wall_seconds": wall,
        "peak_rss_bytes": _peak_rss_bytes(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit,
        "versions": _versions(),
    }
