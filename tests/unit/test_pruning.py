"""Pruned fields, named from the last `kubectl apply` (specpair_operator/pruning.py)."""

from __future__ import annotations

import copy
import json
from typing import Any

from specpair_operator.pruning import LAST_APPLIED, pruned_fields, warning
from tests.support.operator_process import SAMPLE


def applied(sent: dict[str, Any], stored_spec: dict[str, Any] | None = None) -> dict[str, Any]:
    """A pair as stored after ``kubectl apply`` of ``sent``: the annotation, and the spec kept."""
    body = copy.deepcopy(sent)
    body["metadata"] = {
        "name": "p",
        "annotations": {LAST_APPLIED: json.dumps(sent)},
    }
    body["spec"] = stored_spec if stored_spec is not None else copy.deepcopy(sent["spec"])
    return body


def test_a_misspelt_field_that_was_dropped_is_named() -> None:
    sent = copy.deepcopy(SAMPLE)
    sent["spec"]["tragetTypo"] = {"source": "hf://x@1"}
    sent["spec"]["speculation"]["maxDeph"] = 8  # nested
    sent["spec"]["scheduling"]["tolerations"] = [{"operator": "Exists", "efect": "NoSchedule"}]
    kept = copy.deepcopy(SAMPLE["spec"])
    kept["scheduling"]["tolerations"] = [{"operator": "Exists"}]
    fields = pruned_fields(applied(sent, kept))
    assert sorted(fields) == [
        "spec.scheduling.tolerations[0].efect",
        "spec.speculation.maxDeph",
        "spec.tragetTypo",
    ]
    assert "spec.tragetTypo" in warning(fields)


def test_declared_free_form_and_map_fields_are_not_pruned() -> None:
    sent = copy.deepcopy(SAMPLE)
    # affinity is free-form in the CRD (newer fields pass through); nodeSelector is a map.
    sent["spec"]["scheduling"]["affinity"] = {"nodeAffinity": {"someFutureField": 1}}
    sent["spec"]["scheduling"]["nodeSelector"] = {"pool": "a100", "any-label": "x"}
    assert pruned_fields(applied(sent)) == []


def test_a_field_the_stored_object_holds_was_not_pruned() -> None:
    # An apiserver with a newer CRD kept it, although this operator does not know it.
    sent = copy.deepcopy(SAMPLE)
    sent["spec"]["newerField"] = 1
    assert pruned_fields(applied(sent, sent["spec"])) == []


def test_without_a_last_applied_record_nothing_can_be_named() -> None:
    body = copy.deepcopy(SAMPLE)
    body["metadata"] = {"name": "p"}
    assert pruned_fields(body) == []
    body["metadata"]["annotations"] = {LAST_APPLIED: "not json"}
    assert pruned_fields(body) == []
