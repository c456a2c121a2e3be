"""Trace loaders, error messages, slicing/rate scaling, seed generators, length fitting."""

from __future__ import annotations

import json
import math
from importlib import resources
from pathlib import Path

import numpy as np
import pytest

from roseinfer import workloads as w
from roseinfer.request import Request
from roseinfer.workloads.fit import fit_lengths, with_token_ids

SHARED_TRACES = Path(__file__).parents[2] / "shared" / "traces"

AZURE_TEXT = (
    "TIMESTAMP,ContextTokens,GeneratedTokens\n"
    "2023-11-16 18:15:46.6800000,374,44\n"
    "2023-11-16 18:15:50.9951690,396,109\n"
    "2023-11-16 18:15:51.1800000,879,31\n"
)


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def jsonl(rows: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def req(i: int, prompt: int, output: int, arrival: float = 0.0, **kw) -> Request:
    return Request(f"r{i}", arrival, prompt, output, **kw)


# ------------------------------------------------------------------ formats
def test_azure_csv_parses_relative_seconds(tmp_path: Path) -> None:
    reqs = w.load_trace(write(tmp_path, "conv.csv", AZURE_TEXT))
    assert [r.request_id for r in reqs] == ["conv-0", "conv-1", "conv-2"]
    assert [r.num_prompt_tokens for r in reqs] == [374, 396, 879]
    assert [r.max_output_tokens for r in reqs] == [44, 109, 31]
    assert reqs[0].arrival_time_s == 0.0
    assert reqs[1].arrival_time_s == pytest.approx(4.315169)
    assert reqs[2].arrival_time_s == pytest.approx(4.5)


def test_mooncake_jsonl_parses_ms_and_hash_ids(tmp_path: Path) -> None:
    rows = [
        {"timestamp": 0, "input_length": 1000, "output_length": 6, "hash_ids": [0, 1]},
        {"timestamp": 1500, "input_length": 512, "output_length": 4, "hash_ids": [0]},
    ]
    reqs = w.load_trace(write(tmp_path, "mc.jsonl", jsonl(rows)))
    assert w.detect_format(tmp_path / "mc.jsonl") == "mooncake"
    assert reqs[1].arrival_time_s == 1.5
    assert reqs[0].prefix_hash_ids == (0, 1)
    assert reqs[0].prefix_hash_block_tokens == 512


def test_plain_csv_with_tenant_and_ids_is_sorted(tmp_path: Path) -> None:
    text = "arrival_s,prompt_tokens,output_tokens,tenant,request_id\n5.5,10,2,a,x\n2.5,20,3,,y\n"
    reqs = w.load_trace(write(tmp_path, "p.csv", text))
    assert [r.request_id for r in reqs] == ["y", "x"]
    assert [r.arrival_time_s for r in reqs] == [0.0, 3.0]
    assert [r.tenant for r in reqs] == [None, "a"]


def test_plain_jsonl(tmp_path: Path) -> None:
    rows = [
        {"arrival_s": 1.0, "prompt_tokens": 7, "output_tokens": 3, "tenant": "t1"},
        {"arrival_s": 1.25, "prompt_tokens": 8, "output_tokens": 1},
    ]
    reqs = w.load_trace(write(tmp_path, "p.jsonl", jsonl(rows)), fmt="plain")
    assert [(r.request_id, r.arrival_time_s, r.tenant) for r in reqs] == [
        ("p-0", 0.0, "t1"),
        ("p-1", 0.25, None),
    ]


def test_detect_format_by_content_not_extension(tmp_path: Path) -> None:
    assert w.detect_format(write(tmp_path, "trace.txt", AZURE_TEXT)) == "azure"
    plain = write(tmp_path, "x.log", "arrival_s,prompt_tokens,output_tokens\n0,1,1\n")
    assert w.detect_format(plain) == "plain"


def test_embedded_sample_loads() -> None:
    reqs = w.load_default_trace()
    assert len(reqs) == 2000
    assert reqs[0].arrival_time_s == 0.0
    assert (reqs[0].num_prompt_tokens, reqs[0].max_output_tokens) == (374, 44)
    assert reqs[-1].arrival_time_s == pytest.approx(424.2594570)
    assert all(a.arrival_time_s <= b.arrival_time_s for a, b in zip(reqs, reqs[1:]))


def test_embedded_sample_is_the_unmodified_head_of_the_shared_trace() -> None:
    source = SHARED_TRACES / "AzureLLMInferenceTrace_conv.csv"
    if not source.exists():
        pytest.skip(f"{source} not present")
    sample = Path(w.__file__).parent / "data" / w.DEFAULT_TRACE_NAME
    data = sample.read_bytes()
    assert source.read_bytes()[: len(data)] == data
    assert data.count(b"\n") == 2001


# ------------------------------------------------------------------ errors
@pytest.mark.parametrize(
    ("row", "needle"),
    [
        ("2023-11-16 18:15:52.0000000,abc,5", "bad.csv:4: ContextTokens must be a positive integer, got 'abc'"),
        ("2023-11-16 18:15:52.0000000,5,0", "bad.csv:4: GeneratedTokens must be a positive integer, got '0'"),
        ("2023-11-16 18:15:52.0000000,5,", "bad.csv:4: GeneratedTokens must be a positive integer, got an empty value"),
        ("2023-11-16 18:15:52.0000000,2.5,5", "bad.csv:4: ContextTokens must be a positive integer, got '2.5'"),
        ("yesterday,5,5", "bad.csv:4: TIMESTAMP must be a timestamp"),
    ],
)  # fmt: skip
def test_bad_csv_row_names_file_line_and_field(tmp_path: Path, row: str, needle: str) -> None:
    lines = AZURE_TEXT.splitlines()
    text = "\n".join([*lines[:3], row, lines[3]]) + "\n"
    with pytest.raises(w.WorkloadError) as err:
        w.load_trace(write(tmp_path, "bad.csv", text))
    assert needle in str(err.value)


def test_blank_lines_do_not_shift_line_numbers(tmp_path: Path) -> None:
    text = "arrival_s,prompt_tokens,output_tokens\n0,1,1\n\n1,-3,1\n"
    with pytest.raises(w.WorkloadError, match=r"p\.csv:4: prompt_tokens must be a positive"):
        w.load_trace(write(tmp_path, "p.csv", text))


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ('{"timestamp": 0, "input_length": 10, "output_length": 0, "hash_ids": [1]}', "m.jsonl:2: output_length must be a positive integer, got 0"),
        ('{"timestamp": 0, "input_length": 10, "hash_ids": [1]}', "m.jsonl:2: missing key 'output_length'"),
        ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1, 2]}', "m.jsonl:2: hash_ids has 2 ids but input_length 10 needs 1"),
        ('{"timestamp": "x", "input_length": 10, "output_length": 1, "hash_ids": [1]}', "m.jsonl:2: timestamp must be a finite number"),
        ("{not json", "m.jsonl:2: not valid JSON"),
    ],
)  # fmt: skip
def test_bad_jsonl_row_names_file_line_and_field(tmp_path: Path, line: str, needle: str) -> None:
    good = '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}'
    path = write(tmp_path, "m.jsonl", f"{good}\n{line}\n")
    with pytest.raises(w.WorkloadError) as err:
        w.load_trace(path, fmt="mooncake")
    assert needle in str(err.value)


