"""Named scheme presets and the registry that resolves a name, a JSON file or a scheme object."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

from kvbits.schemes.spec import KVScheme, TensorSpec

KIVI = "https://arxiv.org/abs/2402.02750"
FLEXGEN = "https://arxiv.org/abs/2303.06865"
KVQUANT = "https://arxiv.org/abs/2401.18079"
QSERVE = "https://arxiv.org/abs/2405.04532"
QUAROT = "https://arxiv.org/abs/2404.00456"
VLLM_FP8 = "https://docs.vllm.ai/en/latest/features/quantization/quantized_kvcache.html"
VLLM_INT4 = "https://docs.vllm.ai/en/latest/api/vllm/v1/attention/ops/int4_per_token_head/"
VLLM_INT8 = "https://docs.vllm.ai/en/latest/api/vllm/v1/attention/ops/triton_reshape_and_cache_flash/"

_REGISTRY: dict[str, KVScheme] = {}


def register(scheme: KVScheme, *, overwrite: bool = False) -> KVScheme:
    """Add a scheme to the registry under ``scheme.name``."""
    if scheme.name in _REGISTRY and not overwrite:
        raise ValueError(f"scheme {scheme.name!r} is already registered")
    _REGISTRY[scheme.name] = scheme
    return scheme


def _tok(bits: int, group: int | None = None) -> TensorSpec:
    return TensorSpec(kind="int", bits=bits, fmt=None, granularity="token", group_size=group)


def _chan(bits: int, group: int) -> TensorSpec:
    return TensorSpec(kind="int", bits=bits, fmt=None, granularity="channel", group_size=group)


register(KVScheme("fp16", description="unquantized baseline, float16 storage"))
register(
    KVScheme(
        "bf16",
        key=TensorSpec(fmt="bf16"),
        value=TensorSpec(fmt="bf16"),
        description="unquantized, bfloat16 storage",
    )
)
for _name, _gran, _static, _desc, _ref in (
    ("fp8-e4m3", "tensor", True, ("FP8 E4M3 cast with a static per-tensor scale (1.0 until calibrated), "
     "as vLLM's kv_cache_dtype=fp8"), VLLM_FP8),
    ("fp8-e4m3-head", "head", True, ("FP8 E4M3 with a static scale per KV head (1.0 until calibrated), "
     "as vLLM's attn_head strategy"), VLLM_FP8),
    ("fp8-e4m3-token", "token", False, "FP8 E4M3 with one dynamic scale per token and head", ""),
):  # fmt: skip
    _fp8 = TensorSpec(kind="fp8", bits=8, fmt="e4m3", granularity=_gran, static=_static)
    register(KVScheme(_name, key=_fp8, value=_fp8, description=_desc, reference=_ref))
_fp8_rot = TensorSpec(kind="fp8", bits=8, fmt="e4m3", granularity="tensor", static=True, rotate="hadamard")
register(
    KVScheme(
        "fp8-e4m3-hadamard",
        key=_fp8_rot,
        value=_fp8_rot,
        description="FP8 E4M3 with a static per-tensor scale after a random-sign Hadamard rotation of the head "
        "dim (1.0 until calibrated; keys and values; rotated back after dequantization)",
        reference=QUAROT,
    )
)
for _bits in (8, 4, 3, 2):
    register(
        KVScheme(
            f"int{_bits}-token",
            key=_tok(_bits),
            value=_tok(_bits),
            description=f"INT{_bits} asymmetric, one scale per token and head (keys and values)",
        )
    )
for _bits in (8, 4, 3, 2):
    _rot = dataclasses.replace(_tok(_bits), rotate="hadamard")
    register(
        KVScheme(
            f"int{_bits}-token-hadamard",
            key=_rot,
            value=_rot,
            description=f"INT{_bits} per token and head after a random-sign Hadamard rotation of the head dim "
            "(keys and values; rotated back after dequantization)",
            reference=QUAROT,
        )
    )
_vllm4 = dataclasses.replace(_tok(4), rotate="hadamard-vllm", integer_zero=True)
register(
    KVScheme(
        "vllm-int4",
        key=_vllm4,
        value=_vllm4,
        description="vLLM's kv_cache_dtype=int4_per_token_head: INT4 per token and head after vLLM's "
        "random-sign Hadamard rotation (its sign vector), with an integer zero-point code (keys and values). "
        "vLLM's bytes per token and head, 4 + 32/D bits, not its layout: vLLM keeps one float32 scale whose 4 "
        "low mantissa bits hold the zero-point code, kvbits a float16 scale and a float16 zero (-z * scale), "
        "decoding within 1 % of a step of vLLM's; its round-half-away ties are not reproduced. As in vLLM, a token "
        "whose rotated values all lie on one side of 0 clamps its zero-point code and loses the far end of its "
        "range (counted as clipped: calibration_report(), kvbits eval's clipped fraction)",
        reference=VLLM_INT4,
    )
)
_vllm8 = dataclasses.replace(_tok(8), symmetric=True, rounding="trunc", scale_dtype="fp32")
register(
    KVScheme(
        "vllm-int8",
        key=_vllm8,
        value=_vllm8,
        description="vLLM's kv_cache_dtype=int8_per_token_head: INT8 symmetric per token and head, float32 scale "
        "max(absmax / 127, 1e-6), codes rounded toward zero as vLLM's write kernel stores them (keys and values)",
        reference=VLLM_INT8,
    )
)
_vllm_fp8 = TensorSpec(kind="fp8", bits=8, fmt="e4m3", granularity="token", scale_dtype="fp32")
register(
    KVScheme(
        "vllm-fp8-token",
        key=_vllm_fp8,
        value=_vllm_fp8,
        description="vLLM's kv_cache_dtype=fp8_per_token_head: FP8 E4M3 with a float32 scale absmax / 448 per "
        "token and head (keys and values; fp8-e4m3-token stores the scale in float16)",
        reference=VLLM_INT8,  # the same write kernel (triton_reshape_and_cache_flash) serves both
    )
)
for _bits in (8, 4, 3, 2):
    register(
        KVScheme(
            f"int{_bits}-token-smooth",
            key=dataclasses.replace(_tok(_bits), centre=True, smooth=0.5),
            value=_tok(_bits),
            description=f"INT{_bits} per token and head; keys first centred on calibrated channel means and divided "
            "by calibrated factors spread ** 0.5 per channel (SmoothAttention with centring; kvbits calibrate)",
            reference=QSERVE,
        )
    )
    register(
        KVScheme(
            f"int{_bits}-token-smooth-prerope",
            key=dataclasses.replace(_tok(_bits), centre=True, smooth=0.5, pre_rope=True),
            value=_tok(_bits),
            description=f"INT{_bits} per token and head; keys centred and smoothed per channel before RoPE, where "
            "a bias is a constant (calibrated on pre-RoPE keys), rotated back after decoding",
            reference=QSERVE,
        )
    )
for _bits in (8, 4, 2):
    register(
        KVScheme(
            f"int{_bits}-channel",
            key=_chan(_bits, 128),
            value=_tok(_bits),
            block=128,
            description=f"INT{_bits}: keys per-channel over blocks of 128 tokens, values per-token",
            reference=KIVI,
        )
    )
register(
    KVScheme(
        "int4-g64",
        key=_tok(4, 64),
        value=_tok(4, 64),
        description="INT4 group-wise, groups of 64 channels per token (FlexGen-style)",
        reference=FLEXGEN,
    )
)
for _bits in (4, 2):
    register(
        KVScheme(
            f"kivi-{_bits}",
            key=_chan(_bits, 32),
            value=_tok(_bits, 32),
            residual=128,
            block=32,
            description=f"KIVI-{_bits}: keys per-channel in groups of 32 tokens, values per-token in groups of "
            "32 channels, 128 recent tokens in full precision",
            reference=KIVI,
        )
    )

for _bits in (4, 3):
    register(
        KVScheme(
            f"int{_bits}-channel-prerope",
            key=TensorSpec(kind="int", bits=_bits, fmt=None, granularity="channel", group_size=128, pre_rope=True),
            value=_tok(_bits),
            block=128,
            description=f"INT{_bits}: keys per-channel over blocks of 128 tokens before RoPE (re-applied after "
            "dequantization), values per-token",
            reference=KVQUANT,
        )
    )
def _kvquant(bits: int, key_block: int | None) -> KVScheme:
    """KVQuant nuq{bits}-1%: pre-RoPE per-channel NUQ keys, per-token NUQ values, 1% outliers, 1 sink.

    ``key_block=None``: static calibrated per-channel key ranges; they need no token group, so every
    token is flushed as it arrives (block=1, residual=0): KVQuant's point (§3.1-3.2). ``key_block=128``:
    key ranges per 128-token block at flush time (as int4-channel-prerope), the calibration supplying
    the codebooks only; measured better than the static ranges on SmolLM2 (BENCHMARKS.md §3d).
    Outliers 1% per vector (§3.5), the first token kept in full precision (attention sink, §3.6).
    """
    static = key_block is None
    if static:
        name = f"kvquant-{bits}"
        description = (
            f"KVQuant nuq{bits}-1%: keys before RoPE, per-channel with calibrated scales and a "
            f"Fisher-weighted {bits}-bit codebook; values per-token with a {bits}-bit codebook; 1% outliers "
            "kept in float16; first token in full precision (needs `kvbits calibrate`)"
        )
    else:
        name = f"kvquant-{bits}-block"
        description = (
            f"KVQuant nuq{bits}-1% with block key ranges: keys before RoPE, per-channel over "
            f"blocks of {key_block} tokens, Fisher-weighted {bits}-bit codebooks, 1% outliers kept in float16, "
            "first token in full precision (needs `kvbits calibrate` for the codebooks)"
        )
    return KVScheme(
        name,
        key=TensorSpec(kind="nuq", bits=bits, fmt=None, granularity="channel", group_size=key_block,
                       static=static, outlier_frac=0.01, pre_rope=True),
        value=TensorSpec(kind="nuq", bits=bits, fmt=None, granularity="token", outlier_frac=0.01),
        sinks=1,
        residual=0,
        block=1 if static else key_block,
        description=description,
        reference=KVQUANT,
    )


for _bits in (4, 3, 2):
    register(_kvquant(_bits, None))
for _bits in (4, 3, 2):
    register(_kvquant(_bits, 128))

def list_schemes() -> list[KVScheme]:
    """Every registered scheme, in registration order."""
    return list(_REGISTRY.values())


def post_rope_advice(scheme: KVScheme) -> str:
    """What to use instead of ``scheme``'s pre-RoPE keys on a model that can not cache them so: a scheme with
    post-RoPE keys, naming the preset that is ``scheme`` with them when there is one (``int4-channel`` for
    ``int4-channel-prerope``, ``int4-token-smooth`` for ``int4-token-smooth-prerope``)."""
    advice = "use a scheme with post-RoPE keys (pre_rope=False)"
    post = scheme.name.removesuffix("-prerope")
    if post != scheme.name and post in _REGISTRY:
        advice += f", e.g. {post!r} instead of {scheme.name!r}"
    return advice


def mixed_scheme(base: str | KVScheme | dict, layers: dict[int, str | KVScheme | dict], name: str | None = None) -> KVScheme:
    """``base`` with some layers stored by other schemes (per-layer mixed precision), e.g.
    ``mixed_scheme("int4-token", {0: "int8-token", 23: "fp16"})``; named ``name`` or by the compact form
    ``"int4-token,0=int8-token,23=fp16"`` (``mixed_name``, which ``get_scheme`` also reads)."""
    b = get_scheme(base)
    if b.is_mixed:
        raise ValueError(f"the base scheme {b.name!r} is mixed already; give one flat scheme and its overrides")
    subs = {int(i): get_scheme(s) for i, s in layers.items()}
    if not name:
        name = mixed_name(b.name, {i: s.name for i, s in subs.items()})
    return b.replace(name=name, layers=tuple(sorted(subs.items(), key=lambda t: t[0])))


def mixed_name(base: str, layers: dict[int, str]) -> str:
    """The one spelling of a mixed scheme string: ``base``, then the overrides (layer -> scheme name) in
    layer order, consecutive layers with the same scheme joined into one inclusive range, no spaces
    (``"int4-token, 1 = fp16, 0=fp16"`` -> ``"int4-token,0-1=fp16"``). Results are told apart by
    scheme name, so two spellings of one scheme must not give two names."""
    runs: list[list] = []  # [first, last, scheme] per run of consecutive layers with one scheme
    for i in sorted(layers):
        if runs and runs[-1][1] == i - 1 and runs[-1][2] == layers[i]:
            runs[-1][1] = i
        else:
            runs.append([i, i, layers[i]])
    parts = [base, *(f"{a}={s}" if a == b else f"{a}-{b}={s}" for a, b, s in runs)]
    return ",".join(parts)


MAX_LAYERS = 1 << 16
"""Layer indices of a mixed scheme string must be below this (the deepest models have a few hundred
layers): a range such as ``0-99999999`` is refused before it is expanded into one override per layer."""

_LAYER_INDEX = re.compile(r"[0-9]+")


def _layer_index(text: str, spec: str, where: str) -> int:
    """One layer index of the mixed scheme string ``spec`` (``where``: the range it is part of), checked
    against ``MAX_LAYERS`` before any range is expanded."""
    digits = text.strip()
    if len(digits.lstrip("0")) > len(str(MAX_LAYERS)) or int(digits) >= MAX_LAYERS:
        shown = digits if len(digits) <= SHOWN_CHARS else f"{digits[:SHOWN_CHARS]}... ({len(digits)} digits)"
        raise ValueError(
            f"mixed scheme {_shown(spec)}: layer {shown} (in {_shown(where)}) is out of range: layer indices count "
            f"from 0 and must be below the model's layer count (kvbits takes at most {MAX_LAYERS} layers)"
        )
    return int(digits)


def _parse_mixed(spec: str) -> KVScheme:
    """``"BASE,L=SCHEME,L1-L2=SCHEME,..."`` -> ``mixed_scheme`` (layer ranges inclusive, indices below
    ``MAX_LAYERS``), named by ``mixed_name``: every spelling of one scheme gets the one name. Overrides naming
    ``BASE`` itself are dropped (``"int4-token,0-1=fp16,2=int4-token"`` is ``"int4-token,0-1=fp16"``; with none
    left, ``BASE``)."""
    base, *parts = (p.strip() for p in spec.split(","))
    layers: dict[int, str] = {}
    for part in parts:
        where, eq, sub = part.partition("=")
        sub = sub.strip()  # "0= fp16" as "0=fp16", as spaces around the commas are
        lo, dash, hi = where.partition("-")
        if not eq or not sub or not _LAYER_INDEX.fullmatch(lo.strip()) or (
            dash and not _LAYER_INDEX.fullmatch(hi.strip())
        ):
            raise ValueError(
                f"mixed scheme {_shown(spec)}: expected BASE,LAYER=SCHEME or BASE,FIRST-LAST=SCHEME (layer indices "
                f"from 0, e.g. 'int4-token,0-1=int8-token'), got {_shown(part)}"
            )
        first = _layer_index(lo, spec, where)
        last = _layer_index(hi, spec, where) if dash else first
        if last < first:
            raise ValueError(f"mixed scheme {_shown(spec)}: layer range {_shown(where)} is empty")
        for i in range(first, last + 1):
            if i in layers:
                raise ValueError(f"mixed scheme {_shown(spec)}: layer {i} is given twice")
            layers[i] = sub
    # a layer given the base itself is stored as every other layer: kept, "int4-token,0=int4-token" got its own
    # name beside "int4-token" (two rows of one scheme, check_unique_names blind to them)
    layers = {i: sub for i, sub in layers.items() if sub != base}
    try:
        if not layers:
            return get_scheme(base)
        return mixed_scheme(base, layers, name=mixed_name(base, layers))
    except (ValueError, TypeError) as exc:  # a typo in one name: say which string it is in
        raise type(exc)(f"mixed scheme {_shown(spec)}: {exc}") from exc


def _builtin(name: str) -> KVScheme | None:
    """What ``name`` resolves to without reading any file: a preset, or a mixed scheme string of presets
    (``"int4-token,0=fp16"``); None when it is neither."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    if "," not in name or "=" not in name:
        return None
    base, *parts = (p.strip() for p in name.split(","))
    if base not in _REGISTRY or any(p.partition("=")[2].strip() not in _REGISTRY for p in parts):
        return None
    try:
        return _parse_mixed(name)
    except ValueError:
        return None


