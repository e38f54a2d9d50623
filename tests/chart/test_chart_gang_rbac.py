"""`rbac.gangScheduling`: the PodGroups of Volcano and scheduler-plugins are granted only when
asked for (a cluster without them needs none of it), then exactly as
`rlft.operator.permissions.GANG_PERMISSIONS` declares them, in each served namespace."""

from __future__ import annotations

from typing import Any

import pytest
from chart_render import NAMESPACED, of_kind, render

from rlft.operator import permissions

GANG = {(p.group, p.resource, verb) for p in permissions.GANG_PERMISSIONS for verb in p.verbs}


def _served_rules(documents: list[dict[str, Any]], namespaced: bool) -> list[set[tuple]]:
    """The rules of every Role (namespaced) or of the ClusterRole (all namespaces)."""
    roles = of_kind(documents, "Role") if namespaced else of_kind(documents, "ClusterRole")
    return [
        {
            (group, resource, verb)
            for rule in role["rules"]
            for group in rule["apiGroups"]
            for resource in rule["resources"]
            for verb in rule["verbs"]
        }
        for role in roles
    ]


@pytest.mark.parametrize("namespaced", [False, True], ids=["clusterwide", "namespaced"])
def test_pod_groups_are_granted_only_with_the_value(chart, namespaced):
    base = NAMESPACED if namespaced else {}
    without, _ = render(chart, base)
    assert all(not rules & GANG for rules in _served_rules(without, namespaced))
    with_gangs, _ = render(chart, {**base, "rbac": {"gangScheduling": True}})
    served = _served_rules(with_gangs, namespaced)
    assert served and all(rules >= GANG for rules in served)
    before = _served_rules(without, namespaced)
    assert [rules - GANG for rules in served] == before  # nothing else changes
    if namespaced:  # cluster-wide, still only kopf's reads
        (cluster_role,) = of_kind(with_gangs, "ClusterRole")
        assert {v for rule in cluster_role["rules"] for v in rule["verbs"]} == {"list", "watch"}


def test_the_value_is_in_the_schema(chart):
    with pytest.raises(Exception, match="gangScheduling"):
        render(chart, {"rbac": {"gangScheduling": "yes"}})