def test_file_and_format_errors(tmp_path: Path) -> None:
    with pytest.raises(w.WorkloadError, match="no such file"):
        w.load_trace(tmp_path / "missing.csv")
    with pytest.raises(w.WorkloadError, match="known: auto, azure, mooncake, plain"):
        w.load_trace(write(tmp_path, "a.csv", AZURE_TEXT), fmt="burstgpt")
    with pytest.raises(w.WorkloadError, match="empty"):
        w.load_trace(write(tmp_path, "e.csv", "\n"))
    with pytest.raises(w.WorkloadError, match=r"u\.csv:1: unrecognised trace format"):
        w.load_trace(write(tmp_path, "u.csv", "a,b\n1,2\n"))
    with pytest.raises(w.WorkloadError, match="missing column.*TIMESTAMP"):
        w.load_trace(
            write(tmp_path, "p.csv", "arrival_s,prompt_tokens,output_tokens\n0,1,1\n"), "azure"
        )


def test_malformed_csv_and_binary_file(tmp_path: Path) -> None:
    text = AZURE_TEXT + "2023-11-16 18:15:52.0000000,1,2,3\n"
    with pytest.raises(
        w.WorkloadError, match=r"x\.csv: not a valid CSV \(Expected 3 fields in line 5"
    ):
        w.load_trace(write(tmp_path, "x.csv", text))
    binary = tmp_path / "b.csv"
    binary.write_bytes(b"\x00\xff\xfe\xf0abc\n")
    with pytest.raises(w.WorkloadError, match="not UTF-8 text"):
        w.load_trace(binary)


