"""CPU weight sync: safetensors in a shared directory + vLLM's reload_weights, checked against a real vLLM server."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import requests
import torch
from safetensors.torch import load_file

from grpo_trainer.rollout import weight_sync
from grpo_trainer.rollout.server_set import ServerSet
from grpo_trainer.rollout.weight_sync import (
    TIED_EMBEDDING_ALIASES,
    FilesystemWeightTransfer,
    WeightSyncError,
    with_aliases,
    write_checkpoint,
)
from tests.support.paths import COMPLETIONS_SERVER
from tests.support.ports import free_port
from tests.support.servers.vllm_server import sync_weights

PROMPT = [1, 93, 91, 306, 207, 288]


def test_checkpoint_is_sharded_by_size_and_keeps_every_tensor(tmp_path):
    base = torch.arange(12, dtype=torch.float32)
    pairs = [("a", base[:6].view(2, 3)), ("b", base[6:]), ("c", torch.ones(4)), ("tied", base[:6].view(2, 3))]
    written = write_checkpoint(iter(pairs), tmp_path / "ckpt", shard_bytes=30)
    shards = sorted(os.listdir(tmp_path / "ckpt"))
    assert len(shards) > 1
    loaded = {}
    for shard in shards:
        loaded.update(load_file(str(tmp_path / "ckpt" / shard)))
    assert set(loaded) == {"a", "b", "c", "tied"}
    assert torch.equal(loaded["tied"], pairs[0][1]) and torch.equal(loaded["b"], base[6:])
    assert written == sum(t.numel() * 4 for _, t in pairs)


def test_an_empty_stream_is_an_error_not_an_empty_sync(tmp_path):
    with pytest.raises(WeightSyncError, match="no weights"):
        write_checkpoint(iter([]), tmp_path / "ckpt")


def test_tied_embedding_is_also_written_as_the_output_embedding():
    embedding = torch.zeros(2)
    names = [name for name, _ in with_aliases([("model.embed_tokens.weight", embedding), ("x", embedding)],
                                              TIED_EMBEDDING_ALIASES)]
    assert names == ["model.embed_tokens.weight", "lm_head.weight", "x"]


def test_an_unreachable_server_fails_the_sync_loudly(tmp_path):
    sync = FilesystemWeightTransfer(["http://127.0.0.1:9"], tmp_path, timeout_s=2, ready_timeout_s=1)
    with pytest.raises(WeightSyncError, match="did not become healthy"):
        sync.init_weight_transfer()
    with pytest.raises(WeightSyncError, match="/pause"):
        sync.pause()


def test_a_restarted_learner_continues_the_version_count(tmp_path):
    # The previous learner reached v5 and crashed while writing v6.
    for name in ("v4", "v5", ".v6.partial-77"):
        (tmp_path / name).mkdir()
    url = "http://127.0.0.1:9"
    sync = FilesystemWeightTransfer([url], tmp_path, servers=ServerSet([url]))
    sync.init_weight_transfer()
    assert sync.version == 5  # its next sync is v6, not v1 again
    assert sorted(os.listdir(tmp_path)) == ["v5"]  # what a restarted server catches up to; nothing else


def greedy_logprob_vllm(url: str, model: str) -> float:
    answer = requests.post(f"{url}/v1/completions", json={
        "model": model, "prompt": PROMPT, "max_tokens": 1, "temperature": 0, "logprobs": 1}, timeout=60).json()
    return answer["choices"][0]["logprobs"]["token_logprobs"][0]


def greedy_logprob_hf(model) -> float:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([PROMPT])).logits[0, -1], -1).max().item()


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("perturbed", ["self_attn", "mlp", "embed_tokens", ""])
def test_after_a_sync_the_server_generates_with_the_learners_weights(vllm_server, tmp_path, perturbed):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(vllm_server.model)
    assert model.config.tie_word_embeddings  # the case vLLM's reload gets wrong without the lm_head alias
    torch.manual_seed(7)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if perturbed in name:  # "" perturbs everything
                parameter.add_(torch.randn_like(parameter) * 0.3)
    sync = sync_weights(vllm_server, model.named_parameters(), tmp_path / "weights")
    assert greedy_logprob_vllm(vllm_server.url, vllm_server.model) == pytest.approx(greedy_logprob_hf(model), abs=1e-4)
    assert requests.get(f"{vllm_server.url}/weight_info", timeout=10).json()["weight_version"] == "v1"
    assert len(sync.sync_seconds) == 1
    assert sorted(os.listdir(tmp_path / "weights")) == ["v1"]  # complete versions only, no partial directory


def test_a_hung_server_leaves_the_pool_at_the_pause_instead_of_holding_the_sync(tmp_path):
    # A SIGSTOPped server holds the connection open and answers nothing; /pause?mode=keep answers at once otherwise.
    ports = [free_port(), free_port()]
    servers = [subprocess.Popen([sys.executable, str(COMPLETIONS_SERVER), "s",
                                 str(port)], stdout=subprocess.PIPE, text=True) for port in ports]
    try:
        for server in servers:
            server.stdout.readline()
        urls = [f"http://127.0.0.1:{port}" for port in ports]
        replicas = ServerSet(urls)
        for url in urls:
            replicas.admitted(url)
        os.kill(servers[1].pid, signal.SIGSTOP)
        sync = FilesystemWeightTransfer(urls, tmp_path, servers=replicas, pause_timeout_s=1)
        sync.pause()
    finally:
        for server in servers:
            server.kill()
            server.wait()
    report = {r.url: r for r in replicas.report()}
    assert report[urls[0]].ready and not report[urls[1]].ready
    assert "/pause: no answer within 1s" in report[urls[1]].last_error


def test_a_learner_told_to_stop_leaves_a_sync_held_by_a_frozen_server_at_once(tmp_path):
    # SIGTERM (a node drain) while the pause waits on a server that stopped answering: the learner has the pod's
    # grace period to reach its checkpoint, so the sync stops waiting on servers (a restarted learner syncs them all
    # first). Without it the pause waited its timeout, then the sync waited for a server to come back.
    port = free_port()
    server = subprocess.Popen([sys.executable, str(COMPLETIONS_SERVER), "s",
                               str(port)], stdout=subprocess.PIPE, text=True)
    try:
        server.stdout.readline()
        url = f"http://127.0.0.1:{port}"
        replicas = ServerSet([url])
        replicas.admitted(url)
        os.kill(server.pid, signal.SIGSTOP)
        sync = FilesystemWeightTransfer([url], tmp_path, servers=replicas, pause_timeout_s=120, ready_timeout_s=600)
        threading.Timer(0.5, sync.stop_waiting).start()
        began = time.monotonic()
        sync.pause()
        sync.send_weights(iter([("weight", torch.ones(2))]))
        sync.resume()
        waited = time.monotonic() - began
    finally:
        server.kill()
        server.wait()
    assert waited < 60, f"the sync held the stopping learner {waited:.0f} s"  # the pause's timeout alone is 120 s
    assert sorted(os.listdir(tmp_path)) == ["v1"]  # the weights are still published for the restarted learner


class AdapterServer:
    """A vLLM-shaped aiohttp server on its own loop thread that keeps the adapters loaded on it as vLLM does: a name
    loaded twice is answered 400 "has already been loaded", a path without an adapter is refused."""

    def __init__(self, serves_adapters: bool = True):
        from aiohttp import web

        self.loaded: list[str] = []
        self.paths: dict[str, str] = {}  # what each loaded name serves
        self.calls: list[str] = []
        self.version: str | None = None
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, daemon=True).start()

        async def load(request):
            body = await request.json()
            self.calls.append(f"load {body['lora_name']}")
            if body["lora_name"] in self.loaded:
                return web.json_response({"message": f"The lora adapter '{body['lora_name']}' has already been "
                                                     "loaded."}, status=400)
            if not os.path.isfile(os.path.join(body["lora_path"], "adapter_config.json")):
                return web.json_response({"message": "no adapter there"}, status=404)
            self.loaded.append(body["lora_name"])
            self.paths[body["lora_name"]] = body["lora_path"]
            return web.json_response({})

        async def unload(request):
            name = (await request.json())["lora_name"]
            self.calls.append(f"unload {name}")
            self.loaded.remove(name)
            return web.json_response({})

        async def version(request):
            self.version = (await request.json())["new_version"]
            return web.json_response({})

        async def step(request):
            self.calls.append(request.path)
            return web.json_response({})

        app = web.Application()
        routes = {"/update_weight_version": version, "/pause": step, "/resume": step}
        if serves_adapters:  # vLLM adds these only with VLLM_ALLOW_RUNTIME_LORA_UPDATING
            routes |= {"/v1/load_lora_adapter": load, "/v1/unload_lora_adapter": unload}
        for path, handler in routes.items():
            app.router.add_post(path, handler)

        async def not_found(_request):  # FastAPI's answer to a path it does not have
            return web.json_response({"detail": "Not Found"}, status=404)

        app.router.add_route("*", "/{tail:.*}", not_found)
        self._runner = web.AppRunner(app)

        async def start():
            await self._runner.setup()
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            await site.start()
            return site._server.sockets[0].getsockname()[1]

        self.url = f"http://127.0.0.1:{asyncio.run_coroutine_threadsafe(start(), self._loop).result(10)}"

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)


@pytest.fixture
def adapter_servers():
    servers = [AdapterServer(), AdapterServer()]
    yield servers
    for server in servers:
        server.close()


def sync_adapter(transfer: FilesystemWeightTransfer) -> None:
    """One adapter sync as the learner makes it: saved (staged, then renamed into place), loaded, resumed."""
    transfer.pause()
    destination = transfer.adapter_directory()
    staging = destination.parent / f".{destination.name}.tmp"
    staging.mkdir()
    (staging / "adapter_config.json").write_text('{"r": 4}')
    (staging / "adapter_model.safetensors").write_bytes(b"\0" * 1000)
    staging.rename(destination)
    transfer.publish_adapter()
    transfer.resume()
    transfer.retire_stale_adapter()


def test_an_adapter_sync_loads_the_adapter_on_every_replica_and_keeps_each_ones_version(adapter_servers, tmp_path):
    urls = [server.url for server in adapter_servers]
    replicas = ServerSet(urls)
    for url in urls:
        replicas.admitted(url)
    transfer = FilesystemWeightTransfer(urls, tmp_path, servers=replicas, adapter_window=2)
    transfer.init_weight_transfer()
    for _ in range(3):
        sync_adapter(transfer)
    for server in adapter_servers:
        # the version that left the window (max_staleness + 1 = 2 versions) is unloaded once the next is loaded
        assert server.loaded == ["policy-v2", "policy-v3"]
        assert server.calls[-4:] == ["/pause", "load policy-v3", "/resume", "unload policy-v1"]
        assert server.version == "v3"
    assert [replica.weight_version for replica in replicas.report()] == ["v3", "v3"]
    # the unloaded adapter's files outlive it by one sync: vLLM reads them lazily
    assert sorted(os.listdir(tmp_path)) == ["v1", "v2", "v3"]
    assert transfer.bytes_written == 1008
    sync_adapter(transfer)
    assert sorted(os.listdir(tmp_path)) == ["v2", "v3", "v4"]


def test_a_replica_admitted_late_catches_up_to_every_adapter_a_request_may_still_name(adapter_servers, tmp_path):
    early, late = adapter_servers
    replicas = ServerSet([early.url, late.url])
    replicas.admitted(early.url)
    transfer = FilesystemWeightTransfer([early.url, late.url], tmp_path, servers=replicas, adapter_window=2)
    transfer.init_weight_transfer()
    for _ in range(3):
        sync_adapter(transfer)
    assert late.loaded == []  # out of the pool: no sync reached it
    late.loaded.append("policy-v2")  # it had v2 before it failed: loaded again, from this run's files
    late.paths["policy-v2"] = "/elsewhere/v2"
    transfer.catch_up(late.url)
    assert late.loaded == ["policy-v2", "policy-v3"]  # oldest first, the whole window
    assert late.calls == ["load policy-v2", "unload policy-v2", "load policy-v2", "load policy-v3", "/resume"]
    assert late.paths == {"policy-v2": str(tmp_path / "v2"), "policy-v3": str(tmp_path / "v3")}
    assert late.version == "v3"
    assert {replica.url: replica.weight_version for replica in replicas.report()}[late.url] == "v3"


def test_an_adapter_name_another_run_left_on_a_reused_server_serves_this_runs_adapter(adapter_servers, tmp_path):
    # A `grporun local --rollout-url` server keeps the adapters of the run before: same names, other weights.
    server = adapter_servers[0]
    server.loaded.append("policy-v1")
    server.paths["policy-v1"] = "/runs/earlier/weights/v1"
    replicas = ServerSet([server.url])
    replicas.admitted(server.url)
    transfer = FilesystemWeightTransfer([server.url], tmp_path / "weights", servers=replicas, adapter_window=2)
    transfer.init_weight_transfer()
    sync_adapter(transfer)
    assert server.paths["policy-v1"] == str(tmp_path / "weights" / "v1")
    assert server.calls[-4:] == ["load policy-v1", "unload policy-v1", "load policy-v1", "/resume"]


def test_an_adapter_sync_with_no_adapter_saved_fails_by_name(adapter_servers, tmp_path):
    url = adapter_servers[0].url
    transfer = FilesystemWeightTransfer([url], tmp_path, servers=ServerSet([url]))
    transfer.init_weight_transfer()
    with pytest.raises(WeightSyncError, match="no adapter was saved in .*v1"):
        transfer.publish_adapter()


def test_a_server_that_does_not_load_adapters_fails_the_sync_naming_what_it_needs(tmp_path):
    server = AdapterServer(serves_adapters=False)
    try:
        transfer = FilesystemWeightTransfer([server.url], tmp_path, servers=ServerSet([server.url]),
                                            ready_timeout_s=0)
        transfer.servers.admitted(server.url)
        transfer.init_weight_transfer()
        with pytest.raises(WeightSyncError, match="no rollout server was ready"):
            sync_adapter(transfer)
        error = transfer.servers.report()[0].last_error
    finally:
        server.close()
    assert "does not load LoRA adapters: it needs --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1" in error


def test_a_sync_waiting_for_a_ready_server_says_so_once_per_interval_not_each_second(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(weight_sync, "WAIT_LOG_INTERVAL_S", 1.5)
    url = f"http://127.0.0.1:{free_port()}"  # never admitted: no server is ready
    transfer = FilesystemWeightTransfer([url], tmp_path, servers=ServerSet([url]), ready_timeout_s=3.0)
    with caplog.at_level("WARNING", logger=weight_sync.__name__), pytest.raises(WeightSyncError, match="ready within"):
        transfer.pause()
    waits = [r.getMessage() for r in caplog.records if "waits for a rollout server" in r.getMessage()]
    assert len(waits) == 2, waits  # at 0 s and 2 s of the one-second polls
    assert waits[0] == "weight sync: pause waits for a rollout server to be ready (0 s so far, at most 3 s)"
