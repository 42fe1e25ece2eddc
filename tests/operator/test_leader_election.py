"""Leader election (grpo_operator.cluster.leader) against the API emulator's Lease, over real HTTP: one holder at a
time, a standby takes over once the holder stops renewing, a clean exit hands the Lease over at once."""

from __future__ import annotations

import asyncio
import logging

import kopf
import pytest

from grpo_operator.cluster.leader import LeaderElector, LeadershipLost, LeaseClient, LeaseTimings
from tests.support.emulator.kube_emulator import LEASES, EmulatorThread, KubeClient, KubeEmulator

FAST = LeaseTimings(lease_duration=1.5, renew_deadline=1.0, retry_period=0.2)
LOGGER = logging.getLogger("test.leader")


@pytest.fixture()
def api():
    emulator = EmulatorThread(KubeEmulator()).start()
    yield emulator
    emulator.stop()


def elector(url: str, identity: str, timings: LeaseTimings = FAST) -> LeaderElector:
    settings = kopf.OperatorSettings()
    settings.networking.request_timeout = 2
    client = LeaseClient("default", "grpo-operator", settings, LOGGER,
                         login=lambda: kopf.ConnectionInfo(server=url, default_namespace="default"))
    return LeaderElector(client, identity, timings, LOGGER)


def holder(url: str) -> str | None:
    lease = KubeClient(url).get(LEASES, "default", "grpo-operator")
    return (lease or {}).get("spec", {}).get("holderIdentity")


def test_timings_must_leave_the_holder_time_to_stop_before_a_standby_takes_over():
    with pytest.raises(ValueError, match="renew deadline < lease duration"):
        LeaseTimings(lease_duration=10, renew_deadline=10, retry_period=2)


def test_one_holder_and_a_standby_that_takes_over_once_renewals_stop(api):
    async def scenario() -> None:
        a, b = elector(api.url, "a"), elector(api.url, "b")
        assert await a.try_acquire_or_renew()
        assert not await b.try_acquire_or_renew()  # held and fresh
        holding = asyncio.create_task(a.hold())
        await asyncio.sleep(3 * FAST.lease_duration)
        assert not await b.try_acquire_or_renew(), "a renewing holder kept its Lease"
        holding.cancel()  # "a" dies without releasing
        loop = asyncio.get_running_loop()
        stopped = loop.time()
        await asyncio.wait_for(b.acquire(), 10)
        assert loop.time() - stopped >= FAST.lease_duration - FAST.retry_period
        assert holder(api.url) == "b"
        # The old holder, were it still alive (a long pause), knows at its next renewal that it lost, and stops.
        with pytest.raises(LeadershipLost):
            await asyncio.wait_for(a.hold(), 5)
        lease = KubeClient(api.url).get(LEASES, "default", "grpo-operator")
        assert lease["spec"]["leaseTransitions"] == 1
        await a.client.close()
        await b.client.close()
    asyncio.run(scenario())


def test_a_released_lease_is_taken_within_a_retry_period(api):
    slow = LeaseTimings(lease_duration=30, renew_deadline=20, retry_period=0.2)

    async def scenario() -> None:
        a, b = elector(api.url, "a", slow), elector(api.url, "b", slow)
        assert await a.try_acquire_or_renew()
        await a.release()
        assert holder(api.url) is None
        await asyncio.wait_for(b.acquire(), 2)  # not the 30 s lease duration
        assert holder(api.url) == "b"
        await b.client.close()
    asyncio.run(scenario())


def test_a_holder_that_cannot_renew_gives_up_before_the_lease_expires(api):
    async def scenario() -> None:
        a = elector(api.url, "a")
        assert await a.try_acquire_or_renew()
        api.emulator.inject_fault("PUT", "leases", 500, "InternalError", "etcd unavailable", times=1000)
        loop = asyncio.get_running_loop()
        renewed = loop.time()
        with pytest.raises(LeadershipLost, match="not renewed"):
            await asyncio.wait_for(a.hold(), 10)
        assert loop.time() - renewed < FAST.lease_duration
        await a.client.close()
    asyncio.run(scenario())