def _content(scheme: KVScheme) -> dict:
    """``scheme.to_dict()`` less what does not change the storage (``name``, ``description``,
    ``reference``, in the per-layer overrides too)."""
    d = {k: v for k, v in scheme.to_dict().items() if k not in ("name", "description", "reference")}
    if "layers" in d:  # an override storing what the base stores is no override (as _parse_mixed drops it)
        flat = _content(scheme.replace(layers=()))
        d["layers"] = {i: c for i, sub in scheme.layers if (c := _content(sub)) != flat}
        if not d["layers"]:
            del d["layers"]
    return d


def _check_name(scheme: KVScheme, source: str) -> KVScheme:
    """``scheme`` (read from ``source``), unless it, or one of its per-layer overrides, takes the name of a
    preset (or of a mixed scheme string of presets) but stores K/V differently: results are reported, and
    resolved again, by name, so a file named ``fp16`` holding INT2 would pass for the unquantized baseline."""
    for where, s in (("", scheme), *((f"layer {i}'s override ", sub) for i, sub in scheme.layers)):
        builtin = _builtin(s.name)
        if builtin is None:
            continue
        mine, theirs = _content(s), _content(builtin)
        if mine != theirs:
            differ = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
            what = "preset" if s.name in _REGISTRY else "mixed scheme of presets"
            raise ValueError(
                f"{source}: {where}scheme name {s.name!r} is the name of a kvbits {what}, but this scheme "
                f"differs from it ({', '.join(differ)}); rename it (e.g. \"{s.name}-custom\") so that its "
                f"results are not taken for those of {s.name!r}"
            )
    return scheme


