"""Loading by hub id where there is no network: one name lookup, then the local hub cache only (kvbits._hub)."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from kvbits import _hub

CONFIG = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 256, "intermediate_size": 512,
    "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 320,
    "max_position_embeddings": 2048, "torch_dtype": "float16",
}  # fmt: skip


@pytest.fixture
def no_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in (
        "https_proxy",
        "HTTPS_PROXY",
        "all_proxy",
        "ALL_PROXY",
        "http_proxy",
        "HTTP_PROXY",
        "HF_HUB_OFFLINE",
    ):
        monkeypatch.delenv(var, raising=False)
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)


@pytest.fixture
def lookups(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Hosts looked up; every lookup fails as it does with no network."""
    seen: list[str] = []

    def fail(host: str, *args: Any, **kwargs: Any) -> None:
        seen.append(host)
        raise socket.gaierror(-2, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", fail)
    return seen


def test_unresolvable_host_is_the_reason(no_proxy: None, lookups: list[str]) -> None:
    reason = _hub.hub_unreachable()
    assert reason is not None and "does not resolve" in reason and "Name or service not known" in reason
    assert lookups == ["huggingface.co"]
    assert _hub.hub_load_kwargs("x") == ({"local_files_only": True}, reason)


def test_resolvable_host_leaves_the_load_alone(no_proxy: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        socket,
        "getaddrinfo",
        lambda *a, **k: [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.1", 443))],
    )
    assert _hub.hub_unreachable() is None
    assert _hub.hub_load_kwargs("x") == ({}, None)


def test_endpoint_host_is_the_one_looked_up(
    no_proxy: None, lookups: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", "https://hub.mirror.example:8443")
    assert "hub.mirror.example" in (_hub.hub_unreachable() or "")
    assert lookups == ["hub.mirror.example"]


def test_a_hanging_lookup_is_cut_at_the_timeout(no_proxy: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: time.sleep(60))
    t0 = time.perf_counter()
    reason = _hub.hub_unreachable(timeout_s=0.2)
    assert time.perf_counter() - t0 < 30.0  # not the lookup's 60 s (a margin for a loaded machine, not a speed goal)
    assert reason is not None and "took over 0.2 s" in reason


def test_offline_flag_is_a_reason_without_a_lookup(
    no_proxy: None, lookups: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert _hub.hub_unreachable() == "HF_HUB_OFFLINE is set"
    assert lookups == []


def test_a_proxy_resolves_names_itself(
    no_proxy: None, lookups: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.internal:3128")
    assert _hub.hub_unreachable() is None
    assert lookups == []


def _hub_cache(root: Path, repo: str, config: dict[str, Any]) -> None:
    """``root`` laid out as huggingface_hub's cache holding ``repo``'s config.json at one revision."""
    folder = root / ("models--" + repo.replace("/", "--"))
    rev = "0" * 40
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(rev)
    (folder / "snapshots" / rev).mkdir(parents=True)
    (folder / "snapshots" / rev / "config.json").write_text(json.dumps(config))


def test_plan_reads_a_cached_hub_config_without_network(
    no_proxy: None, lookups: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from huggingface_hub import constants

    from kvbits.plan import plan

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    _hub_cache(tmp_path, "some-org/cached-model", CONFIG)
    cached = plan("some-org/cached-model", context=1024)
    assert cached["total_bytes"] == plan(dict(CONFIG), context=1024)["total_bytes"] > 0
    assert lookups == ["huggingface.co"]  # one lookup, no retries (huggingface_hub's own would look up again)


def test_plan_of_an_uncached_hub_id_fails_at_once_with_the_reason(
    no_proxy: None, lookups: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import transformers
    from huggingface_hub import constants

    from kvbits.plan import plan

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    calls: list[dict[str, Any]] = []
    real = transformers.AutoConfig.from_pretrained

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append({**kwargs, "offline": constants.HF_HUB_OFFLINE})
        return real(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", spy)
    with pytest.raises(
        ValueError, match=r"some-org/not-cached.*hub is unreachable \(huggingface\.co does not resolve"
    ):
        plan("some-org/not-cached", context=1024)
    # huggingface_hub's offline switch on around it: 1.x (transformers 5.17) still connected for its agent registry
    assert calls == [{"local_files_only": True, "offline": True}]
    assert constants.HF_HUB_OFFLINE is False
    assert lookups == ["huggingface.co"]  # one lookup, no retries


def test_evaluate_load_config_reads_the_cache_and_names_the_reason(
    no_proxy: None, lookups: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from huggingface_hub import constants

    from kvbits.evaluate.models import load_config

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    _hub_cache(tmp_path, "some-org/cached-model", CONFIG)
    assert load_config("some-org/cached-model").num_key_value_heads == 2
    with pytest.raises(RuntimeError, match=r"some-org/other.*hub is unreachable.*not in the local hub cache"):
        load_config("some-org/other")


def test_load_model_by_hub_id_reads_only_the_cache(
    no_proxy: None, lookups: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import transformers
    from huggingface_hub import constants

    from kvbits.evaluate.models import load_model

    seen: list[dict[str, Any]] = []

    def offline(*args: Any, **kwargs: Any) -> None:
        seen.append({**kwargs, "offline": constants.HF_HUB_OFFLINE})
        raise OSError("not in the cache")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", offline)
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", offline)  # read first: encoders are refused
    with pytest.raises(RuntimeError, match=r"some-org/some-model.*hub is unreachable.*smollm2-135m"):
        load_model("some-org/some-model")
    assert seen == [{"local_files_only": True, "offline": True}] and constants.HF_HUB_OFFLINE is False


def test_hub_datasets_load_offline_where_the_hub_is_unreachable(
    no_proxy: None, lookups: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``hub:`` texts: ``datasets.load_dataset`` runs with huggingface_hub's (and datasets') offline switch on, so a
    dataset not cached fails at once with the reason; the switch is restored afterwards, and with a reachable hub it
    is left alone."""
    import sys
    import types

    from huggingface_hub import constants

    from kvbits.evaluate.data import load_text

    seen: list[bool] = []
    fake_config = types.SimpleNamespace(HF_HUB_OFFLINE=False)

    def load_dataset(name: str, config: str | None, split: str) -> Any:
        seen.append(constants.HF_HUB_OFFLINE and fake_config.HF_HUB_OFFLINE)
        raise ConnectionError(f"Couldn't reach {name!r} on the Hub (LocalEntryNotFoundError)")

    fake = types.ModuleType("datasets")
    fake.load_dataset = load_dataset  # type: ignore[attr-defined]
    fake.config = fake_config  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "datasets", fake)
    monkeypatch.setitem(sys.modules, "datasets.config", fake_config)
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=r"could not load hub dataset 'wikitext'.*the hub is unreachable.*does not "
                                         r"resolve.*not in the local hub cache.*Offline\? Give the text as a local "
                                         r"file instead: a path to a UTF-8 text file, or one of .*'wikitext2'.*"
                                         r"KVBITS_DATA"):  # fmt: skip
        load_text("hub:wikitext:wikitext-2-raw-v1")
    assert time.monotonic() - t0 < 5 and seen == [True] and lookups == ["huggingface.co"]
    assert constants.HF_HUB_OFFLINE is False and fake_config.HF_HUB_OFFLINE is False

    monkeypatch.setattr(_hub, "hub_unreachable", lambda *a, **k: None)  # a reachable hub: online, the error as raised
    with pytest.raises(ValueError, match="ConnectionError: Couldn't reach 'wikitext'"):
        load_text("hub:wikitext:wikitext-2-raw-v1")
    assert seen == [True, False]



class _Rows:
    """A one-column ``datasets.Dataset`` of strings, as ``_load_hub`` reads it."""

    def __init__(self, rows: list[str]) -> None:
        import types

        self.rows = rows
        self.column_names = ["text"]
        self.features = {"text": types.SimpleNamespace(dtype="string")}

    def __getitem__(self, column: str) -> list[str]:
        return self.rows


def test_hub_wikitext_rows_give_the_registry_file_not_the_double_newline_join(monkeypatch: pytest.MonkeyPatch) -> None:
    """WikiText's hub rows (each ending in ``"\\n"``, blank lines as ``""``) are joined with ``""``: the registry's
    ``wikitext2`` file with LF line ends, line for line, as ``_load_hub`` and the README say; not the published
    recipes' ``"\\n\\n".join`` (which would hold a blank line after every row)."""
    import sys
    import types

    from kvbits.evaluate.data import load_text

    try:
        raw = load_text("wikitext2").text
    except FileNotFoundError:
        pytest.skip("shared/data/wikitext-2-raw not present")
    lines = raw.replace("\r\n", "\n").splitlines(keepends=True)[:200]
    rows = [r for line in lines for r in ("", line)]  # as the hub has them: "" rows between
    fake = types.ModuleType("datasets")
    fake.load_dataset = lambda name, config, split: _Rows(rows)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "datasets", fake)
    monkeypatch.setattr(_hub, "hub_unreachable", lambda *a, **k: None)
    text = load_text("hub:wikitext:wikitext-2-raw-v1").text
    assert text == "".join(lines) and "\n\n" not in text
