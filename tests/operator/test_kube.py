"""grpo_operator.cluster.kube: object URLs and merge patches."""

from __future__ import annotations

from grpo_operator.cluster.kube import merge_patch_between, object_url


def test_merge_patch_between_nulls_removed_keys_and_replaces_lists():
    old = {"phase": "Running", "failure": {"pod": "a", "exitCode": 1}, "conditions": [{"type": "A"}], "keep": 1}
    new = {"phase": "Failed", "failure": {"pod": "a"}, "conditions": [{"type": "B"}], "keep": 1, "added": True}
    assert merge_patch_between(old, new) == {"phase": "Failed", "failure": {"exitCode": None},
                                             "conditions": [{"type": "B"}], "added": True}
    assert merge_patch_between(new, new) == {}



def test_object_urls():
    assert object_url("v1", "Pod", "ns", "p") == "/api/v1/namespaces/ns/pods/p"
    assert object_url("grpo.dev/v1alpha1", "GRPORun", "ns", "r", "status") == \
        "/apis/grpo.dev/v1alpha1/namespaces/ns/grporuns/r/status"


def test_the_operator_uses_kopfs_public_names_except_its_client():
    """kopf exports OperatorSettings, ConnectionInfo, LoginError and login_via_client; only its HTTP client
    (`kopf._cogs.clients`: api, errors, auth) has no public name. tests/support/emulator/test_kube_emulator.py checks
    that those internals still exist."""
    import re

    from tests.support.paths import REPO

    private = re.compile(r"^\s*(?:from|import) (kopf\._[\w.]*)", re.M)
    found = {(path.relative_to(REPO).as_posix(), module)
             for root in ("operator", "trainer_image") for path in (REPO / root).rglob("*.py")
             for module in private.findall(path.read_text())}
    assert {module for _, module in found} <= {"kopf._cogs.clients"}, sorted(found)
