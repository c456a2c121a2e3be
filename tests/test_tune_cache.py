"""The shared attention-tuning cache: where it lives, what it keeps, and how the
triton backend gives and takes its launches (the CUDA side is in test_cuda.py)."""

from __future__ import annotations

import json
import os

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():  # before anything imports triton
    os.environ.setdefault("TRITON_INTERPRET", "1")

from roseinfer.executor.tune_cache import (  # noqa: E402
    TUNE_CACHE_NAME,
    load_tuned,
    store_tuned,
    tune_cache_path,
    tune_key,
)


def test_the_path_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("ROSEINFER_TUNE_CACHE", "off")
    assert tune_cache_path() is None
    monkeypatch.setenv("ROSEINFER_TUNE_CACHE", str(tmp_path / "t.json"))
    assert tune_cache_path() == tmp_path / "t.json"
    monkeypatch.delenv("ROSEINFER_TUNE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert tune_cache_path() == tmp_path / "roseinfer" / TUNE_CACHE_NAME


def test_entries_round_trip_by_key_and_keep_each_other(tmp_path):
    path = tmp_path / "sub" / "t.json"
    a, b = tune_key({"gpu": "H100", "heads": 32}), tune_key({"heads": 32, "gpu": "H200"})
    assert tune_key({"heads": 32, "gpu": "H100"}) == a  # order of the facts does not matter
    assert load_tuned(path, a) is None  # no file yet
    assert store_tuned(path, a, {"launch": [[4, 1, 32, 4, 3]]})
    assert store_tuned(path, b, {"launch": [[4, 2, 64, 4, 2]]})
    assert load_tuned(path, a) == {"launch": [[4, 1, 32, 4, 3]]}
    assert load_tuned(path, b) == {"launch": [[4, 2, 64, 4, 2]]}
    assert not list(path.parent.glob("*.tmp"))  # written through a rename


def test_a_damaged_file_is_ignored_and_replaced(tmp_path):
    path = tmp_path / "t.json"
    path.write_text('{"half a fi')
    assert load_tuned(path, "k") is None
    assert store_tuned(path, "k", {"launch": []})
    assert json.loads(path.read_text()) == {"k": {"launch": []}}
    path.write_text('["not", "a", "map"]')
    assert load_tuned(path, "k") is None


def test_an_unwritable_place_is_not_an_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert store_tuned(blocker / "t.json", "k", {"launch": []}) is False  # parent is a file


def test_the_triton_backend_gives_and_takes_its_launches():
    pytest.importorskip("triton")
    from roseinfer.executor.attn_triton import TritonBackend

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tuned = TritonBackend(32, 8, device)
    assert tuned.tuned_launches() == {}  # nothing tuned yet
    tuned.launch = {(4, 1): (64, 4, 3), (4, 2): (32, 4, 2), (16, 1): (64, 8, 3)}
    tuned.balanced = {(4, 1)}
    doc = json.loads(json.dumps(tuned.tuned_launches()))  # through a file's JSON
    fresh = TritonBackend(32, 8, device)
    assert fresh.adopt_launches(doc)
    assert fresh.launch == tuned.launch and fresh.balanced == tuned.balanced
    assert fresh.tune_facts()["num_sms"] == tuned.num_sms
    for bad in ({}, {"launch": []}, {"launch": [[4, 1, 64, 4]], "balanced": []},
                {"launch": [[4, 1, 64, 4, True]], "balanced": []},
                {"launch": [[4, 1, 64, 4, 3]], "balanced": [[4, "x"]]},
                {"launch": [[4, 1, 64, 4, 3]], "segments": [[4, 1, 4, 16]]},
                {"launch": [[4, 1, 64, 4, 3]]}):  # fmt: skip
        other = TritonBackend(32, 8, device)
        assert not other.adopt_launches(bad), bad
        assert other.launch == {} and other.balanced == set()


class _Tuner:
    """A backend whose timing is counted: the runner's cache logic, without a GPU."""

    name = "stub"

    def __init__(self, choice: int) -> None:
        self.choice, self.timed, self.launches = choice, 0, {}

    def tune(self, k_cache, v_cache, **limits) -> float:
        self.timed += 1
        self.launches = {"launch": [[4, 1, self.choice, 4, 3]], "balanced": []}
        return 0.25

    def tune_facts(self):
        return {"backend": self.name}

    def tuned_launches(self):
        return self.launches

    def adopt_launches(self, launches) -> bool:
        self.launches = dict(launches)
        return True


def test_the_runner_tunes_once_per_key_and_later_runners_adopt(tmp_path, monkeypatch):
    """ModelRunner.tune_attention's cache path (on CUDA only; here with the device and
    the backend stood in): the first runner times and stores, the next adopts the
    first one's choice without timing, other limits time again, ``off`` always times."""
    from test_model_runner import runner_for, tiny

    path = tmp_path / "tune.json"
    monkeypatch.setenv("ROSEINFER_TUNE_CACHE", str(path))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Stub GPU")
    model = tiny("tiny-llama")

    def runner(choice: int):
        r = runner_for(model)
        r.device, r.backend = torch.device("cuda"), _Tuner(choice)  # only what tuning reads
        return r

    first = runner(64)
    assert first.tune_attention(max_num_seqs=8, max_model_len=128) == 0.25
    assert first.attention_tune_source == f"tuned, stored in {path}" and first.backend.timed == 1
    assert first.tune_attention(max_num_seqs=8, max_model_len=128) == 0.0  # the warm-up's 2nd call
    assert first.attention_tune_source == f"tuned, stored in {path}" and first.backend.timed == 1
    second = runner(32)  # would choose otherwise if it timed
    assert second.tune_attention(max_num_seqs=8, max_model_len=128) == 0.0
    assert second.backend.timed == 0 and second.attention_tune_source == f"cache {path}"
    assert second.backend.tuned_launches() == {"launch": [[4, 1, 64, 4, 3]], "balanced": []}
    other = runner(32)
    assert other.tune_attention(max_num_seqs=16, max_model_len=128) == 0.25  # another key
    assert len(json.loads(path.read_text())) == 2
    monkeypatch.setenv("ROSEINFER_TUNE_CACHE", "off")
    off = runner(32)
    assert off.tune_attention(max_num_seqs=8, max_model_len=128) == 0.25
    assert off.attention_tune_source == "tuned"
