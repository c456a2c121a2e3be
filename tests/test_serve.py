"""``rose-serve`` over HTTP, measured by the ``openai`` client.

The server runs in this process (uvicorn in a thread, on a free localhost
port) around a tiny GPT-2 with random weights, so the test can look inside
the engine (blocks in use, records) while the client talks HTTP. A gate on
``runner.forward`` forces the interleavings (a full queue); nothing is timed.
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("prometheus_client")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from roseinfer.cli import serve as cli  # noqa: E402
from roseinfer.config import SchedulerConfig  # noqa: E402
from roseinfer.executor.engine import Engine  # noqa: E402
from roseinfer.executor.model_runner import ModelRunner  # noqa: E402
from roseinfer.executor.streaming import StreamingEngine  # noqa: E402
from roseinfer.request import Request, SamplingParams  # noqa: E402
from roseinfer.serve.app import ServerState, build_app  # noqa: E402
from roseinfer.serve.metrics import ServerMetrics  # noqa: E402
from roseinfer.serve.protocol import ModelContext  # noqa: E402
from roseinfer.serve.tokenizer import synthetic_tokenizer  # noqa: E402

torch.set_num_threads(1)

TIMEOUT_S = 20.0
VOCAB, EOS = 1000, 999
NAME = "tiny-gpt2"


@pytest.fixture(scope="module")
def model(tiny_gpt2):
    return tiny_gpt2  # conftest's shared tiny model


def make_engine(model, num_kv_blocks: int = 64, **cfg) -> Engine:
    config = SchedulerConfig(
        num_kv_blocks=num_kv_blocks,
        block_size=4,
        **{"max_num_seqs": 4, "max_model_len": 128, **cfg},
    )
    runner = ModelRunner(
        model, num_kv_blocks=num_kv_blocks, block_size=4, device="cpu", dtype=torch.float32
    )
    return Engine(runner, config)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """rose-serve's app on a free localhost port, in a thread of this process."""

    def __init__(self, model, max_waiting: int = 64, **cfg) -> None:
        tokenizer = synthetic_tokenizer(VOCAB, EOS)
        tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}t7"
        self.engine = make_engine(model, **cfg)
        self.se = StreamingEngine(self.engine, tokenizer, idle_wait_s=0.01, max_waiting=max_waiting)
        ctx = ModelContext(NAME, tokenizer, VOCAB, self.engine.scheduler.config.max_model_len)
        app = build_app(ServerState(self.se, ctx, ServerMetrics(self.se)))
        self.port = free_port()
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + TIMEOUT_S
        while not self.server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = openai.OpenAI(
            base_url=f"{self.url}/v1", api_key="none", max_retries=0, timeout=TIMEOUT_S
        )
        self.tokenizer = tokenizer

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(TIMEOUT_S)
        assert not self.thread.is_alive()

    def wait_idle(self) -> None:
        """Until every request ended and no KV block is held (aborts land at a step boundary)."""
        sched = self.engine.scheduler
        deadline = time.monotonic() + TIMEOUT_S
        while sched.has_unfinished() or sched.block_manager.num_used_blocks or self.se._streams:
            assert time.monotonic() < deadline, "requests or blocks left behind"
            time.sleep(0.01)


@pytest.fixture(scope="module")
def server(model):
    s = Server(model)
    yield s
    s.stop()


def greedy_ids(model, prompt: list[int], n: int) -> list[int]:
    r = Request("o", 0.0, len(prompt), n, tuple(prompt), sampling=SamplingParams())
    return make_engine(model).run([r]).records["output_token_ids"][0]


def text_of(server: Server, prompt: list[int], ids: list[int]) -> str:
    full = server.tokenizer.decode(prompt + ids, skip_special_tokens=True)
    return full[len(server.tokenizer.decode(prompt, skip_special_tokens=True)) :]


# ------------------------------------------------------------------ answers


def test_completion_equals_the_offline_engine_and_counts_usage(server, model):
    prompt = [5, 17, 300, 42]
    got = server.client.completions.create(
        model=NAME, prompt=prompt, max_tokens=9, temperature=0, extra_body={"ignore_eos": True}
    )
    assert got.choices[0].text == text_of(server, prompt, greedy_ids(model, prompt, 9))
    assert got.choices[0].finish_reason == "length"
    assert (got.usage.prompt_tokens, got.usage.completion_tokens, got.usage.total_tokens) == (
        4,
        9,
        13,
    )
    server.wait_idle()


