"""The evaluation runner: text -> windows -> reference and scheme runs -> per-token records -> buckets.

``evaluate(model, data, context, schemes, ...)`` returns the summary (the JSON of ``kvbits eval
--json``). The reference (the unquantized model, a plain forward) is computed once per window and
shared by every scheme; each scheme runs either through the one-pass simulator (``mode="simulate"``)
or the real cache token by token (``mode="stream"``, the ground truth; slow).

With ``out_dir`` the run is written as::

    DIR/config.json                 arguments, fingerprints, versions, git commit, date, config_hash
    DIR/summary.json                the summary
    DIR/records.jsonl               one line per scheme x window x bucket: sums of nll, nll_ref, kl, top1
    DIR/tokens/<scheme>.safetensors per-token nll, nll_ref, kl, top1, float32 (W, T - 1)
    DIR/generations.jsonl           with generate=N: each window's greedy continuations (reference, schemes)
    DIR/DONE                        the config hash, written last

This module is the loop; the rest is beside it: :mod:`.request` (arguments, identity, config hash),
:mod:`.inputs` (model, windows, calibrations), :mod:`.outputs` (the folder above, the report) and
:mod:`.measures` (calibration mismatch, peak memory). A rerun with the same configuration finds ``DONE`` and returns the stored summary without loading
the model (``overwrite=True`` recomputes); a folder written by another configuration is refused.
Batch = 1, unpadded windows: perplexity windows are raw slices of one text.

Data-parallel (``torch.distributed``): where a default process group with more than one rank is
initialized (``torchrun``; ``kvbits eval`` initializes one itself under torchrun) and
``distributed`` is not False, every rank calls ``evaluate`` with the same arguments, loads the model
(``device="cuda"`` becomes ``cuda:$LOCAL_RANK``) and evaluates the windows ``w % world == rank``
(a rank with none still joins every collective). The per-window math is unchanged: the ranks'
per-token arrays and attention errors are combined bit for bit, clipping and decode counts summed,
so every rank returns the summary a single process would, with these differences: ``seconds`` and
``reference_seconds`` are compute time summed over the ranks, ``wall_seconds`` is the slowest
rank's loop over its windows, the memory peaks are the largest rank's (each rank holds the whole
model), and ``world_size`` says how many ranks ran. Rank 0 alone reads and writes ``out_dir``,
shows progress and logs the results; the others wait for its decisions (reuse a stored run, refuse
another one), and every rank returns once the run is on disk. The rank count is not part of the
config hash: a folder written by two ranks is reused by one process and vice versa
(``config.json`` records ``world_size``). An exception on one rank is raised on all of them at the
end of the phase it happened in (:mod:`.distributed`); the group's timeout must cover the longest
wait of one rank for another (about one window: ``kvbits eval`` sets 24 hours, torch's default is
30 minutes for gloo, 10 for NCCL).

Logits come from the final hidden states through ``metrics.LogitHead`` (the output embedding plus
the family's post-processing: Gemma's soft-cap, Granite's ``logits_scaling``, Cohere's
``logit_scale``); once per run they are checked against the model's own logits on a prefix of the
first window, and a model whose forward does something else is refused rather than mis-measured.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvbits._argtypes import runs_on_device
from kvbits._files import write_text_atomic
from kvbits._json import dumps
from kvbits._model import attending_layers, attention_modules, check_model_arg, shared_attention_note
from kvbits._spelling import spell
from kvbits.evaluate.calib_text import (
    calibrated_on_eval_text,
    warn_bos_mismatch,
    warn_calibrated_on_eval_text,
    warn_stored,
)
from kvbits.evaluate.data import bos_record, check_bos, load_text
from kvbits.evaluate.distributed import kept_cuda_device, resolve_ranks
from kvbits.evaluate.generation import (
    check_can_generate,
    check_generate,
    continuations,
    generation_log_text,
    generation_summary,
)
from kvbits.evaluate.inputs import (
    _calibration_paths,
    _check_before_loading,
    _data_arg,
    _load_checked_model,
    _load_windows,
    _model_arg,
    check_data_arg,
    check_int,
    check_layer_indices,
)
from kvbits.evaluate.measures import (
    _mismatch,
    _peak_cuda_bytes,
    _peak_rss_bytes,
    _reset_peak_rss,
    _run_peak_rss_bytes,
    _warn_length_dependent_rope,
    _warn_mismatch,
    _warn_unquantized,
    _with_generation,
    add_clipping,
    add_counts,
    floating_dtype,
    long_run_avg_bits,
    model_dtype_bytes,
    plan_shape_of,
)
from kvbits.evaluate.metrics import (
    TOKEN_FIELDS,
    LogitHead,
    attn_entropy_buckets,
    attn_error_buckets,
    bucket_records,
    check_logit_head,
    summarize,
    token_metrics,
)
from kvbits.evaluate.outputs import (
    _check_out_dir,
    _prepare_out_dir,
    _run_config,
    _write_generations,
    _write_outputs,
    _write_report,
)
from kvbits.evaluate.request import (
    MODES,
    OUTPUT_VERSION,
    _check_args,
    _request,
    _scheme_name,
    config_hash,
    default_attn_layers,
)
from kvbits.evaluate.simulate import DEFAULT_CHUNK as _DEFAULT_CHUNK
from kvbits.evaluate.simulate import simulate
from kvbits.evaluate.stream import (
    PeerScheme,
    base_model,
    cache_bytes,
    check_schemes_fit,
    resolve_schemes,
    stream_hidden,
)
from kvbits.plan.config import check_context_fits
from kvbits.schemes.spec import KVScheme

logger = logging.getLogger(__name__)

__all__ = ["MODES", "OUTPUT_VERSION", "config_hash", "default_attn_layers", "evaluate"]


def _progress(enabled: bool, total: int):
    if not enabled:
        return nullcontext(None)
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=False,
    )


def _say_progress(bar: Any, task: Any, what: str, since: float, label: str = "kvbits eval") -> None:
    """One plain line on the progress bar's console (stderr) for each new stage (``what``: "window 1/2: kivi-2"),
    with the units done and the seconds since ``since``: where stderr is not a terminal, rich draws nothing until
    the bar ends, and a stream-mode run (~0.14 s per token and scheme for SmolLM2-135M on one CPU core) said
    nothing for minutes. ``label`` names the command that runs the evaluation (``kvbits tune``'s passes said
    ``kvbits eval:``)."""
    t = next(x for x in bar.tasks if x.id == task)
    bar.console.print(
        f"{label}: {what} ({int(t.completed)}/{int(t.total or 0)} token passes done, "
        f"{time.perf_counter() - since:.0f} s)",
        markup=False, highlight=False, soft_wrap=True,
    )  # fmt: skip


@torch.no_grad()
def _hidden_plain(base: Any, ids: torch.Tensor) -> torch.Tensor:
    return base(input_ids=ids, use_cache=False).last_hidden_state


# positions of the first window on which the metrics' logits are checked against the model's own
_HEAD_CHECK_TOKENS = 64


@torch.no_grad()
def _check_head(model: Any, base: Any, head: LogitHead, ids: torch.Tensor) -> None:
    """Once per run: the logits the metrics compute from the final hidden states (``head``) must be
    the model's own on a short prefix ``ids`` ``(1, n)``; a family post-processing its logits in a way
    ``LogitHead`` does not know would otherwise bias every PPL and KL silently."""
    logits = model(input_ids=ids, use_cache=False).logits[0]
    hidden = _hidden_plain(base, ids)[0]
    exact = floating_dtype(model) in (torch.float32, torch.float64)
    try:
        err = check_logit_head(head, hidden, logits, tolerance=1e-3 if exact else 3e-2)
    except RuntimeError as exc:
        raise RuntimeError(f"{type(model).__name__}: {exc}") from None
    logger.debug("logits from the final hidden states match the model's (relative difference %.2g)", err)


def _reused(
    stored: dict[str, Any], calibrations: dict[str, Any], data: Any, data_path: str | None,
    on_skip: Callable[[dict[str, Any]], None] | None, main: bool,
) -> dict[str, Any]:
    """``stored``, a finished run ``--out`` holds, reused rather than rerun: said as a run would say it (rank 0:
    ``calib_text.warn_stored``, a calibration cut with another BOS choice than the run's windows
    (``calib_text.warn_bos_mismatch``; a run stored before ``--bos``: no BOS), and each result's clipping /
    beyond-calibration), then ``on_skip(stored)``. ``main``: whether this is rank 0."""
    if main:
        warn_stored(stored, calibrations, data, data_path)
        for name, art in calibrations.items():  # as the live run warns (evaluate, after _load_windows)
            warn_bos_mismatch(name, art, "always" if stored.get("bos") == "always" else "never")
        for res in stored.get("results") or []:
            if isinstance(res, dict) and isinstance(res.get("calibration"), dict):
                _warn_mismatch(str(res.get("scheme")), res["calibration"], int(stored.get("context") or 0))
    if on_skip:
        on_skip(stored)
    return stored


@runs_on_device
@kept_cuda_device()  # a rank's Ranks.device makes its device current; the caller's is current again after
def evaluate(
    model: Any,
    data: Any,
    context: int,
    schemes: Sequence[str | dict | KVScheme | PeerScheme],
    windows: int = 1,
    mode: str = "simulate",
    semantics: str = "decode",
    prompt_len: int | None = None,
    attn_layers: Sequence[int] | None = None,
    *,
    calibration: Any = None,
    data_path: str | None = None,
    out_dir: str | os.PathLike[str] | None = None,
    overwrite: bool = False,
    dtype: str | torch.dtype | None = None,
    device: str | None = None,
    chunk_size: int = _DEFAULT_CHUNK,
    seed: int = 0,
    progress: bool = False,
    argv: Sequence[str] | None = None,
    on_skip: Callable[[dict], None] | None = None,
    fused_decode: bool | str = "auto",
    distributed: bool | None = None,
    generate: int = 0,
    on_pass: Callable[[int, int, str], None] | None = None,
    progress_label: str = "kvbits eval",
    bos: str = "auto",
) -> dict[str, Any]:
    """Measure each scheme against the unquantized model, by position bucket.

    Args:
        model: registry name / path (``load_model``), a ``LoadedModel``, or a transformers causal LM.
        data: text spec (``load_text``; a path-like as its path), a ``TextSource``, or token ids ``(N,)`` /
            ``(W, context)``: an integer tensor or NumPy array (``check_data_arg``).
        context: tokens per window.
        schemes: kvbits schemes (names, dicts, JSON paths, objects) or peers (``hf-quanto-int4``).
        windows: how many windows (fewer if the text is shorter; the summary says how many ran).
        mode: ``"simulate"`` (one pass per window) or ``"stream"`` (the cache, token by token).
        semantics: ``"decode"`` or ``"prefill"`` (needs ``prompt_len``; only positions
            ``t >= prompt_len`` are scored).
        attn_layers: layers whose attention-output error and attention entropy are recorded
            (simulate mode only: a list with ``mode="stream"`` is refused); default three evenly
            spaced layers among those with attention (a hybrid model's convolution, linear-attention or
            state-space layers have none, and are refused in a list); ``[]`` for none.
        calibration: ``kvbits calibrate`` artifacts (objects or folders) for schemes with static scales
            or NUQ codebooks, matched to schemes by the scheme each was made for; or a mapping
            scheme name -> artifact.
        data_path: a data root for registry texts.
        out_dir: write the run there (see the module docstring).
        overwrite: recompute even when ``out_dir`` holds this run, or another one; write into a
            non-empty folder kvbits did not write (only the files a run writes are replaced there).
        dtype: model dtype (``"float32"``, ``"bfloat16"``) when loading or converting the model.
        device: ``"cpu"`` or ``"cuda"`` (``"cuda:N"``); refused when this torch can not use it.
        chunk_size: queries per attention chunk in the simulator (an int >= 1; ``mode="simulate"`` only:
            another value with ``mode="stream"``, which never runs the simulator, is refused).
        seed: bootstrap seed, an int >= 0.
        progress: show a rich progress bar on stderr.
        argv: the command line, recorded in ``config.json``.
        on_skip: called with the stored summary when a finished run is reused.
        fused_decode: stream mode: decode steps through the fused kernel (``"auto"``: where the cache
            would pick it, CUDA with Triton; ``True``, ``False``); see ``kvbits.evaluate.stream``.
        distributed: data-parallel over ``torch.distributed`` (see the module docstring). None: when a
            default process group with more than one rank is initialized; True: it must be
            initialized; False: this process evaluates every window, whatever the group. Every rank
            must call ``evaluate`` with the same arguments; every rank returns the same summary.
        generate: after scoring each window, greedily generate this many new tokens from the whole
            window as the prompt, with the unquantized model (``DynamicCache``) and with each scheme's
            real cache, and compare the continuations (:mod:`.generation`: rep-n, agreement, first
            divergence); 0 (the default) generates nothing. Any mode; under ranks each rank
            generates for its own windows.
        on_pass: called as ``on_pass(window, windows, scheme_name)`` after each scheme's pass over a window
            (this rank's windows; ``windows`` those the run measures): a caller's progress without the bar
            (``kvbits tune`` logs one line per probed layer); not called for a stored run that is reused.
        progress_label: the command the bar's plain lines on a non-terminal stderr name (``"kvbits tune"``).
        bos: ``"auto"`` (each window starts with the tokenizer's BOS where ``tokenizer(text)`` adds one: Llama,
            Mistral, Gemma; SmolLM2 and Qwen2.5 add none), ``"always"`` or ``"never"``; with a BOS a window is the BOS
            and ``context - 1`` text tokens, the BOS not scored (``data.resolve_bos``, ``data.make_windows``). Token
            ids given as ``data`` get a BOS only with ``"always"`` (``(N,)`` ids; ``(W, context)`` rows are refused).
            The summary's ``"bos"`` says what ran (``"always"`` / ``"never"``; a record without it: ``"never"``).

    Returns:
        The summary: ``{"model", "data", "context", "semantics", "mode", "windows", "fingerprint":
        {"model", "tokens"}, "results": [...], "reference_seconds", "wall_seconds", "world_size",
        "peak_rss_bytes", "run_peak_rss_bytes", "peak_cuda_bytes"}`` (see ``kvbits eval --help``).
        ``wall_seconds`` is the time of the loop over the windows (the slowest rank's when
        distributed); ``world_size`` the number of ranks that evaluated (1 alone).
        ``run_peak_rss_bytes`` is the resident peak from the end of model loading to the end of the
        run (Linux ``VmHWM`` after ``/proc/self/clear_refs``; the weights included, the loading not;
        None elsewhere); ``peak_rss_bytes`` is the process's peak
        resident set (``getrusage`` ``ru_maxrss`` in bytes; everything the process did before the run
        included; None where unavailable); ``peak_cuda_bytes`` is ``torch.cuda.max_memory_allocated``
        over the run (its peak counter is reset once the model is loaded; it counts the weights and
        what the run adds, not the loading) on CUDA, None otherwise.
    """
    ranks = resolve_ranks(distributed)
    # the argument checks run inside agreement steps too: a torchrun script that passes a rank its own (wrong)
    # argument raised on that rank only, and the others waited in the next collective for the collective timeout
    # (24 h under kvbits eval); now every rank raises at once (alone: the same errors as before)
    with ranks.agree("checking its arguments"):
        check_model_arg(model, "evaluate")
        data = check_data_arg(data)  # a NumPy array or a path was refused only once the model had loaded
        generate = check_generate(generate)
        seed = check_int("seed", seed, 0)  # numpy's bootstrap refused a negative one only after every window had run
        # simulate() refused a bad one only after the model loaded and the first reference pass ran
        chunk_size = check_int("chunk_size", chunk_size, 1)
        check_bos(bos, model)
    # a scheme JSON path is read from this rank's own disk: a file missing on one node only would leave the other
    # ranks waiting in the next collective for the collective timeout (24 h under kvbits eval)
    with ranks.agree("reading its scheme files"):
        resolved = resolve_schemes(schemes)
    with ranks.agree("checking its arguments"):
        # numpy's ints, as check_int takes them: prompt_len was refused as out of range, context and windows as not ints
        # ("context must be an int >= 2, got np.int64(32)"); as Python ints they also hash as the same run
        context, windows, prompt_len = (int(x) if isinstance(x, np.integer) else x for x in (context, windows, prompt_len))
        _check_args(context, windows, mode, semantics, prompt_len, resolved)
        if attn_layers is not None:  # int(0.7) would have measured layer 0 without a word
            attn_layers = check_layer_indices("attn_layers", attn_layers)
        stream_mode, simulate_mode = spell("mode='stream'", "--mode stream"), spell("mode='simulate'", "--mode simulate")
        if mode == "stream" and attn_layers:
            raise ValueError(
                f"{spell(f'attn_layers={list(attn_layers)}', '--attn-layers')} needs {simulate_mode}: the "
                f"attention-output error compares the simulator's exact and quantized attention, which {stream_mode} does not run; "
                + spell("leave attn_layers unset or []", "leave --attn-layers out")
            )
        if mode != "stream" and fused_decode != "auto":
            raise ValueError(
                f"{spell(f'fused_decode={fused_decode!r}', f'--fused-decode {fused_decode}')} needs {stream_mode}: "
                f"{spell(f'mode={mode!r}', f'--mode {mode}')} never decodes through the cache, so the setting would be "
                f"ignored; leave it {spell(repr('auto'), 'out')} or use {stream_mode}"
            )
        if mode == "stream" and chunk_size != _DEFAULT_CHUNK:
            raise ValueError(
                f"{spell(f'chunk_size={chunk_size}', f'--chunk-size {chunk_size}')} needs {simulate_mode}: it sets the "
                f"simulator's queries per attention chunk, and {stream_mode} decodes token by token through the cache, "
                f"so the setting would be ignored; leave it at {_DEFAULT_CHUNK}{spell('', ' (no --chunk-size)')} or use "
                f"{simulate_mode}"
            )
    # what each rank reads from its own node (data_path, calibration files, its GPU) may fail on one rank only: agreed
    # on, or the others would wait in the next collective for the collective timeout (24 h under kvbits eval)
    with ranks.agree("checking its data path, calibrations and device"):
        torch_dtype, dtype_name, calibrations = _check_before_loading(resolved, calibration, data_path, dtype, device)
        load_device = ranks.device(device)  # cuda -> cuda:$LOCAL_RANK on a rank (made current for NCCL)
    # the run's identity hashes this rank's own model folder and text file: a folder incomplete on one node only
    # (no config.json yet) raised there, and the others waited in check_same for the collective timeout
    with ranks.agree("hashing its model and data files"):
        request = _request(
            model=model,
            data=data,
            context=context,
            windows=windows,
            schemes=resolved,
            mode=mode,
            semantics=semantics,
            prompt_len=prompt_len,
            attn_layers=attn_layers,
            data_path=data_path,
            dtype_name=dtype_name,
            device=device,
            chunk_size=chunk_size,
            seed=seed,
            calibrations=calibrations,
        )
        if mode == "stream":  # simulate never attends through the cache: its runs keep their hash
            from kvbits.cache.fused import check_mode

            request["fused_decode"] = check_mode(fused_decode)
        if generate:  # runs without generation keep the hash they had before it existed
            request["generate"] = generate
        if bos != "auto":  # runs with the default keep their hash: the model (tokenizer included) is by content,
            request["bos"] = bos  # so "auto" resolves the same way for the same request
        # the rank count is not part of the request: any number of ranks computes the same run
        chash = config_hash(request)
    # a rank's device and data folder may be its own (cuda:1, another mount); the rest is one run's
    ranks.check_same("run", {k: v for k, v in request.items() if k not in ("device", "data_path")})
    out = Path(out_dir) if out_dir is not None else None
    legacy = None  # a run stored before --bos that "auto" may reuse (decided once the tokenizer is known)
    if out is not None:
        # rank 0 alone reads the folder; every rank follows its decision (reuse, refuse or run)
        stored = ranks.from_main(_check_out_dir, out, chash, overwrite, request)
        # a run stored before --bos records no "bos" and had raw slices; "auto" keeps its hash, but a tokenizer that
        # adds a BOS resolves to one: known once the tokenizer loads, so that decision is made below
        legacy = stored if stored is not None and bos == "auto" and "bos" not in stored and not isinstance(
            data, torch.Tensor) else None
        if stored is not None and legacy is None:
            return _reused(stored, calibrations, data, data_path, on_skip, ranks.main)

    with ranks.agree("loading the model and the text"):
        # the text before the model: a wrong data spec fails in a moment, not after the weights load
        text = load_text(data, data_path) if isinstance(data, str) else data
        model_spec = model
        model, tokenizer, model_name, model_fp = _load_checked_model(
            model, torch_dtype, load_device, calibrations, lambda config: check_schemes_fit(resolved, config)
        )  # a scheme the config rules out (groups not dividing head_dim) is refused before the weights load
        win, data_name, tokens_fp, bos_id = _load_windows(text, tokenizer, context, windows, data_path, model, bos)
        if legacy is not None:
            if bos_id is None:  # raw slices, as the stored run had: reused (at the cost of the model load)
                return _reused(legacy, calibrations, data, data_path, on_skip, ranks.main)
            if ranks.main:
                logger.warning("%s holds this run made before --bos, without a BOS; the tokenizer adds one (bos "
                               "'auto' resolves to 'always'): recomputing it", out)
        from kvbits.cache import attention_shape

        n_layers, _, kv_heads, head_dim = attention_shape(model.config)
        check_schemes_fit(resolved, model.config)
        if generate:
            check_can_generate(model)
        if ranks.main:
            check_context_fits(model.config, context + generate)
        # a hybrid model's convolution / linear-attention / Mamba layers have no attention to measure: the
        # default (0, middle, last) picked LFM2's conv layers 0 and 2 and reported their error and entropy as 0
        attending = attending_layers(model, n_layers)
        shared = shared_attention_note(model)
        if shared and mode == "simulate" and not attention_modules(model):  # Zamba: no layer_idx to simulate by
            raise ValueError(f"evaluate: mode='simulate': {shared}")
        calibrated = [  # what the simulator would look up by the calling layer's index (-1 on Zamba2)
            s.name for s in resolved if isinstance(s, KVScheme)
            and (s.needs_calibration() or (s.calibratable() and calibrations.get(_scheme_name(s)) is not None))
        ]  # fmt: skip
        if shared and mode == "simulate" and calibrated:  # Zamba2: the simulator ran them without their artifact
            raise ValueError(
                f"evaluate: mode='simulate': schemes {calibrated} take calibrated parameters per layer, which the "
                f"simulator can not match to the calling layer: {shared}"
            )
        if shared and attn_layers:  # it said 'have no attention (... state-space layers ...)'
            raise ValueError(f"{spell(f'attn_layers={list(attn_layers)}', '--attn-layers')}: {shared}")
        if shared and mode == "simulate" and attn_layers is None:  # Zamba2: the default measured nothing silently
            logger.warning("evaluate: no attention error / entropy is recorded (attn_error, attn_entropy stay empty): %s",
                           shared)
        if attn_layers is None:
            layers = [attending[i] for i in default_attn_layers(len(attending))]
        else:
            layers = sorted({int(x) for x in attn_layers})
        if any(not 0 <= x < n_layers for x in layers):
            raise ValueError(f"{spell('attn_layers', '--attn-layers')} must be in [0, {n_layers}), got "
                             f"{list(attn_layers or [])}")
        if set(layers) - set(attending):
            raise ValueError(
                f"attn_layers {sorted(set(layers) - set(attending))} have no attention (convolution, linear-attention "
                f"or state-space layers of a hybrid model: no K/V, nothing to measure); layers with attention: "
                f"{attending}"
            )
        if mode == "stream":
            layers = []  # the attention error needs the simulator's two attention paths
        base = base_model(model)
        dev = next(model.parameters()).device
        if dev.type == "cuda" and torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats(dev)  # the run's peak: the weights, then what the run adds
        rss_reset = _reset_peak_rss()  # likewise for host memory (Linux)
        W, T = win.shape
        first = prompt_len if semantics == "prefill" else 0
        names = [_scheme_name(s) for s in resolved]
        fingerprint = {"model": model_fp, "tokens": tokens_fp}
        head = LogitHead.from_model(model)
        _check_head(model, base, head, win[:1, :_HEAD_CHECK_TOKENS].to(dev))
        if ranks.main:  # said before the run: a scheme whose buffer holds the whole window measures nothing
            for scheme in resolved:
                if not isinstance(scheme, PeerScheme):
                    _warn_unquantized(model, scheme, T)
            _warn_length_dependent_rope(model, T, mode)
        # a calibration fitted on the text scored flatters its scheme: recorded per scheme, said once before the run
        on_eval_text = calibrated_on_eval_text(calibrations, text, tokenizer, W, T, bos=bos_id is not None)
        if ranks.main:  # with a BOS the text scored is W * (T - 1) tokens (the BOS is no text token)
            for name, rec in on_eval_text.items():
                warn_calibrated_on_eval_text(name, calibrations[name], rec, W, T, total=W * (T - (bos_id is not None)))
            for name, art in calibrations.items():  # the BOS is the attention sink: scales fitted with or without it
                warn_bos_mismatch(name, art, "never" if bos_id is None else "always")
    if out is not None:
        # every rank's inputs are loaded and checked: now the old run may go (rank 0 alone writes)
        with ranks.agree("preparing the output folder"):
            if ranks.main:
                _prepare_out_dir(out, names)
                # the arguments as `kvbits eval` takes them (the report rebuilds the command line from
                # them when the run was started from Python): specs as given, not the names they resolved to
                args = {
                    "model": _model_arg(model_spec, model_name),
                    "data": _data_arg(data, data_name),
                    "context": context,
                    "windows": windows,
                    "schemes": [s if isinstance(s, str) else n for s, n in zip(schemes, names)],
                    "mode": mode,
                    "semantics": semantics,
                    "prompt_len": prompt_len,
                    "attn_layers": layers,
                    "dtype": dtype_name,
                    "device": device,
                    "data_path": data_path,
                    "calibration": _calibration_paths(calibration),
                    "chunk_size": chunk_size,
                    "seed": seed,
                    "generate": generate or None,
                    "bos": bos,
                    "fused_decode": (
                        {True: "on", False: "off"}.get(request["fused_decode"], "auto")
                        if mode == "stream"
                        else None
                    ),
                }
                config = _run_config(chash, request, args, argv, fingerprint, W, world_size=ranks.world)
                write_text_atomic(out / "config.json", dumps(config, indent=2) + "\n")

    # one buffer per kind, (scheme, field/layer, window, position): a rank fills its windows' rows, the
    # others stay zero until Ranks.assemble combines them
    tok = np.zeros((len(names), len(TOKEN_FIELDS), W, T - 1), dtype=np.float32)
    per_token = {n: {k: tok[i, j] for j, k in enumerate(TOKEN_FIELDS)} for i, n in enumerate(names)}
    att = np.zeros((len(names), len(layers), W, T), dtype=np.float32)
    attn_err = {n: {layer: att[i, j] for j, layer in enumerate(layers)} for i, n in enumerate(names)}
    # attention entropy, (scheme, layer, quantized / exact K/V, window, position)
    ent = np.zeros((len(names), len(layers), 2, W, T), dtype=np.float32)
    # greedy continuations, (reference + schemes, window, new token)
    gen = np.zeros((1 + len(names), W, generate), dtype=np.int64)
    gen_seconds = [0.0] * (1 + len(names))
    seconds = dict.fromkeys(names, 0.0)
    # stream mode, kvbits schemes: decode steps attended by the fused kernel / after a fallback
    decode: dict[str, dict[str, int] | None] = {
        n: ({} if mode == "stream" and not isinstance(s, PeerScheme) else None)
        for n, s in zip(names, resolved)
    }
    clipped: dict[str, dict[str, int]] = {n: {} for n in names}
    # peers (stream mode): the bytes their cache holds once a window is through (every window the same shape)
    peer_bytes: dict[str, int | None] = dict.fromkeys(names)
    ref_seconds = 0.0
    mine = ranks.windows(W)
    units = len(mine) * (T + generate) * (1 + len(names))
    with ranks.agree("evaluating its windows"), _progress(progress and ranks.main, units) as bar:
        task = bar.add_task("evaluating", total=units) if bar is not None else None

        def advance(n: int, what: str | None = None) -> None:
            if bar is not None:
                bar.update(task, advance=n, description=what) if what else bar.update(task, advance=n)
                if what and not bar.console.is_terminal:  # a log file or a pipe: rich draws the bar once, at the end
                    _say_progress(bar, task, what, t_loop, progress_label)

        t_loop = time.perf_counter()
        for w in mine:
            ids = win[w : w + 1].to(dev)
            t0 = time.perf_counter()
            h_ref = _hidden_plain(base, ids)[0]
            if not bool(torch.isfinite(h_ref).all()):
                raise RuntimeError(
                    f"non-finite hidden states of the unquantized model in window {w} (NaN/inf in its weights or "
                    "inputs, before any KV scheme): nothing to measure a scheme against"
                )
            ref_seconds += time.perf_counter() - t0
            advance(T, f"window {w + 1}/{W}: reference")
            hs = []
            for i, (scheme, name) in enumerate(zip(resolved, names)):
                advance(0, f"window {w + 1}/{W}: {name}")
                t0 = time.perf_counter()
                if mode == "simulate":
                    with simulate(
                        model,
                        scheme,
                        semantics=semantics,
                        prompt_len=prompt_len,
                        attn_layers=layers,
                        chunk_size=chunk_size,
                        calibration=calibrations.get(name),
                    ) as sim:
                        h = _hidden_plain(base, ids)[0]
                    if sim.calls == 0:
                        raise RuntimeError(
                            f"{type(model).__name__}: the simulated attention was never called"
                        )
                    add_counts(clipped[name], sim.clipped)
                    for j, layer in enumerate(layers):
                        if layer not in sim.attn_error:  # its zeros would read as "no error, no entropy"
                            raise RuntimeError(
                                f"{type(model).__name__}: layer {layer}'s attention was not simulated, so its "
                                "attention error and entropy can not be measured (attn_layers)"
                            )
                        attn_err[name][layer][w] = sim.attn_error[layer][0].cpu().numpy()
                        ent[i, j, 0, w] = sim.attn_entropy[layer][0].cpu().numpy()
                        ent[i, j, 1, w] = sim.attn_entropy_ref[layer][0].cpu().numpy()
                    advance(T)
                else:
                    caches: list[Any] = []
                    h = stream_hidden(
                        model,
                        ids,
                        scheme,
                        semantics=semantics,
                        prompt_len=prompt_len,
                        progress=advance,
                        calibration=calibrations.get(name),
                        fused_decode=fused_decode,
                        stats=decode[name],
                        on_cache=caches.append,
                        calibration_warnings=False,  # said once per run, below (_warn_mismatch)
                    )[0]
                    for cache in caches:  # what the real cache clipped, counted as the simulator counts
                        add_clipping(clipped[name], cache)
                        if isinstance(scheme, PeerScheme):
                            peer_bytes[name] = cache_bytes(cache)
                    del caches
                seconds[name] += time.perf_counter() - t0
                if not bool(torch.isfinite(h).all()):
                    raise RuntimeError(
                        f"{name}: non-finite hidden states in window {w} (NaN/inf in the model or K/V)"
                    )
                if on_pass is not None:
                    on_pass(w, W, name)
                hs.append(h[:-1])
            metrics = token_metrics(head, h_ref[:-1], hs, win[w, 1:])
            for name, rec in zip(names, metrics):
                for k in TOKEN_FIELDS:
                    per_token[name][k][w] = rec[k].numpy()
            if generate:
                advance(0, f"window {w + 1}/{W}: generating {generate} tokens")
                outs, secs = continuations(
                    model, ids, generate, resolved, calibrations=calibrations, fused_decode=fused_decode
                )
                for g, (o, sec) in enumerate(zip(outs, secs)):
                    gen[g, w] = o.cpu().numpy()
                    gen_seconds[g] += sec
                advance(generate * (1 + len(names)))
        loop_seconds = time.perf_counter() - t_loop

    ranks.assemble(tok)
    ranks.assemble(att)
    ranks.assemble(ent)
    ranks.assemble(gen)
    run_rss = _run_peak_rss_bytes(rss_reset)
    local = {
        "clipped": clipped,
        "decode": decode,
        "peer_bytes": peer_bytes,
        "seconds": seconds,
        "reference_seconds": ref_seconds,
        "generation_seconds": gen_seconds,
        "loop_seconds": loop_seconds,
        "peak_rss_bytes": max(
            (x for x in (_peak_rss_bytes(), rss_reset, run_rss) if x is not None), default=None
        ),
        "run_peak_rss_bytes": run_rss,
        "peak_cuda_bytes": _peak_cuda_bytes(dev),
    }
    run = _combine(ranks.gather(local), names)
    clipped, decode, seconds = run["clipped"], run["decode"], run["seconds"]
    if ranks.main:
        logger.info(
            "reference: %.1f s for %d window(s) of %d tokens%s",
            run["reference_seconds"],
            W,
            T,
            f" (summed over {ranks.world} ranks)" if ranks.active else "",
        )

    results, records = [], []
    shape = plan_shape_of(model.config, model)  # full precision in the dtype the model runs in
    for i, (scheme, name) in enumerate(zip(resolved, names)):
        s = summarize(per_token[name], first=first, seed=seed)
        bits = long_run_avg_bits(scheme, shape, head_dim, kv_heads, n_layers, dtype_bytes=model_dtype_bytes(model))
        results.append(
            {
                "scheme": name,
                "avg_bits": bits,
                "bits_at_context": _bits_at_context(shape, scheme, T, run["peer_bytes"][name], model.config),
                "ppl": s["ppl"],
                "ppl_ref": s["ppl_ref"],
                "kl": s["kl"],
                "top1": s["top1"],
                "buckets": s["buckets"],
                "attn_error": attn_error_buckets(attn_err[name], T - 1, first) if layers else [],
                "attn_entropy": _entropy_buckets(ent[i], layers, T - 1, first),
                "generation": generation_summary(
                    gen[1 + i], gen[0], prompt_tokens=T, seconds=run["generation_seconds"][1 + i],
                    reference_seconds=run["generation_seconds"][0],
                ) if generate else None,
                "calibration": _with_generation(
                    {**_mismatch(clipped[name], calibrations.get(name), T, mode, scheme), **on_eval_text.get(name, {})},
                    T, generate,
                ),
                "seconds": seconds[name],
                "decode": None if decode[name] is None else {
                    "fused_steps": decode[name].get("fused_steps", 0),
                    "fallback_steps": decode[name].get("fallback_steps", 0),
                },
            }
        )  # fmt: skip
        records += bucket_records(name, per_token[name], first)
        if ranks.main:  # the same results on every rank: said once
            _warn_mismatch(name, results[-1]["calibration"], T)
            logger.info(
                "%s: %.1f s, ppl %.4f (reference %.4f), kl %.5f",
                name,
                seconds[name],
                s["ppl"],
                s["ppl_ref"],
                s["kl"],
            )
            gen_rec = results[-1]["generation"]
            if gen_rec is not None:
                logger.info("%s: %s", name, generation_log_text(gen_rec))
    summary = {
        "model": model_name,
        "data": data_name,
        "context": context,
        "semantics": semantics,
        "mode": mode,
        "windows": W,
        **bos_record(tokenizer, bos_id),  # "bos", and with a BOS its "bos_token" / "bos_token_id"
        "fingerprint": fingerprint,
        "results": results,
        "reference_seconds": run["reference_seconds"],
        "wall_seconds": run["wall_seconds"],
        "world_size": ranks.world,
        "peak_rss_bytes": run["peak_rss_bytes"],
        "run_peak_rss_bytes": run["run_peak_rss_bytes"],
        "peak_cuda_bytes": run["peak_cuda_bytes"],
    }
    if out is not None:
        with ranks.agree("writing the outputs"):  # every rank returns once the run is on disk
            if ranks.main:
                meta = {
                    "version": OUTPUT_VERSION,
                    "first_scored": first,
                    "model_fingerprint": model_fp,
                    "tokens_fingerprint": tokens_fp,
                    "context": context,
                }
                if generate:
                    _write_generations(out, ["reference", *names], gen, tokenizer)
                _write_outputs(out, chash, summary, records, per_token, meta)
                _write_report(out)
    return summary


def _bits_at_context(
    shape: Any, scheme: KVScheme | PeerScheme, context: int, peer_bytes: int | None = None, config: Any = None
) -> float | None:
    """``kvbits plan``'s ``avg_bits`` of ``scheme`` at ``context`` tokens, one sequence
    (:func:`kvbits.plan.planner.planned_bits`: the bits per element the cache stores there, metadata, sinks and the
    full-precision window included, in the dtype the model runs in: ``shape`` from ``plan_shape_of(config, model)``).
    ``avg_bits`` beside it is the long-run figure (``long_run_avg_bits``: the window and sinks amortised away), which
    a short context does not reach: kivi-2 stores 3.0 bits per element in the long run and, in bfloat16, 16 at 128
    tokens, where nothing is quantized yet. None where the planner does not read the model's config.

    A peer (``PeerScheme``, which the planner does not model): its real bytes at ``context`` (``peer_bytes``:
    ``stream.cache_bytes`` of its cache once a window of ``context`` tokens is through, one sequence: quanto's codes,
    scales and zero-points and the full-precision residual) over the K/V elements of ``config``'s layers at
    ``context``; None where those bytes were not read (simulate mode, a transformers whose layout is not known)."""
    if isinstance(scheme, PeerScheme):
        if peer_bytes is None or config is None:
            return None
        from kvbits.cache import attention_shape
        from kvbits.plan.config import layer_heads

        per_token = sum(kv * d for i in range(attention_shape(config)[0]) for _, kv, d in [layer_heads(config, i)])
        return 8 * peer_bytes / (2 * per_token * context) if per_token else None
    if shape is None:
        return None
    from kvbits.plan.planner import planned_bits

    return planned_bits(shape, scheme, context)


def _combine(parts: list[dict[str, Any]], names: Sequence[str]) -> dict[str, Any]:
    """The ranks' counters and timings (``parts``, in rank order; one part alone) as one run's:
    clipping counts, decode steps and seconds (generation's included) summed (seconds: compute time over all ranks), the
    wall time the longest rank's loop over its windows, memory peaks the largest rank's."""

    def peak(key: str) -> int | None:
        return max((p[key] for p in parts if p[key] is not None), default=None)

    clipped: dict[str, dict[str, int]] = {n: {} for n in names}
    decode: dict[str, dict[str, int] | None] = {
        n: None if parts[0]["decode"][n] is None else {} for n in names
    }
    for p in parts:
        for n in names:
            add_counts(clipped[n], p["clipped"][n])
            if p["decode"][n]:
                add_counts(decode[n], p["decode"][n])
    return {
        "clipped": clipped,
        "decode": decode,
        # a peer's cache holds the same bytes after every window: any rank's that ran one
        "peer_bytes": {n: next((b for p in parts if (b := p["peer_bytes"][n]) is not None), None) for n in names},
        "seconds": {n: sum(p["seconds"][n] for p in parts) for n in names},
        "reference_seconds": sum(p["reference_seconds"] for p in parts),
        "generation_seconds": [sum(s) for s in zip(*(p["generation_seconds"] for p in parts))],
        "wall_seconds": max(p["loop_seconds"] for p in parts),
        "peak_rss_bytes": peak("peak_rss_bytes"),
        "run_peak_rss_bytes": peak("run_peak_rss_bytes"),
        "peak_cuda_bytes": peak("peak_cuda_bytes"),
    }


def _entropy_buckets(
    ent: np.ndarray, layers: Sequence[int], n_positions: int, first: int
) -> list[dict[str, Any]]:
    """``attn_entropy`` of one scheme from its entropies ``(layers, 2, W, T)`` (quantized, exact)."""
    if not layers:
        return []
    return attn_entropy_buckets(
        {layer: ent[j, 0] for j, layer in enumerate(layers)},
        {layer: ent[j, 1] for j, layer in enumerate(layers)},
        n_positions,
        first,
    )