def check_unique_names(names: list[str], verb: str, how: dict[str, str] | None = None) -> None:
    """``ValueError`` naming the first scheme ``names`` lists twice: results are reported (and told apart)
    by scheme name, so a repeat would give two identical rows, and is most likely a typo for another
    scheme. ``verb``: what each scheme gets once (``"planned"``, ``"evaluated"``, ...); ``how``: a name ->
    how its two spellings were given, when they differ (``"'fp16' and 'fp16.json'"``)."""
    seen: set[str] = set()
    for name in names:
        if name in seen:
            given = f" (given as {how[name]})" if how and name in how else ""
            raise ValueError(
                f"scheme {name!r} is listed twice{given}; each scheme is {verb} once, so name each only once "
                "(a repeat is most likely a typo for another scheme)"
            )
        seen.add(name)


SHOWN_CHARS = 120
"""A scheme string longer than this is cut in error messages (``_shown``): a 100,000-character name is not
echoed whole to the terminal or the log."""


def _shown(spec: str) -> str:
    """``repr(spec)``, cut to about ``SHOWN_CHARS`` characters (with the full length said) when longer."""
    if len(spec) <= SHOWN_CHARS:
        return repr(spec)
    return f"{spec[:SHOWN_CHARS]!r}... ({len(spec)} characters)"