def test_streaming_sends_one_chunk_per_token_then_usage(server, model):
    prompt = [9, 8, 7, 6, 5]
    chunks = list(
        server.client.completions.create(
            model=NAME,
            prompt=prompt,
            max_tokens=7,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    tokens = [c for c in chunks if c.choices]
    assert len(tokens) == 7
    assert "".join(c.choices[0].text for c in tokens) == text_of(
        server, prompt, greedy_ids(model, prompt, 7)
    )
    assert [c.choices[0].finish_reason for c in tokens] == [None] * 6 + ["length"]
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == 7
    server.wait_idle()


def test_text_prompts_stop_strings_and_seeds(server, model):
    prompt = [11, 12, 13]
    ids = greedy_ids(model, prompt, 12)
    text = "t11 t12 t13"
    full = server.client.completions.create(
        model=NAME, prompt=text, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    ).choices[0]
    assert full.text == text_of(server, prompt, ids)
    stop = f" t{ids[3]}"  # cut before the 4th token's word
    cut = server.client.completions.create(
        model=NAME,
        prompt=text,
        max_tokens=12,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    ).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full.text[: full.text.index(stop)]
    sampled = [
        server.client.completions.create(
            model=NAME, prompt=text, max_tokens=8, temperature=1.0, seed=s, extra_body={"top_k": 50}
        )
        .choices[0]
        .text
        for s in (3, 3, 4)
    ]
    assert sampled[0] == sampled[1] != sampled[2]
    server.wait_idle()


def test_chat_completions_use_the_chat_template(server, model):
    messages = [{"role": "user", "content": "t1 t2"}, {"role": "user", "content": "t3"}]
    prompt = [1, 2, 3, 7]  # the template: contents, then t7
    got = server.client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    want = text_of(server, prompt, greedy_ids(model, prompt, 5))
    assert got.choices[0].message.content == want and got.usage.prompt_tokens == 4
    stream = server.client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=5, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = [c for c in stream if c.choices]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content for c in chunks) == want
    server.wait_idle()


def test_models_and_health(server):
    assert [m.id for m in server.client.models.list()] == [NAME]
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}


# --------------------------------------------------------------- refusals

BAD_BODIES = [
    ("max_tokens", {"max_tokens": 2.5}),
    ("max_tokens", {"max_tokens": True}),
    ("max_tokens", {"max_tokens": 0}),
    ("max_tokens", {"max_tokens": 500}),  # prompt + output > max_model_len 128
    ("temperature", {"temperature": float("nan")}),
    ("temperature", {"temperature": -1}),
    ("temperature", {"temperature": "hot"}),
    ("top_p", {"top_p": 0}),
    ("top_p", {"top_p": 1.5}),
    ("top_k", {"top_k": -2}),
    ("top_k", {"top_k": 2.5}),
    ("seed", {"seed": 2**70}),
    ("seed", {"seed": 1.5}),
    ("prompt", {"prompt": [1.0, 2]}),
    ("prompt", {"prompt": [1, VOCAB]}),
    ("prompt", {"prompt": []}),
    ("prompt", {"prompt": "hello world"}),  # not in the synthetic vocabulary
    ("prompt", {"prompt": ["t1", "t2"]}),  # a batch
    ("stop", {"stop": 5}),
    ("stream", {"stream": "yes"}),
    ("ignore_eos", {"ignore_eos": 1}),
    ("stop_token_ids", {"stop_token_ids": [1.5]}),
    ("n", {"n": 2}),
    ("logprobs", {"logprobs": 3}),
    ("echo", {"echo": True}),
]


@pytest.mark.parametrize(
    ("field", "fields"), BAD_BODIES, ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD_BODIES)]
)
def test_bad_fields_answer_400_naming_the_field(server, field, fields):
    body = {"model": NAME, "prompt": [1, 2, 3], "max_tokens": 2, **fields}
    r = httpx.post(f"{server.url}/v1/completions", content=json.dumps(body), timeout=TIMEOUT_S)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and error["message"].startswith(f"{field}: ")
    assert server.client.completions.create(model=NAME, prompt=[1], max_tokens=1).usage


