"""Sleep mode (`serving.features.sleep_mode`): the device memory goes back and comes back, generation after a
level-1 wake is what it was, level 2 wakes to weights that must be updated first, requests meanwhile are
refused, and nothing compiles again."""

import os

import jax
import numpy as np
import pytest

from serving import LLM, SamplingParams
from serving.core.engine import EngineUnavailableError
from serving.core.model_runner import compilation_count
from serving.features.sleep_mode import SleepError
from serving.llm import default_checkpoint_dir

pytestmark = pytest.mark.skipif(not os.path.isdir(default_checkpoint_dir()), reason="needs the embedded model")

ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=32, min_token_bucket=32, page_size=16, max_model_len=128,
              num_pages=64)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = ["def __init__(self", "import os\n"]


def live_bytes() -> int:
    return sum(x.nbytes for x in jax.live_arrays())


def tokens(llm):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def llm():
    return LLM(warmup=True, **ENGINE)


def test_level_1_frees_weights_and_kv_and_wakes_to_the_same_tokens(llm):
    before_tokens = tokens(llm)
    runner = llm.engine.runner
    weights_and_kv = runner.param_bytes + runner.cache_bytes
    compiled = compilation_count()
    before = live_bytes()
    llm.sleep(level=1)
    assert llm.is_sleeping
    freed = before - live_bytes()
    assert freed >= 0.95 * weights_and_kv, (freed, weights_and_kv)
    with pytest.raises(EngineUnavailableError, match="asleep"):
        llm.generate(PROMPTS, GREEDY)
    with pytest.raises(ValueError, match="the weights are asleep"):
        llm.update_weights({})
    with pytest.raises(ValueError, match="the weights are asleep"):
        llm.get_weights()
    with pytest.raises(SleepError, match="asleep already"):
        llm.sleep(level=1)
    llm.wake_up(tags=["weights"])
    with pytest.raises(EngineUnavailableError, match="kv_cache"):
        llm.generate(PROMPTS, GREEDY)
    llm.wake_up()
    assert not llm.is_sleeping
    assert tokens(llm) == before_tokens
    assert compilation_count() == compiled, "waking recompiled a step program"


def test_level_2_wakes_to_weights_that_wait_for_an_update(llm):
    want = tokens(llm)
    saved = jax.device_get(llm.get_weights())
    version = llm.weight_version
    llm.sleep(level=2)
    llm.wake_up(tags=["weights"])
    with pytest.raises(EngineUnavailableError, match="kv_cache"):
        llm.generate(PROMPTS, GREEDY)
    llm.wake_up(tags=["kv_cache"])
    with pytest.raises(EngineUnavailableError, match="update_weights before generating"):
        llm.generate(PROMPTS, GREEDY)
    assert all(not np.any(np.asarray(x)) for x in jax.tree.leaves(llm.get_weights()))  # zeros: no contents kept
    llm.update_weights(saved)
    assert llm.weight_version == version + 1 and not llm.is_sleeping
    assert tokens(llm) == want


def test_bad_sleeps_are_refused_and_lose_nothing(llm):
    with pytest.raises(SleepError, match="level: must be 1"):
        llm.sleep(level=3)
    with pytest.raises(SleepError, match="tags: unknown"):
        llm.wake_up(tags=["everything"])
    engine = llm.engine
    engine.add_request("busy", [1, 2, 3], GREEDY)
    with pytest.raises(SleepError, match="1 requests are unfinished"):
        llm.sleep()
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.block_manager.num_used_blocks == 0 and not llm.is_sleeping
    llm.wake_up()  # awake already: nothing to do
    assert tokens(llm)


# --- over HTTP (last: the server's loop owns the engine from here on) ---------------------------------


def test_rl_routes_sleep_wake_and_update_over_http(llm, tmp_path):
    import httpx

    from serving.api.http_auth import APIKeys
    from serving.api.rl_routes import RLRouteOptions
    from serving.server import ServerThread

    import shutil

    roots = tmp_path / "roots"
    checkpoint = str(roots / "copy")
    shutil.copytree(default_checkpoint_dir(), checkpoint)
    (roots / "link").symlink_to(default_checkpoint_dir())  # inside the roots, pointing out of them
    body = {"model": "m", "prompt": "def __init__(self", "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    key = {"Authorization": "Bearer k"}
    with ServerThread(llm, model_name="m", api_keys=APIKeys(["k"]),
                      rl_routes=RLRouteOptions(checkpoint_roots=(str(roots),))) as srv:
        def post(path, **kw):
            return httpx.post(srv.url + path, headers=key, timeout=120, **kw)

        want = post("/v1/completions", json=body).json()["choices"][0]["text"]
        assert httpx.post(srv.url + "/sleep", timeout=60).status_code == 401  # the API key guards them
        assert post("/sleep", params={"level": 3}).json()["error"]["message"].startswith("level: must be 1")
        assert post("/sleep", params={"level": 1}).status_code == 200
        asleep = post("/v1/completions", json=body)
        assert asleep.status_code == 503 and asleep.headers["retry-after"] == "5"
        assert asleep.json()["error"]["code"] == "engine_unavailable"
        assert httpx.get(srv.url + "/is_sleeping", headers=key, timeout=60).json()["is_sleeping"] is True
        assert post("/wake_up", params={"tags": ["weights", "kv_cache"]}).json()["asleep"] == []
        assert post("/v1/completions", json=body).json()["choices"][0]["text"] == want
        # Weight updates read only under the roots, symlinks resolved.
        assert post("/update_weights", json={"checkpoint": str(roots / "link")}).status_code == 403
        assert post("/update_weights", json={"checkpoint": str(roots / "copy" / ".." / ".." )}).status_code == 403
        assert post("/update_weights", json={"checkpoint": "/etc"}).status_code == 403
        assert post("/update_weights", json={"checkpoint": str(roots / "nothing")}).status_code == 404
        version = post("/update_weights", json={"checkpoint": checkpoint, "version": 7}).json()
        assert version == {"weight_version": 7}
        assert post("/reset_prefix_cache").status_code == 200
        assert post("/v1/completions", json=body).json()["choices"][0]["text"] == want  # the same weights again


def test_rl_routes_are_off_by_default(llm):
    import httpx

    from serving.server import ServerThread

    with ServerThread(llm, model_name="m") as srv:
        assert httpx.post(srv.url + "/sleep", timeout=60).status_code == 404
        assert httpx.post(srv.url + "/update_weights", json={"checkpoint": "/"}, timeout=60).status_code == 404
