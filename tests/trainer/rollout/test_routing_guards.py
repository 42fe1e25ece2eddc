"""The guards of the request path, on the real pieces: the session's vLLM CPU server started through the rollout
entrypoint (its weight-version gate in vLLM's app), the worker's router in a process of its own, the learner's
supervision and its weight sync with the real catch-up; scripted servers where one must die or hold its requests.

- a server that holds an older version than the pool (as a restarted one does) is not used before its catch-up;
- a request on a server that dies is sent again to another;
- a draining server is given no new request, and its requests in flight finish there.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import requests

from grpo_trainer.contract.codes import ReplicaState
from grpo_trainer.contract.rollout_pod import (
    MIN_WEIGHT_VERSION_HEADER,
    SERVED_WEIGHT_VERSION_HEADER,
    WEIGHT_REFUSED_STATUS,
)
from grpo_trainer.rollout.run_config_watch import RolloutUrlsWatch
from grpo_trainer.rollout.weight_sync import TIED_EMBEDDING_ALIASES, FilesystemWeightTransfer
from tests.support.paths import COMPLETIONS_SERVER
from tests.support.routing import Routing, routing
from tests.trainer.rollout.test_membership import write_config

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

SCRIPTED = "scripted"  # the text every completion of the scripted server carries


@pytest.fixture
def scripted():
    """A scripted server (tests/support/servers/completions_server.py) that holds its completions while paused."""
    process = subprocess.Popen([sys.executable, str(COMPLETIONS_SERVER), SCRIPTED, "--pause-holds"],
                               stdout=subprocess.PIPE, text=True)
    yield process, process.stdout.readline().strip()
    process.kill()
    process.wait()


def transfer_for(pool: Routing, weights: Path) -> FilesystemWeightTransfer:
    """The weight sync over the pool's servers, and the supervision's admission its catch-up, as in the learner. The
    servers admitted before it is set were admitted at version 0, which the catch-up would not have changed."""
    transfer = FilesystemWeightTransfer(pool.servers.urls, weights, servers=pool.servers,
                                        aliases=TIED_EMBEDDING_ALIASES)
    transfer.init_weight_transfer()
    pool.supervisor.admit = transfer.catch_up
    return transfer


def admissions(pool: Routing, url: str) -> int:
    return next(route.admissions for route in pool.servers.routes().servers if route.url == url)


def sync_model(transfer: FilesystemWeightTransfer, model: str) -> None:
    """A weight sync of the model's own weights to every server in the pool: the pool's next version."""
    from transformers import AutoModelForCausalLM

    transfer.pause()
    transfer.send_weights(iter(list(AutoModelForCausalLM.from_pretrained(model).named_parameters())))
    transfer.resume()


def needs(server, version: str) -> requests.Response:
    """One completion from the real server, naming `version` as the least it must hold."""
    return requests.post(f"{server.url}/v1/completions", headers={MIN_WEIGHT_VERSION_HEADER: version}, timeout=60,
                         json={"model": server.model, "prompt": [1, 2, 3], "max_tokens": 1})


def test_a_server_behind_the_pool_as_a_restarted_one_is_refuses_until_its_catch_up(vllm_server, scripted, tmp_path):
    _, other = scripted
    real = vllm_server.url
    at_catch_up: list[int] = []
    with routing([real, other], model=vllm_server.model) as pool:
        transfer = transfer_for(pool, tmp_path / "weights")
        catch_up = transfer.catch_up

        def noted_catch_up(url: str) -> None:
            if url == real:
                at_catch_up.append(pool.report()[real].samples)  # what it served before this catch-up
            catch_up(url)

        pool.supervisor.admit = noted_catch_up
        pool.wait_ready(2)
        sync_model(transfer, vllm_server.model)
        version = f"v{transfer.version}"
        assert pool.servers.pool_version == transfer.version
        assert needs(vllm_server, version).status_code == 200
        # What a restarted server holds: the model it loaded, vLLM's "default" version. The learner has not noticed
        # the restart; the router still routes to it.
        requests.post(f"{real}/update_weight_version", json={"new_version": "default"}, timeout=30).raise_for_status()
        refused = needs(vllm_server, version)
        assert refused.status_code == WEIGHT_REFUSED_STATUS and refused.headers[SERVED_WEIGHT_VERSION_HEADER] == "v0"
        served_before = pool.report()[real].samples
        results = pool.send(24, window=8)
        pool.wait_for(lambda: admissions(pool, real) >= 2, "the server's catch-up", timeout_s=120)
        later = pool.send(16, window=8)
        report = pool.report()
    assert [status for status, _ in results + later] == [200] * 40
    assert report[real].failures >= 1 and "holds weights v0" in report[real].last_error  # refused, not served
    # Every completion it gave after the reset came after its catch-up had loaded the pool's version again.
    assert at_catch_up[-1] == served_before
    assert any(text != SCRIPTED for _, text in later)  # and then it served again
    assert requests.get(f"{real}/weight_info", timeout=30).json()["weight_version"] == version


def test_requests_on_a_server_that_dies_are_sent_again_to_the_real_one(vllm_server, scripted, tmp_path):
    dying, dying_url = scripted
    real = vllm_server.url
    with routing([real, dying_url], model=vllm_server.model) as pool:
        transfer = transfer_for(pool, tmp_path / "weights")
        pool.wait_ready(2)
        sync_model(transfer, vllm_server.model)
        requests.post(f"{dying_url}/pause", timeout=10)  # its completions stay in flight
        sending = pool.start_sending(4)
        pool.wait_for(lambda: pool.servers.in_flight(dying_url) == 2 and pool.report()[real].samples == 2,
                      "two requests in flight on the server about to die", timeout_s=120)
        dying.kill()
        results = sending.result(timeout_s=120)
        report = pool.report()
    assert [status for status, _ in results] == [200] * 4
    assert SCRIPTED not in {text for _, text in results}  # all four were generated by the real server
    assert report[dying_url].failures >= 2 and not report[dying_url].ready
    assert report[real].retried == 2  # both were sent again, none lost


def test_a_draining_server_gets_no_new_request_and_finishes_those_in_flight(vllm_server, scripted, tmp_path):
    _, draining = scripted
    real = vllm_server.url
    run_json = tmp_path / "run.json"
    write_config(run_json, [real, draining])
    with routing([real, draining], model=vllm_server.model,
                 watch=RolloutUrlsWatch(run_json, [real, draining])) as pool:
        transfer = transfer_for(pool, tmp_path / "weights")
        pool.wait_ready(2)
        sync_model(transfer, vllm_server.model)
        requests.post(f"{draining}/pause", timeout=10)
        first = pool.start_sending(4)
        pool.wait_for(lambda: pool.servers.in_flight(draining) == 2, "two requests in flight on it", timeout_s=120)
        write_config(run_json, [real])
        pool.wait_for(lambda: pool.report()[draining].state == ReplicaState.DRAINING, "it to drain")
        during = pool.send(12, window=4)
        assert draining in pool.servers.urls  # still reported: its two requests are in flight
        requests.post(f"{draining}/resume", timeout=10)
        first_results = first.result(timeout_s=120)
        pool.wait_for(lambda: draining not in pool.servers.urls, "it to leave the report")
        report = pool.report()
    assert [status for status, _ in first_results + during] == [200] * 16
    assert [text for _, text in first_results].count(SCRIPTED) == 2  # its requests in flight finished there
    assert SCRIPTED not in {text for _, text in during}  # no new request went to it
    assert list(report) == [real]