def test_openai_client_sees_bad_request_and_not_found(server):
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        server.client.completions.create(model=NAME, prompt=[1, 2], max_tokens=2.5)  # type: ignore[arg-type]
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        server.client.completions.create(model="gpt-4", prompt=[1, 2], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="no chat template|not valid JSON|messages"):
        server.client.chat.completions.create(model=NAME, messages=[], max_tokens=2)
    r = httpx.post(f"{server.url}/v1/completions", content=b"{not json", timeout=TIMEOUT_S)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]


# -------------------------------------------------- queue, disconnect, metrics


def test_a_full_waiting_queue_answers_503_then_serves_again(model):
    s = Server(model, max_waiting=2, max_num_seqs=1)
    forward, gate, entered = s.engine.runner.forward, threading.Event(), threading.Event()

    def gated(inputs):
        entered.set()
        assert gate.wait(TIMEOUT_S)
        return forward(inputs)

    s.engine.runner.forward = gated
    results: list[int] = []

    def post() -> None:
        body = {"model": NAME, "prompt": [1, 2, 3], "max_tokens": 3}
        results.append(
            httpx.post(f"{s.url}/v1/completions", json=body, timeout=TIMEOUT_S).status_code
        )

    try:
        threads = [threading.Thread(target=post)]
        threads[0].start()
        assert entered.wait(TIMEOUT_S)  # the first runs, held at the gate
        threads += [threading.Thread(target=post) for _ in range(2)]
        for t in threads[1:]:
            t.start()
        deadline = time.monotonic() + TIMEOUT_S
        while s.se.num_waiting() < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with pytest.raises(openai.APIStatusError) as info:
            s.client.completions.create(model=NAME, prompt=[4, 5], max_tokens=2)
        assert info.value.status_code == 503 and "max_waiting" in str(info.value)
        gate.set()
        for t in threads:
            t.join(TIMEOUT_S)
        assert results == [200, 200, 200]
        assert s.client.completions.create(model=NAME, prompt=[4, 5], max_tokens=2).usage
        s.wait_idle()
    finally:
        gate.set()
        s.stop()


def test_a_client_that_disconnects_aborts_and_frees_its_blocks(model):
    """The worker is held after 4 forwards (prefill + 3 tokens) while the client
    reads 3 chunks and leaves: the request is aborted although no chunk was being
    written, and its blocks and stream queue are freed."""
    s = Server(model)
    forward, permits = s.engine.runner.forward, threading.Semaphore(4)

    def gated(inputs):
        assert permits.acquire(timeout=TIMEOUT_S)
        return forward(inputs)

    s.engine.runner.forward = gated
    body = {
        "model": NAME,
        "prompt": [3, 4, 5],
        "max_tokens": 100,
        "stream": True,
        "ignore_eos": True,
    }
    try:
        got: list[str] = []
        with (
            httpx.Client(timeout=TIMEOUT_S) as http,
            http.stream("POST", f"{s.url}/v1/completions", json=body) as r,
        ):
            for line in r.iter_lines():
                got += [line] if line.startswith("data: {") else []
                if len(got) == 3:
                    break
        assert len(got) == 3
        deadline = time.monotonic() + TIMEOUT_S
        # the abort is queued while the worker is held (or, had the 4th forward not
        # run yet, already applied)
        while s.se._commands.qsize() == 0 and s.engine.scheduler.has_unfinished():
            assert time.monotonic() < deadline, "the disconnect was not noticed"
            time.sleep(0.01)
        permits.release(100_000)
        s.wait_idle()  # the abort freed every block and the stream's queue
        record = s.engine.records.frame().iloc[0]
        assert record.reject_reason == "aborted" and 3 <= record.num_output_tokens < 100
    finally:
        permits.release(100_000)
        s.stop()