def test_errors_are_value_errors() -> None:
    assert issubclass(w.WorkloadError, ValueError)


# --------------------------------------------------------- select, rescale
def test_select_windows_then_rebases() -> None:
    reqs = [req(i, 10, 2, arrival=float(i)) for i in range(10)]
    kept = w.select(reqs, start_s=2.0, end_s=7.0, skip=1, num_requests=3)
    assert [r.request_id for r in kept] == ["r3", "r4", "r5"]
    assert [r.arrival_time_s for r in kept] == [0.0, 1.0, 2.0]
    assert w.select(reqs, start_s=20.0) == []
    with pytest.raises(w.WorkloadError):
        w.select(reqs, num_requests=0)


def test_rescale_inf_puts_all_at_zero() -> None:
    reqs = [req(i, 10, 2, arrival=float(i)) for i in range(5)]
    out = w.rescale_arrivals(reqs, request_rate=math.inf)
    assert [r.arrival_time_s for r in out] == [0.0] * 5
    assert [r.request_id for r in out] == [r.request_id for r in reqs]


@pytest.mark.parametrize("burstiness", [0.5, 1.0, 4.0])
def test_rescale_gamma_mean_gap_and_cv(burstiness: float) -> None:
    reqs = [req(i, 10, 2) for i in range(20_001)]
    out = w.rescale_arrivals(reqs, request_rate=4.0, burstiness=burstiness, seed=3)
    gaps = np.diff([r.arrival_time_s for r in out])
    assert out[0].arrival_time_s == 0.0
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


def test_rescale_is_seeded_and_validates() -> None:
    reqs = [req(i, 10, 2) for i in range(50)]
    a = w.rescale_arrivals(reqs, request_rate=2.0, seed=7)
    assert a == w.rescale_arrivals(reqs, request_rate=2.0, seed=7)
    assert a != w.rescale_arrivals(reqs, request_rate=2.0, seed=8)
    with pytest.raises(w.WorkloadError, match="request_rate"):
        w.rescale_arrivals(reqs, request_rate=0.0)


def test_rescale_empty_workload() -> None:
    assert w.rescale_arrivals([], request_rate=1.0) == []


def test_time_scale() -> None:
    out = w.time_scale([req(0, 1, 1, 0.0), req(1, 1, 1, 4.0)], 0.5)
    assert [r.arrival_time_s for r in out] == [0.0, 2.0]


