"""Data-parallel evaluation over torch.distributed: two gloo ranks on the CPU give what one process gives.

One module-scoped fixture spawns two ranks once (``torch.multiprocessing.spawn``, a file rendezvous);
each runs every scenario with a tiny random-weight Llama (the same seed on every rank, token ids
given directly) and pickles what ``evaluate`` returned or raised. The tests compare that with an
independent single-process run in this process: summaries equal apart from timings, per-token
arrays equal bit for bit, and only rank 0 touching the output folder. The last test runs
``kvbits eval`` end to end under ``torchrun``.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from kvbits.schemes import get_scheme

VOCAB = 101
CONTEXT = 96
# a residual window that flushes within CONTEXT: kivi-2's own 128 tokens hold a whole window of 96 in full
# precision, so its numbers were the unquantized model's and every comparison of them held trivially
WINDOWED = get_scheme("kivi-2").replace(name="kivi-2-r32", residual=32)
SCHEMES = ["int4-token", WINDOWED]
ATTN = [0, 1]
SPAWN_TIMEOUT_S = 180  # the ranks' whole run; a hang fails the tests instead of blocking them

pytestmark = pytest.mark.usefixtures("one_thread")


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    return LlamaForCausalLM(cfg).eval()


def _ids(windows: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, VOCAB, (windows * CONTEXT,), generator=g)


# rank != 0 must leave the output folder alone: these are the runner's only ways into it
_FOLDER_CALLS = ("_check_out_dir", "_prepare_out_dir", "write_text_atomic", "_write_outputs", "_write_report")


def _worker(rank: int, world: int, init_file: str, work: str) -> None:
    import torch.distributed as dist

    from kvbits.evaluate import runner

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    work_dir = Path(work)
    results: dict = {}
    touched: list[str] = []
    if rank != 0:
        for name in _FOLDER_CALLS:
            setattr(runner, name, lambda *a, _name=name, **k: touched.append(_name))

    def run(key: str, *args, **kwargs) -> None:
        try:
            results[key] = ("ok", runner.evaluate(*args, **kwargs))
        except Exception as exc:  # noqa: BLE001 - every outcome goes back to the test
            results[key] = ("error", type(exc).__name__, str(exc))

    try:
        model = _model()
        ids = _ids(3)
        run("w3", model, ids, CONTEXT, SCHEMES, windows=3, out_dir=work_dir / "w3", attn_layers=ATTN)
        skips: list = []
        run("w3-again", model, ids, CONTEXT, SCHEMES, windows=3, out_dir=work_dir / "w3", attn_layers=ATTN,
            on_skip=skips.append)  # fmt: skip
        results["skips"] = len(skips)
        run("w1", model, ids, CONTEXT, SCHEMES, windows=1, out_dir=work_dir / "w1", attn_layers=ATTN)
        run("other", model, ids, CONTEXT, ["int8-token"], windows=3, out_dir=work_dir / "w3")
        run("alone", model, ids, CONTEXT, SCHEMES, windows=3, attn_layers=ATTN, distributed=False)
        run("stream", model, ids, CONTEXT, [WINDOWED], windows=3, mode="stream", fused_decode=True)
        own = (ids + rank) % VOCAB  # rank-dependent token ids, as long as rank 0's
        run("own-data", model, own, CONTEXT, SCHEMES, windows=3, attn_layers=[])
        if rank == 1:  # a failure on one rank only
            runner.token_metrics = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom on rank 1"))
        run("fails", model, ids, CONTEXT, SCHEMES, windows=3, attn_layers=[])
        results["touched"] = touched
        dist.destroy_process_group()
        results["threads_after_destroy"] = _thread_names()
        (work_dir / f"rank{rank}.pkl").write_bytes(pickle.dumps(results))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _spawn_two(worker, work: Path, *extra: object) -> list:
    """Run ``worker(rank, 2, init_file, work, *extra)`` on two spawned gloo ranks; what each pickled to
    ``work/rank{r}.pkl``. A run past ``SPAWN_TIMEOUT_S`` kills both and fails the test (a hang)."""
    import torch.multiprocessing as mp

    ctx = mp.spawn(worker, args=(2, str(work / "rendezvous"), str(work), *extra), nprocs=2, join=False)
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"the two ranks did not finish within {SPAWN_TIMEOUT_S} s (a hang?)")
    return [pickle.loads((work / f"rank{r}.pkl").read_bytes()) for r in range(2)]


def _thread_names() -> list[str]:
    """This process's threads by name (Linux ``/proc``; empty elsewhere)."""
    return sorted(p.read_text().strip() for p in Path(f"/proc/{os.getpid()}/task").glob("*/comm"))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """What each of two spawned gloo ranks returned, per scenario, and the folder they wrote."""
    work = tmp_path_factory.mktemp("dist")
    return _spawn_two(_worker, work), work


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The same runs in this process, alone: the independent reference."""
    from kvbits.evaluate.runner import evaluate

    work = tmp_path_factory.mktemp("single")
    model, ids = _model(), _ids(3)
    return {
        "w3": evaluate(model, ids, CONTEXT, SCHEMES, windows=3, out_dir=work / "w3", attn_layers=ATTN),
        "w1": evaluate(model, ids, CONTEXT, SCHEMES, windows=1, out_dir=work / "w1", attn_layers=ATTN),
        "stream": evaluate(model, ids, CONTEXT, [WINDOWED], windows=3, mode="stream", fused_decode=True),
    }, work


TIMINGS = ("reference_seconds", "wall_seconds", "peak_rss_bytes", "run_peak_rss_bytes", "peak_cuda_bytes")


def _canon(summary: dict) -> str:
    """``summary`` (in memory, or read from summary.json with its "NaN" strings) as sorted JSON: equal for equal
    runs, NaN included (a bucket of one resampling unit has a NaN interval, and NaN != NaN in a dict comparison)."""
    from kvbits import _json

    return json.dumps(_json.loads(_json.dumps(summary)), sort_keys=True)  # "NaN" as summary.json spells it, too


def _numbers(summary: dict) -> str:
    """A summary without what differs between runs of the same computation (timings, memory, ranks), as
    ``_canon``."""
    s = json.loads(json.dumps(summary))
    for key in (*TIMINGS, "world_size"):
        s.pop(key)
    for r in s["results"]:
        r.pop("seconds")
    return _canon(s)


def _ok(outcome: tuple) -> dict:
    assert outcome[0] == "ok", outcome
    return outcome[1]


@pytest.mark.parametrize("key", ["w3", "w1", "stream"])
def test_every_rank_returns_the_single_process_summary(ranks, single, key):
    """W=3 (windows split 2 + 1), W=1 (rank 1 idle but in every collective), stream mode (decode
    counters summed over the ranks)."""
    (r0, r1), _ = ranks
    s0, s1 = _ok(r0[key]), _ok(r1[key])
    assert _canon(s0) == _canon(s1)  # timings and memory included: combined the same way on every rank
    assert s0["world_size"] == 2 and single[0][key]["world_size"] == 1
    assert _numbers(s0) == _numbers(single[0][key])
    assert s0["windows"] == (1 if key == "w1" else 3)
    assert all(r["kl"] > 0 for r in s0["results"])  # every scheme measured something
    if key == "stream":
        steps = s0["results"][0]["decode"]
        assert steps == single[0][key]["results"][0]["decode"] and steps["fused_steps"] > 0
    else:
        assert s0["results"][0]["attn_error"] and s0["results"][0]["calibration"]["clipped_keys"] >= 0
    assert s0["wall_seconds"] > 0 and s0["reference_seconds"] > 0


@pytest.mark.parametrize("key", ["w3", "w1"])
def test_rank0_wrote_what_one_process_writes(ranks, single, key):
    """The folder of the two-rank run equals the single-process one: per-token arrays bit for bit,
    records line for line, summary and config apart from timings, date and rank count."""
    from safetensors.numpy import load_file

    (r0, _), work = ranks
    dist_dir, one_dir = work / key, single[1] / key
    files = sorted(str(p.relative_to(dist_dir)) for p in dist_dir.rglob("*") if p.is_file())
    assert files == sorted(str(p.relative_to(one_dir)) for p in one_dir.rglob("*") if p.is_file())
    assert "DONE" in files and f"tokens/{WINDOWED.name}.safetensors" in files
    for name in ("int4-token", WINDOWED.name):
        a = load_file(str(dist_dir / "tokens" / f"{name}.safetensors"))
        b = load_file(str(one_dir / "tokens" / f"{name}.safetensors"))
        assert set(a) == set(b) == {"nll", "nll_ref", "kl", "top1"}
        for field in a:
            assert a[field].shape == b[field].shape and a[field].dtype == np.float32
            assert np.array_equal(a[field].view(np.int32), b[field].view(np.int32)), (name, field)
    assert (dist_dir / "records.jsonl").read_text() == (one_dir / "records.jsonl").read_text()
    assert (dist_dir / "DONE").read_text() == (one_dir / "DONE").read_text()
    stored = json.loads((dist_dir / "summary.json").read_text())
    assert _canon(stored) == _canon(_ok(r0[key]))
    assert _numbers(stored) == _numbers(json.loads((one_dir / "summary.json").read_text()))
    c2, c1 = (json.loads((d / "config.json").read_text()) for d in (dist_dir, one_dir))
    assert (c2["world_size"], c1["world_size"]) == (2, 1)
    for c in (c1, c2):
        for field in ("date", "world_size"):
            c.pop(field)
    assert c2 == c1  # config_hash included: the rank count is not part of the run's identity
    if (dist_dir / "report.md").is_file():  # the report says what its seconds are
        assert "summed over the 2 ranks" in (dist_dir / "report.md").read_text()
        assert "summed over" not in (one_dir / "report.md").read_text()


def test_only_rank0_touched_the_output_folder(ranks):
    (r0, r1), _ = ranks
    assert r1["touched"] == []  # its calls into the folder were recorded (and did nothing)
    assert (r0["w3"][0], r1["w3"][0]) == ("ok", "ok")


def test_finished_run_reused_by_every_rank_and_by_one_process(ranks, tmp_path):
    from kvbits.evaluate.runner import evaluate

    (r0, r1), work = ranks
    for r in (r0, r1):
        assert _canon(_ok(r["w3-again"])) == _canon(_ok(r0["w3"])) and r["skips"] == 1
    skipped = []
    again = evaluate(_model(), _ids(3), CONTEXT, SCHEMES, windows=3, out_dir=work / "w3", attn_layers=ATTN,
                     on_skip=skipped.append)  # fmt: skip
    assert skipped and again["world_size"] == 2  # a single process finds the two ranks' run as its own


def test_other_run_refused_on_every_rank(ranks):
    (r0, r1), _ = ranks
    for r in (r0, r1):
        assert r["other"][:2] == ("error", "OtherRunError") and "different configuration" in r["other"][2]


def test_distributed_false_evaluates_everything_on_each_rank(ranks, single):
    (r0, r1), _ = ranks
    for r in (r0, r1):
        s = _ok(r["alone"])
        assert s["world_size"] == 1 and _numbers(s) == _numbers(single[0]["w3"])


def test_ranks_given_other_data_are_refused_on_every_rank(ranks):
    """Rank 1 given its own token ids (as many as rank 0's) was combined with rank 0 without a word: both
    returned KL 1.0054e-4 where one process on rank 0's ids gives 1.0018e-4 (and ranks given another window
    count aborted in gloo, SIGABRT). Now every rank refuses, naming what differs, before any window."""
    (r0, r1), _ = ranks
    for r in (r0, r1):
        assert r["own-data"][:2] == ("error", "ValueError"), r["own-data"]
        assert "rank 1 of 2 was given another run than rank 0 (differing: data)" in r["own-data"][2]


def test_failure_on_one_rank_stops_every_rank(ranks):
    """Rank 1 raises in its window; rank 0 does not wait for it forever but raises RankFailed."""
    (r0, r1), _ = ranks
    assert r1["fails"] == ("error", "RuntimeError", "boom on rank 1")
    assert r0["fails"][:2] == ("error", "RankFailed")
    assert "rank 1 of 2 failed while evaluating its windows: RuntimeError: boom on rank 1" in r0["fails"][2]


_LOCAL_FAILURE_TIMEOUT_S = 20  # the ranks' collective timeout in this test: how long a rank waited before


def _local_failure_worker(rank: int, world: int, init_file: str, work: str, case: str = "data_path") -> None:
    import datetime

    import torch.distributed as dist

    from kvbits.evaluate.runner import evaluate

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=_LOCAL_FAILURE_TIMEOUT_S))  # fmt: skip
    try:
        start = time.monotonic()
        node = Path(work) / f"node{rank}"  # this rank's own disk: rank 1's lacks what rank 0's holds
        kwargs: dict = {"schemes": ["int4-token"]}
        model: object = _model()
        if case == "data_path":  # rank 1's node lacks the data folder
            kwargs["data_path"] = work if rank == 0 else str(Path(work) / "missing")
        elif case == "model_folder":  # the model folder on rank 1's node is still empty (a copy not yet made)
            node.mkdir()
            if rank == 0:
                model.save_pretrained(node / "model")  # type: ignore[attr-defined]
            else:
                (node / "model").mkdir()
            model = str(node / "model")
        elif case == "windows" and rank == 1:  # a torchrun script that passes a rank its own (wrong) argument
            kwargs["windows"] = 0
        elif case == "seed" and rank == 1:
            kwargs["seed"] = -1
        elif case == "fused_decode" and rank == 1:  # a stream-only setting on a simulate run
            kwargs["fused_decode"] = True
        elif case == "scheme_file":  # rank 1's node lacks the scheme file
            node.mkdir()
            if rank == 0:
                (node / "scheme.json").write_text(json.dumps(get_scheme("int4-token").to_dict()))
            kwargs["schemes"] = [str(node / "scheme.json")]
        try:  # a check that reads the rank's own disk (or its own arguments) fails there only
            evaluate(model, _ids(3), CONTEXT, **{"windows": 3, "attn_layers": [], **kwargs})
            outcome: tuple = ("ok",)
        except Exception as exc:  # noqa: BLE001 - every outcome goes back to the test
            outcome = ("error", type(exc).__name__, str(exc))
        (Path(work) / f"rank{rank}.pkl").write_bytes(pickle.dumps((*outcome, time.monotonic() - start)))
        if rank == 1:  # the caller goes on with its next task instead of exiting: rank 0 is not freed by its exit
            deadline = time.monotonic() + 3 * _LOCAL_FAILURE_TIMEOUT_S
            while not (Path(work) / "rank0.pkl").exists() and time.monotonic() < deadline:
                time.sleep(0.2)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("case", "error", "said", "phase"),
    [
        ("data_path", "ValueError", "is not a folder", "checking its data path"),
        # the scheme file was read before any agreement step: rank 0 waited for the collective timeout
        ("scheme_file", "ValueError", "scheme.json' does not exist", "reading its scheme files"),
        # the model folder was hashed (the run's identity) before any agreement step: rank 0 waited in check_same
        # for the collective timeout, then raised gloo's "Timed out waiting 20000ms"
        ("model_folder", "ValueError", "holds no config.json", "hashing its model and data files"),
        # the argument checks ran before / between the agreement steps: rank 0 waited for the collective timeout
        ("windows", "ValueError", "windows must be a positive int, got 0", "checking its arguments"),
        ("seed", "ValueError", "seed must be an int >= 0, got -1", "checking its arguments"),
        ("fused_decode", "ValueError", "fused_decode=True needs mode='stream'", "checking its arguments"),
    ],
)
def test_a_check_that_fails_on_one_rank_only_stops_every_rank(tmp_path, case, error, said, phase):
    """A ``data_path`` or a scheme JSON file (likewise a calibration file, a GPU) missing on one rank's node: that
    rank raises its own error, the other ``RankFailed`` at once. Before, the check ran outside any agreement step, so rank 0 went on
    into the next collective and waited there for the whole collective timeout (24 h under ``kvbits eval``; 20 s
    here), then raised gloo's "Timed out waiting 20000ms for send operation"."""
    r0, r1 = _spawn_two(_local_failure_worker, tmp_path, case)
    assert r1[:2] == ("error", error) and said in r1[2], r1
    assert r0[:2] == ("error", "RankFailed"), r0
    assert f"rank 1 of 2 failed while {phase}" in r0[2] and said in r0[2]
    assert r0[3] < _LOCAL_FAILURE_TIMEOUT_S / 2  # told, not timed out


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="thread names are read from /proc")
def test_destroy_frees_the_group(ranks):
    """No gloo thread outlives ``destroy_process_group``: evaluate imported transformers (and with it
    ``torch.distributed.nn``, whose default arguments would hold the group) after the group was
    initialized, and a gloo thread left alive could abort the rank at interpreter exit."""
    (r0, r1), _ = ranks
    for r in (r0, r1):
        assert r["threads_after_destroy"] and not [t for t in r["threads_after_destroy"] if "gloo" in t]


