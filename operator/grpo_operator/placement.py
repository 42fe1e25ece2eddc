"""Which nodes a pod may land on, as the scheduler's filters decide it from the pod's own spec (pure).

What is read: the pod's `nodeSelector` (every label equal), its required node affinity
(`affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution`: any one term, each term's expressions and
fields all), and its tolerations against the node's `NoSchedule` and `NoExecute` taints. What is not: resources
(whether the node has room), pod (anti-)affinity and topology spread, which decide among the nodes this admits; and
the taints Kubernetes puts on a node for its condition (`node.kubernetes.io/not-ready`, `unreachable`,
`unschedulable`, ...), which say where a pod may go now, not where it is meant to go: a pod waits for such a node.
The fit check (grpo_operator.fit) uses it to find the GPUs a run's pods may get from the nodes' labels.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

#: The taint effects that keep a pod without a matching toleration off a node (PreferNoSchedule only discourages).
BLOCKING_TAINT_EFFECTS = frozenset({"NoSchedule", "NoExecute"})
#: The prefix of the taints the node lifecycle sets for a node's condition (not ready, unreachable, cordoned).
CONDITION_TAINT_PREFIX = "node.kubernetes.io/"


@dataclass(frozen=True)
class Node:
    """A node as placement sees it: its name, its labels and its taints (core/v1 Taint dicts)."""

    name: str
    labels: Mapping[str, str] = field(default_factory=dict)
    taints: Sequence[Mapping[str, Any]] = ()


@dataclass(frozen=True)
class Placement:
    """The placement fields of a pod spec: nodeSelector, affinity (a core/v1 Affinity) and tolerations."""

    node_selector: Mapping[str, str] | None = None
    affinity: Mapping[str, Any] | None = None
    tolerations: Sequence[Mapping[str, Any]] | None = None

    def admits(self, node: Node) -> bool:
        """Whether a pod placed this way may be scheduled onto `node`."""
        selected = all(node.labels.get(key) == value for key, value in (self.node_selector or {}).items())
        return selected and self._affinity_admits(node) and all(
            self._tolerates(taint) for taint in node.taints if taint.get("effect") in BLOCKING_TAINT_EFFECTS
            and not str(taint.get("key", "")).startswith(CONDITION_TAINT_PREFIX))

    def _affinity_admits(self, node: Node) -> bool:
        required = (((self.affinity or {}).get("nodeAffinity") or {})
                    .get("requiredDuringSchedulingIgnoredDuringExecution"))
        if not required:
            return True
        # The terms are ORed; an empty term matches no node (core/v1 NodeSelectorTerm).
        return any(_term_matches(term, node) for term in required.get("nodeSelectorTerms") or [])

    def _tolerates(self, taint: Mapping[str, Any]) -> bool:
        return any(_toleration_matches(toleration, taint) for toleration in self.tolerations or [])


def _term_matches(term: Mapping[str, Any], node: Node) -> bool:
    expressions, fields = term.get("matchExpressions") or [], term.get("matchFields") or []
    if not expressions and not fields:
        return False
    return (all(_expression_matches(expression, node.labels) for expression in expressions)
            and all(_expression_matches(expression, {"metadata.name": node.name}) for expression in fields))


def _expression_matches(expression: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """One node selector requirement (In, NotIn, Exists, DoesNotExist, Gt, Lt) against a node's labels."""
    key, operator, values = expression.get("key"), expression.get("operator"), expression.get("values") or []
    present = key in labels
    if operator == "In":
        return present and labels[key] in values
    if operator == "NotIn":
        return not present or labels[key] not in values
    if operator == "Exists":
        return present
    if operator == "DoesNotExist":
        return not present
    if operator in ("Gt", "Lt") and present and len(values) == 1:
        try:
            have, bound = int(labels[key]), int(values[0])
        except ValueError:
            return False
        return have > bound if operator == "Gt" else have < bound
    return False


def _toleration_matches(toleration: Mapping[str, Any], taint: Mapping[str, Any]) -> bool:
    """core/v1 Toleration.ToleratesTaint: the effect (empty: all), the key (empty with Exists: all) and, for Equal
    (the default operator), the value."""
    if toleration.get("effect") and toleration["effect"] != taint.get("effect"):
        return False
    operator = toleration.get("operator") or "Equal"
    if not toleration.get("key"):
        return operator == "Exists"
    if toleration["key"] != taint.get("key"):
        return False
    return operator == "Exists" or (toleration.get("value") or "") == (taint.get("value") or "")