# ---------------------------------------------------------------- synthetic
@pytest.mark.parametrize("name", list(w.SEED_WORKLOADS))
def test_seed_workloads_reproduce_printed_totals(name: str) -> None:
    exp = w.SEED_WORKLOADS[name]
    reqs = w.seed_workload(name)
    assert len(reqs) == exp.spec.num_requests
    assert sum(r.num_prompt_tokens for r in reqs) == exp.num_prompt_tokens_total
    assert sum(r.max_output_tokens for r in reqs) == exp.num_output_tokens_total
    assert all(len(r.prompt_token_ids or ()) == r.num_prompt_tokens for r in reqs)


def test_seed_totals_match_the_posts() -> None:
    totals = {n: e.num_prompt_tokens_total for n, e in w.SEED_WORKLOADS.items()}
    assert totals["027"] == 128 and totals["004-prefix"] == 128
    assert (totals["031"], totals["032"], totals["033"]) == (632, 2528, 16864)


def test_synthetic_repeats_intervals_and_suffix() -> None:
    reqs = w.synthetic(8, prompt_tokens=2, prompt_repeats=[1, 3], submit_interval_s=0.02)
    assert [r.num_prompt_tokens for r in reqs[:2]] == [2 + 3, 6 + 3]
    assert reqs[3].arrival_time_s == pytest.approx(0.06)
    base = reqs[0].prompt_token_ids[:2]
    assert reqs[1].prompt_token_ids[:6] == base * 3
    assert len({r.prompt_token_ids for r in reqs}) == 8


def test_synthetic_shared_prompts_are_identical_and_seeded() -> None:
    reqs = w.synthetic(4, prompt_tokens=32, unique_prompts=False, seed=5)
    assert len({r.prompt_token_ids for r in reqs}) == 1
    assert reqs == w.synthetic(4, prompt_tokens=32, unique_prompts=False, seed=5)
    assert reqs != w.synthetic(4, prompt_tokens=32, unique_prompts=False, seed=6)


def test_seed_workload_overrides_and_errors() -> None:
    reqs = w.seed_workload("033", num_requests=8, prompt_repeats=[2])
    assert [r.num_prompt_tokens for r in reqs] == [5] * 8
    with pytest.raises(w.WorkloadError, match="known: 027"):
        w.seed_workload("999")
    with pytest.raises(w.WorkloadError, match="unknown workload keys"):
        w.seed_workload("027", prompt="Hello")


# ------------------------------------------------------- executor helpers
def test_with_token_ids_keeps_shared_hash_prefixes_equal() -> None:
    a = req(0, 1200, 1, prefix_hash_ids=(7, 8, 9))
    b = req(1, 1100, 1, prefix_hash_ids=(7, 8, 10))
    c = req(2, 300, 1)
    out = with_token_ids([a, b, c], vocab_size=100, seed=1)
    ta, tb, tc = (r.prompt_token_ids for r in out)
    assert (len(ta), len(tb), len(tc)) == (1200, 1100, 300)
    assert ta[:1024] == tb[:1024]
    assert ta[1024:1100] != tb[1024:1100]
    assert max(ta + tb + tc) < 100
    assert out == with_token_ids([a, b, c], vocab_size=100, seed=1)


def test_with_token_ids_keeps_given_ids() -> None:
    r = req(0, 3, 1, prompt_token_ids=(1, 2, 3))
    assert with_token_ids([r])[0] is r


def test_fit_lengths_clip() -> None:
    reqs = [req(0, 100, 10), req(1, 5000, 50), req(2, 10, 4000), req(3, 64, 64)]
    out, desc = fit_lengths(reqs, 128)
    assert [(r.num_prompt_tokens, r.max_output_tokens) for r in out] == [
        (100, 10),
        (78, 50),
        (1, 127),
        (64, 64),
    ]
    assert out[0] is reqs[0]
    assert desc.startswith("clipped 2 of 4 requests")


