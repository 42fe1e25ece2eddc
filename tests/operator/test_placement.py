"""Which nodes a pod may land on, by the scheduler's rules for nodeSelector, required node affinity and taints."""

from __future__ import annotations

import pytest

from grpo_operator.placement import Node, Placement

NODE = Node("gpu-7", {"pool": "training", "zone": "a", "nvidia.com/gpu.memory": "81559"})


def required(*terms: dict) -> dict:
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": list(terms)}}}


def expression(key: str, operator: str, *values: str) -> dict:
    return {"matchExpressions": [{"key": key, "operator": operator, **({"values": list(values)} if values else {})}]}


@pytest.mark.parametrize(("placement", "admitted"), [
    (Placement(), True),
    (Placement({"pool": "training"}), True),
    (Placement({"pool": "training", "zone": "b"}), False),  # every label of the selector
    (Placement({"accelerator": "h100"}), False),
    (Placement(affinity=required(expression("zone", "In", "a", "b"))), True),
    (Placement(affinity=required(expression("zone", "NotIn", "a"))), False),
    (Placement(affinity=required(expression("rack", "NotIn", "r1"))), True),  # absent: not in
    (Placement(affinity=required(expression("pool", "Exists"))), True),
    (Placement(affinity=required(expression("pool", "DoesNotExist"))), False),
    (Placement(affinity=required(expression("nvidia.com/gpu.memory", "Gt", "80000"))), True),
    (Placement(affinity=required(expression("nvidia.com/gpu.memory", "Lt", "80000"))), False),
    (Placement(affinity=required(expression("zone", "Gt", "1"))), False),  # not an integer
    (Placement(affinity=required(expression("zone", "In", "b"), expression("pool", "In", "training"))), True),  # OR
    (Placement(affinity=required({"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]},
                                                       {"key": "pool", "operator": "In", "values": ["x"]}]})),
     False),  # AND within a term
    (Placement(affinity=required({})), False),  # an empty term matches no node
    (Placement(affinity=required({"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["gpu-7"]}]})),
     True),
    (Placement(affinity=required({"matchFields": [{"key": "metadata.name", "operator": "NotIn",
                                                   "values": ["gpu-7"]}]})), False),
    (Placement(affinity={"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": 1, "preference": expression("zone", "In", "b")}]}}), True),  # a preference filters nothing
])
def test_node_selector_and_required_node_affinity(placement, admitted):
    assert placement.admits(NODE) is admitted


@pytest.mark.parametrize(("taint", "tolerations", "admitted"), [
    ({"key": "nvidia.com/gpu", "effect": "NoSchedule"}, None, False),
    ({"key": "nvidia.com/gpu", "effect": "NoExecute"}, None, False),
    ({"key": "nvidia.com/gpu", "effect": "PreferNoSchedule"}, None, True),  # only discourages
    ({"key": "nvidia.com/gpu", "effect": "NoSchedule"}, [{"key": "nvidia.com/gpu", "operator": "Exists"}], True),
    ({"key": "nvidia.com/gpu", "value": "h100", "effect": "NoSchedule"},
     [{"key": "nvidia.com/gpu", "value": "h100"}], True),  # Equal is the default operator
    ({"key": "nvidia.com/gpu", "value": "h100", "effect": "NoSchedule"},
     [{"key": "nvidia.com/gpu", "operator": "Equal", "value": "a100"}], False),
    ({"key": "nvidia.com/gpu", "effect": "NoSchedule"},
     [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoExecute"}], False),  # another effect
    ({"key": "dedicated", "effect": "NoSchedule"}, [{"operator": "Exists"}], True),  # no key, Exists: every taint
    # A node's condition (here: its kubelet not ready yet) is no placement: a pod waits for the node.
    ({"key": "node.kubernetes.io/not-ready", "effect": "NoSchedule"}, None, True),
    ({"key": "node.kubernetes.io/unreachable", "effect": "NoExecute"}, None, True),
])
def test_taints_keep_off_a_pod_without_a_matching_toleration(taint, tolerations, admitted):
    node = Node("gpu-7", NODE.labels, taints=(taint,))
    assert Placement(tolerations=tolerations).admits(node) is admitted
