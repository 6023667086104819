"""The create-or-patch comparison and removal logic behind Kube.apply (no cluster needed)."""

from __future__ import annotations

from glm5_operator.kube import _removed, is_subset


def test_subset_ignores_server_defaults_and_quantity_forms() -> None:
    desired = {"spec": {"containers": [{"name": "w", "resources": {"limits": {"nvidia.com/gpu": 2}}}]}}
    container = {"name": "w", "terminationMessagePath": "/dev/termination-log",
                 "resources": {"limits": {"nvidia.com/gpu": "2"}}}  # fmt: skip
    live = {"spec": {"containers": [container], "dnsPolicy": "ClusterFirst"}}
    assert is_subset(desired, live)
    assert not is_subset({"spec": {"containers": [{"name": "x"}]}}, live)
    assert not is_subset({"spec": {"containers": []}}, live)  # lists compare by length too
    assert not is_subset({"flag": True}, {"flag": "True"})  # booleans are not quantities


def test_removed_keys_become_nulls() -> None:
    before = {"spec": {"nodeSelector": {"pool": "gpu"}, "replicas": 2}, "metadata": {"labels": {"a": "1", "b": "2"}}}
    after = {"spec": {"replicas": 3}, "metadata": {"labels": {"a": "1"}}}
    assert _removed(before, after) == {"spec": {"nodeSelector": None}, "metadata": {"labels": {"b": None}}}
    assert _removed(after, after) == {}