def test_fit_lengths_scale_keeps_hash_prefixes() -> None:
    reqs = [req(0, 1024, 976, prefix_hash_ids=(1, 2)), req(1, 100, 20)]
    out, desc = fit_lengths(reqs, 500, mode="scale")
    assert [(r.num_prompt_tokens, r.max_output_tokens) for r in out] == [(256, 244), (25, 5)]
    assert out[0].prefix_hash_block_tokens == 128
    assert out[0].prefix_hash_ids == (1, 2)
    assert "0.25" in desc
    assert all(r.max_num_tokens <= 500 for r in out)


def test_fit_lengths_noop_and_errors() -> None:
    reqs = [req(0, 10, 10)]
    assert fit_lengths(reqs, 100)[0] == reqs
    with pytest.raises(w.WorkloadError, match="known: clip, scale"):
        fit_lengths(reqs, 100, mode="squash")


# ------------------------------------------------------------ shared traces
def test_full_shared_traces_load() -> None:
    if not SHARED_TRACES.is_dir():
        pytest.skip(f"{SHARED_TRACES} not present")
    conv = w.load_trace(SHARED_TRACES / "AzureLLMInferenceTrace_conv.csv")
    mooncake = w.load_trace(SHARED_TRACES / "synthetic_trace.jsonl")
    assert len(conv) == 19_366
    assert conv[-1].arrival_time_s == pytest.approx(3501.72, abs=0.01)
    assert len(mooncake) == 3_993
    assert sum(len(r.prefix_hash_ids or ()) for r in mooncake) == 121_877
    assert mooncake[-1].arrival_time_s == pytest.approx(1022.0, abs=0.1)


def _pandas_path(path: Path) -> list[Request]:
    """The Azure loader with its csv/numpy path turned off (the pandas path)."""
    from roseinfer.workloads import traces

    fast = traces._azure_without_pandas
    traces._azure_without_pandas = lambda p: None  # type: ignore[assignment]
    try:
        return traces.load_trace(path)
    finally:
        traces._azure_without_pandas = fast  # type: ignore[assignment]


def test_azure_csv_path_gives_the_pandas_paths_requests_to_the_bit(tmp_path: Path) -> None:
    """The csv/numpy reader (no pandas import) and the pandas reader agree on the
    embedded sample and on odd sub-second stamps, ``T`` separators and extra columns."""
    from roseinfer.workloads import traces

    sample = Path(str(resources.files("roseinfer.workloads.data") / traces.DEFAULT_TRACE_NAME))
    odd = tmp_path / "odd.csv"
    odd.write_text(
        "X,TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "a,2023-11-16 18:15:46.6805900,10,2\n"
        "b,2023-11-16T18:15:46.6,3,7\n"
        "c,2023-11-16 18:15:45,5,1\n"
        "d,2023-11-17 00:00:00.000000001,2147483647,1\n"
    )
    for path in (sample, odd):
        fast = traces._azure_without_pandas(path)
        assert fast is not None and fast == _pandas_path(path)
    odd_times = [r.arrival_time_s for r in traces._azure_without_pandas(odd) or []]
    ns = [0, 1_600_000_000, 1_680_590_000, 20_655_000_000_001]  # from the earliest stamp
    assert odd_times == [n / 1e9 for n in ns]  # sorted, correctly rounded seconds


@pytest.mark.parametrize(
    "row",
    [
        "2023-11-16 18:15:46+00:00,1,1",
        "2023-11-16 18:15:46,0,1",
        "2023-11-16 18:15:46,1.0,1",
        "2023-11-16 18:15:46,1,1,9",
        "",
        "2023-11-16 18:15:46,+5,1",
        "2023-11-16 18:15:46,,1",
        "2023-11-16 18:15:46,12345678901,1",
        "2023-11-16 18:15:46,\u0663,1",
    ],  # fmt: skip
)
def test_azure_rows_the_csv_path_cannot_read_go_to_the_pandas_path(tmp_path: Path, row: str):
    from roseinfer.workloads import traces

    path = tmp_path / "t.csv"
    path.write_text(f"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:40,4,4\n{row}\n")
    assert traces._azure_without_pandas(path) is None