_CAUGHT = """
import logging, sys, tempfile
import torch, torch.distributed as dist
logging.basicConfig(level=logging.WARNING)
if sys.argv[1] == "kvbits-first":
    from kvbits.evaluate.distributed import resolve_ranks
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
import torch.distributed.nn
from kvbits.evaluate.distributed import resolve_ranks
resolve_ranks(None)
dist.destroy_process_group()
"""


@pytest.mark.parametrize("order", ["kvbits-first", "group-first"])
def test_warns_when_the_group_is_caught_by_torch_distributed_nn(order):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    done = subprocess.run([sys.executable, "-c", _CAUGHT, order], env=env, capture_output=True, text=True,
                          timeout=120, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    caught = "torch.distributed.nn was imported after init_process_group" in done.stderr
    assert caught == (order == "group-first"), done.stderr[-2000:]


def test_alone_without_a_process_group():
    import torch.distributed as dist

    from kvbits.evaluate.distributed import Ranks, resolve_ranks

    assert not dist.is_initialized()
    assert resolve_ranks(None) == Ranks() and resolve_ranks(False) == Ranks()
    with pytest.raises(ValueError, match="initialized torch.distributed process group"):
        resolve_ranks(True)
    assert Ranks(0, 2).windows(3) == [0, 2] and Ranks(1, 2).windows(3) == [1] and Ranks(1, 2).windows(1) == []
    a = np.arange(6, dtype=np.float32)
    Ranks().assemble(a)  # alone: untouched
    assert np.array_equal(a, np.arange(6, dtype=np.float32))


def test_cli_under_torchrun(tmp_path, monkeypatch):
    """``torchrun --nproc-per-node 2 -m kvbits eval`` on a local model folder and text file: one JSON
    summary on stdout (rank 0's), equal to a single-process evaluate; the folder says 2 ranks ran."""
    from _wordlevel import save_word_tokenizer, write_word_text

    import kvbits
    from kvbits.evaluate.runner import evaluate

    folder, text = tmp_path / "model", write_word_text(tmp_path / "book.txt", 3 * CONTEXT + 10)
    save_word_tokenizer(folder)
    _model().save_pretrained(folder)
    out = tmp_path / "run"
    src = str(Path(kvbits.__file__).resolve().parents[1])
    env = {**os.environ, "KVBITS_CACHE": str(tmp_path / "cache"), "PYTHONPATH": src, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "kvbits", "eval", "--model", str(folder), "--data", str(text), "--context", str(CONTEXT),
           "--windows", "3", "--scheme", "int4-token", "--attn-layers", "1", "--out", str(out),
           "--json", "--no-progress"]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=SPAWN_TIMEOUT_S, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout)  # exactly one JSON document: rank 1 printed nothing
    assert done.stderr.count("Loading weights: 100%") <= 1  # rank 1 shows no progress bar either
    assert summary["world_size"] == 2 and summary["windows"] == 3
    config = json.loads((out / "config.json").read_text())
    assert config["world_size"] == 2 and config["argv"][:2] == ["kvbits", "eval"]
    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path / "cache"))
    one = evaluate(str(folder), str(text), CONTEXT, ["int4-token"], windows=3, attn_layers=[1])
    assert _numbers(summary) == _numbers(one)


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"RANK": "1", "WORLD_SIZE": "1"}, "RANK=1, WORLD_SIZE=1"),  # kvbits eval printed nothing: a rank > 0 alone
        ({"RANK": "2", "WORLD_SIZE": "2"}, "expected 0 <= RANK < WORLD_SIZE"),  # hung in init_process_group
        ({"RANK": "-1", "WORLD_SIZE": "2"}, "expected 0 <= RANK < WORLD_SIZE"),
        ({"RANK": "abc"}, "RANK='abc' is not an integer"),
        # env_world said (0, 2, 2): every process so started claimed rank 0, then torch's env:// refused it
        ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2 without RANK"),
    ],
)
def test_a_torchrun_environment_that_can_not_be_is_refused(env, match, monkeypatch):
    from kvbits.evaluate.distributed import env_world

    for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert env_world() == (0, 1, 1)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=match):
        env_world()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_leftover_world_size_fails_at_the_rendezvous_timeout(rank, monkeypatch):
    """``WORLD_SIZE=2`` and a master address left over from another job, no other rank: the rendezvous
    fails after ``$KVBITS_RENDEZVOUS_TIMEOUT_S`` with a message saying what to unset. Before, rank 0
    waited 24 h (the collectives' timeout) for a rank that never came."""
    from kvbits.evaluate.distributed import init_from_env

    for name, value in {"WORLD_SIZE": "2", "RANK": rank, "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(_free_port()), "KVBITS_RENDEZVOUS_TIMEOUT_S": "2"}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    start = time.monotonic()
    with (
        pytest.raises(RuntimeError, match=r"did not all join .* within 2 s .*Unset WORLD_SIZE"),
        init_from_env("cpu"),
    ):
        pytest.fail("no group can form with one of two ranks")
    assert time.monotonic() - start < 60
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize(
    ("env", "said"),
    [
        ({"MASTER_PORT": "29500"}, "MASTER_ADDR is not set"),  # torch: "MASTER_ADDR expected, but not set"
        ({"MASTER_ADDR": "127.0.0.1"}, "MASTER_PORT is not set"),
        # torch: "invalid literal for int() with base 10: 'abc'", naming no variable
        ({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "abc"}, "MASTER_PORT='abc' is not a port number"),
        ({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "70000"}, "MASTER_PORT='70000' is not a port number"),
    ],
)
def test_a_rendezvous_without_master_address_or_port_is_refused(env, said, monkeypatch):
    """``WORLD_SIZE=2`` without a usable ``MASTER_ADDR`` / ``MASTER_PORT``: a kvbits message naming what is
    missing and what to unset, at once."""
    from kvbits.evaluate.distributed import init_from_env

    for name in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_WORLD_SIZE": "2", **env}.items():
        monkeypatch.setenv(name, value)
    with (
        pytest.raises(ValueError, match=f"WORLD_SIZE=2: {said}.*expected the address and port of rank 0.*Unset"),
        init_from_env("cpu"),
    ):
        pytest.fail("no group can form without rank 0's address")
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("raw", ["0", "-5", "soon", "inf", "nan"])
def test_a_rendezvous_timeout_that_is_not_a_positive_number_is_refused(raw, monkeypatch):
    from kvbits.evaluate.distributed import rendezvous_timeout_s

    monkeypatch.setenv("KVBITS_RENDEZVOUS_TIMEOUT_S", raw)
    with pytest.raises(ValueError, match="KVBITS_RENDEZVOUS_TIMEOUT_S=.*positive number of seconds"):
        rendezvous_timeout_s()
    monkeypatch.setenv("KVBITS_RENDEZVOUS_TIMEOUT_S", "90")
    assert rendezvous_timeout_s() == 90.0
    monkeypatch.delenv("KVBITS_RENDEZVOUS_TIMEOUT_S")
    assert rendezvous_timeout_s() == 600.0


def test_a_keyboard_interrupt_leaves_the_rank_without_a_collective(monkeypatch):
    """By choice (``kvbits.evaluate.distributed``'s docstring), ``Ranks.agree`` shares ``Exception`` only: a
    ``KeyboardInterrupt`` on one rank leaves it at once instead of waiting in ``all_gather_object`` for the other ranks
    to finish their phase; an ``Exception`` is gathered (then raised on every rank)."""
    from kvbits.evaluate.distributed import Ranks

    gathered: list = []
    monkeypatch.setattr(Ranks, "gather", lambda self, obj: gathered.append(obj) or [obj, None])
    ranks = Ranks(rank=0, world=2, backend="gloo")
    with pytest.raises(KeyboardInterrupt), ranks.agree("evaluating its windows"):
        raise KeyboardInterrupt
    assert gathered == []
    with pytest.raises(ValueError, match="bad"), ranks.agree("checking its arguments"):
        raise ValueError("bad")
    assert gathered == ["ValueError: bad"]
