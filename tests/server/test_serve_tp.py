"""``epmoe serve --parallel tp`` of a checkpoint without a tokenizer, under the ``torchrun`` environment: two
processes, rank 0 serving HTTP (its engine core in a process of its own), tensor-parallel experts over 2 gloo
ranks, token ids as text, one streamed chunk per token, no ``/eplb`` routes, SIGTERM drains every rank."""

from __future__ import annotations

import shutil
import signal

import httpx
import openai
import pytest

from epmoe.engine import Engine, EngineConfig, SamplingParams
from epmoe.models.tiny import ensure_default_checkpoint
from tests.server.conftest import API_KEY

pytestmark = pytest.mark.multiprocess

AUTH = {"Authorization": f"Bearer {API_KEY}"}
MODEL = "no-tokenizer"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The built-in checkpoint's config and weights, without its tokenizer."""
    out = tmp_path_factory.mktemp("ckpt") / MODEL
    out.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(ensure_default_checkpoint() / name, out / name)
    return out


@pytest.fixture(scope="module")
def server(start_server, checkpoint):
    return start_server("--parallel", "tp", "--model", str(checkpoint), torchrun_world=2)


def test_token_ids_stream_one_chunk_per_token(server, checkpoint):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    prompt = "tensor parallel experts"
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, extra_body={
        "ignore_eos": True}).choices[0].text
    ids = [int(t) for t in whole.split(" ")]
    offline = Engine(EngineConfig(model=str(checkpoint))).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    assert ids == offline.token_ids
    chunks = [c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=6, temperature=0, stream=True, extra_body={"ignore_eos": True})]
    assert len(chunks) == 6 and all(chunks)  # every token its own chunk, as it comes
    assert "".join(chunks) == whole


def test_tp_has_no_eplb_routes_and_no_stop_strings_without_tokenizer(server):
    for method, route in (("GET", "/eplb/loads"), ("POST", "/eplb/rebalance")):
        r = httpx.request(method, f"{server.url}{route}", headers=AUTH)
        assert r.status_code == 400 and "--parallel tp" in r.json()["error"]["message"], r.text
    r = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "hi", "stop": "x"}, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop" and "tokenizer" in r.json()["error"]["message"]
    metrics = httpx.get(f"{server.url}/metrics").text
    assert "epmoe:eplb_balancedness{" not in metrics
    assert 'epmoe:collectives_per_step{kind="all_reduce"}' in metrics  # the TP experts' all-reduces


def test_sigterm_under_torchrun_stops_every_rank_with_0(server):
    assert len(server.rank_pids()) == 1  # rank 0's engine core; rank 1 is torchrun's own process
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(60) == 0
    assert [p.wait(30) for p in server.followers] == [0]
