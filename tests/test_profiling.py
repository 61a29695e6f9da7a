"""`POST /start_profile` and `/stop_profile`: a jax.profiler trace of a live server lands in --profile_dir."""

import gzip
import json
import os

import httpx
import jax
from fastapi.testclient import TestClient

from conftest import tiny_config
from model.params import init_params
from serving import LLM
from serving.api.http_app import create_app
from serving.server import ServerThread


def _error(r: httpx.Response) -> dict:
    assert r.status_code == 400, r.text
    return r.json()["error"]


def test_profile_routes_write_a_trace_of_the_running_server(tmp_path):
    cfg = tiny_config(vocab_size=320, bos_token_id=256, eos_token_ids=(257,))  # byte tokenizer
    llm = LLM(config=cfg, params=init_params(cfg, jax.random.key(0)), max_num_seqs=4, max_num_batched_tokens=16,
              min_token_bucket=16, page_size=8, num_pages=16, max_model_len=64, attention_backend="reference")
    profile_dir = tmp_path / "traces"
    with ServerThread(llm, model_name="tiny", profile_dir=str(profile_dir)) as srv:
        with httpx.Client(base_url=srv.url, timeout=120) as c:
            # One request first: the step compiles outside the trace, as after a server's warm-up.
            assert c.post("/v1/completions", json={"model": "tiny", "prompt": "ab", "max_tokens": 4}).status_code == 200
            err = _error(c.post("/stop_profile"))
            assert err["code"] == "profile_not_started" and err["type"] == "invalid_request_error"

            r = c.post("/start_profile")
            assert r.status_code == 200 and r.json()["profile_dir"] == str(profile_dir)
            assert _error(c.post("/start_profile"))["code"] == "profile_already_started"
            r = c.post("/v1/completions", json={"model": "tiny", "prompt": "abc", "max_tokens": 4,
                                                "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
            r = c.post("/stop_profile")
            assert r.status_code == 200, r.text
            files = r.json()["files"]

            # The trace is on disk where the response says, in the layout TensorBoard and Perfetto read.
            names = [os.path.basename(f) for f in files]
            assert any(n.endswith(".xplane.pb") for n in names), files
            assert "perfetto_trace.json.gz" in names, files
            assert all(os.path.isfile(f) and f.startswith(str(profile_dir / "plugins" / "profile")) for f in files)
            trace_json = next(f for f in files if f.endswith(".trace.json.gz") and "perfetto" not in f)
            with gzip.open(trace_json) as f:
                events = json.load(f)["traceEvents"]
            # The engine thread's steps ran while the trace was on (Python calls are named "$file:line function").
            names = {str(e.get("name", "")) for e in events}
            assert any(n.startswith("$engine.py:") and n.endswith(" step") for n in names), sorted(names)[:80]
            # The dispatch of the step's compiled executable.
            assert any(n.startswith("$model_runner.py:") and n.endswith(" _run") for n in names), sorted(names)[:80]

            # Stopped means stopped; a new trace can start and stop again.
            assert _error(c.post("/stop_profile"))["code"] == "profile_not_started"
            assert c.post("/start_profile").status_code == 200
            r = c.post("/stop_profile")
            assert r.status_code == 200 and any(f.endswith(".xplane.pb") for f in r.json()["files"]), r.text
            r = c.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2})
            assert r.status_code == 200  # still serving


def test_profile_routes_answer_400_when_no_directory_is_configured():
    client = TestClient(create_app(engine=None, tokenizer=None, model_name="m", max_model_len=16))
    for route in ("/start_profile", "/stop_profile"):
        err = _error(client.post(route))
        assert err["code"] == "profiling_disabled" and "--profile_dir" in err["message"]
