"""The autoscaling examples in deploy/autoscaling/ target the pair's scale subresource.

tests/integration/test_operator_scale.py applies the HPA on the v1.20 control
plane; KEDA is not installed there, so its ScaledObject is checked here: it
names the same target and the same runtime metric.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from specpair_runtime.server.metrics import ServerMetrics

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "deploy" / "autoscaling"


def test_hpa_and_keda_scale_the_pair_on_a_metric_the_runtime_exports() -> None:
    hpa = yaml.safe_load((EXAMPLES / "hpa-queue-depth.yaml").read_text())
    keda = yaml.safe_load((EXAMPLES / "keda-scaledobject.yaml").read_text())
    target = {"apiVersion": "specpair.dev/v1alpha1", "kind": "SpeculativePair"}
    assert target.items() <= hpa["spec"]["scaleTargetRef"].items()
    assert keda["spec"]["scaleTargetRef"] == hpa["spec"]["scaleTargetRef"]
    metric = hpa["spec"]["metrics"][0]["pods"]["metric"]["name"]
    assert metric in keda["spec"]["triggers"][0]["metadata"]["query"]
    exported = ServerMetrics("llama-8b-1b", "v1").render().decode()
    assert f"\n{metric}{{" in exported