def test_metrics_parse_and_count(server):
    server.client.completions.create(
        model=NAME, prompt=[1, 2, 3], max_tokens=3, extra_body={"ignore_eos": True}
    )
    text = httpx.get(f"{server.url}/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in (
        "roseinfer_num_requests_running",
        "roseinfer_num_requests_waiting",
        "roseinfer_kv_cache_usage_perc",
        "roseinfer_prefix_cache_hit_rate",
        "roseinfer_num_preemptions",
        "roseinfer_time_to_first_token_seconds",
        "roseinfer_inter_token_latency_seconds",
        "roseinfer_requests",
    ):
        assert name in families, name
    value = {s.name: s.value for f in families.values() for s in f.samples if not s.labels}
    assert value["roseinfer_num_requests_running"] == 0
    assert value["roseinfer_kv_cache_usage_perc"] == 0
    assert value["roseinfer_time_to_first_token_seconds_count"] >= 1
    assert value["roseinfer_inter_token_latency_seconds_count"] >= 2
    assert value["roseinfer_prefix_cache_queries_total"] > 0


@pytest.mark.parametrize(
    ("flags", "names"),
    [
        (["--max-waiting", "0"], "--max-waiting"),
        (["--save-records", f"{__file__}/r.csv"], "--save-records"),  # under a file
        (["--save-records", "records.txt"], "--save-records"),
        (["--num-kv-blocks", "8", "--kv-cache-memory-gb", "1"], "--num-kv-blocks"),
        (["--gpu-memory-utilization", "5"], "--gpu-memory-utilization"),  # rose-run's checks too
        (["--num-threads", "0"], "--num-threads"),
        (["--save-steps", "steps.csv"], "--save-steps"),
    ],
)
def test_cli_bad_flag_is_one_error_line_before_any_model_work(monkeypatch, capsys, flags, names):
    monkeypatch.setattr(sys, "argv", ["rose-serve", "--model", NAME, *flags])
    monkeypatch.setattr(cli, "build_engine", lambda *a: pytest.fail("built a model"))
    with pytest.raises(SystemExit) as info:
        cli.main()
    assert info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rose-serve: error: ") and names in lines[0]


def test_cli_flags_build_a_serving_engine(tmp_path):
    """rose-serve's flags, parsed and checked as main() does, give an engine that serves
    and logs its steps (``--save-steps``, closed at shutdown)."""
    from roseinfer.calibration.steplog import load_step_log
    from roseinfer.registry import load_registry

    args = cli.build_parser().parse_args(
        ["--model", NAME, "--device", "cpu", "--no-warmup", "--num-kv-blocks", "32",
         "--max-num-seqs", "4", "--max-waiting", "3", "--policy", "budget",
         "--prefill-max-tokens", "64", "--save-steps", str(tmp_path / "steps.jsonl")]
    )  # fmt: skip
    registry = load_registry()
    options = cli.check_serve_args(args, registry)
    se, config = cli.build_engine(args, registry, options)
    try:
        assert se.max_waiting == 3 and config.vocab_size == VOCAB
        assert se.engine.scheduler.config.prefix_caching_hash_algo == "sha256"
        assert se.tokenizer.decode([5, 6]) == "t5 t6"  # the synthetic vocabulary
        assert len(se.generate("t5 t6 t7", max_tokens=3, sampling=SamplingParams())) == 3
    finally:
        se.close()
        cli._save_outputs(args, se)
    log = load_step_log(tmp_path / "steps.jsonl")
    assert log.header["backend"] == "rose-serve" and log.executor["num_kv_blocks"] == 32
    assert [r.kind for r in log.records] == ["prefill", "decode", "decode"]
    assert log.records[0].num_new_tokens == (3,) and log.records[-1].num_context_tokens == (5,)


@pytest.mark.parametrize(("flags", "warned", "announced"), [
    ([], False, True),
    (["--length-predictor", "bucket"], True, False),
    (["--length-predictor", "oracle"], False, False),
])  # fmt: skip
def test_a_server_says_when_sjf_cannot_fit_its_predictor(capsys, flags, warned, announced):
    """Issue 18: a server has no workload to fit ``bucket`` on, so sjf on it is FIFO
    in disguise; rose-serve says so at start, and without --length-predictor it ranks
    by each request's max_tokens (oracle), saying which."""
    import socket

    from roseinfer.registry import load_registry

    with socket.socket() as probe:  # a free port for the address check
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    args = cli.build_parser().parse_args(
        ["--model", NAME, "--device", "cpu", "--port", str(port), "--policy", "sjf", *flags]
    )
    cli.check_serve_args(args, load_registry())
    err = capsys.readouterr().err
    assert ("rose-serve: warning: --policy sjf ranks by the bucket" in err) is warned
    assert ("ranks by the oracle length predictor, the default" in err) is announced