def _is_file(path: Path) -> bool:
    """``path.is_file()``, False (not ``OSError``) for a name the OS refuses (too long, ...)."""
    try:
        return path.is_file()
    except OSError:
        return False


def get_scheme(spec: str | KVScheme | dict) -> KVScheme:
    """Resolve a preset name, a path to a scheme JSON file, a dict, a ``KVScheme``, or a per-layer mix
    ``"BASE,LAYER=SCHEME,FIRST-LAST=SCHEME"`` of those names (``mixed_scheme``)."""
    if isinstance(spec, KVScheme):
        return spec
    if isinstance(spec, dict):
        return _check_name(KVScheme.from_dict(spec), "scheme dict")
    if not isinstance(spec, str):
        raise TypeError(f"scheme must be a name, a JSON path, a dict or a KVScheme, got {type(spec).__name__}")
    if spec in _REGISTRY:
        return _REGISTRY[spec]
    path = Path(spec).expanduser()
    if "," in spec and "=" in spec and not (path.suffix.lower() == ".json" and _is_file(path)):
        return _parse_mixed(spec)  # an existing file is read as one (a run folder "lr=0.1,bs=2/scheme.json")
    if path.suffix.lower() == ".json" and not _is_file(path):
        raise ValueError(
            f"scheme file {_shown(spec)} does not exist; expected a preset name ({', '.join(_REGISTRY)}) "
            "or the path of a scheme .json file"
        )
    if path.suffix.lower() == ".json":
        try:
            scheme = KVScheme.from_dict(json.loads(path.read_text(encoding="utf-8")))  # JSON's encoding, not the locale's
        except (ValueError, KeyError, TypeError) as exc:  # the message names the file (JSON, UTF-8, field errors)
            raise ValueError(f"{path} is not a valid kvbits scheme JSON: {exc}") from exc
        return _check_name(scheme, f"scheme file {path}")
    near = _near_preset(spec)
    hint = f" (did you mean {near!r}?)" if near is not None else ""
    raise ValueError(
        f"unknown scheme {_shown(spec)}{hint}; known presets: {', '.join(_REGISTRY)} (or a path to a .json scheme)"
    )


def _near_preset(spec: str) -> str | None:
    """The preset ``spec`` is a likely typo of (``kivi2``, ``KIVI-2``, ``int4_token``, ``int4-token-g64``), else
    None: the nearest at difflib ratio >= 0.8, or when that one drops a number of ``spec`` (bits, a group size) the
    nearest at >= 0.7 that keeps them all, else None."""
    import difflib

    low = spec.strip().lower().replace("_", "-")
    if low in _REGISTRY:
        return low
    # the numbers say what is stored (bits, group size): a near spelling that drops one names another storage
    # ("int4-token-g64", groups of 64, is 0.82 near int4-token, which has none): the nearest keeping them, or none
    close = difflib.get_close_matches(low, list(_REGISTRY), n=len(_REGISTRY), cutoff=0.7)
    numbers = _NUMBERS.findall(low)
    keeps = [name for name in close if all(_NUMBERS.findall(name).count(x) >= numbers.count(x) for x in numbers)]
    best = close[0] if close and difflib.SequenceMatcher(None, low, close[0]).ratio() >= 0.8 else None
    return best if best in keeps else (keeps[0] if best is not None and keeps else None)


_NUMBERS = re.compile(r"[0-9]+")
