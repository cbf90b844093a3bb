#!/usr/bin/env bash
# `make e2e-kind`: specpair on a real Kubernetes cluster on your laptop.
#
#  1. creates a kind cluster (KIND_CLUSTER, default specpair-e2e);
#  2. builds the CPU runtime image (with the tiny demo pair baked in) and the
#     operator image, and loads both into the cluster;
#  3. installs the Helm chart charts/specpair-operator;
#  4. applies crds/samples/cpu-pair.yaml, pointed at the baked demo models;
#  5. waits for the pair to be Ready;
#  6. sends a completion through a port-forward;
#  7. prints `kubectl get spair`.
#
# Needs Docker, kind, kubectl and helm (kubectl and helm may also come from
# `make control-plane`'s cache). Where Docker or kind is missing it prints a
# "skipped:" line and exits 0. KEEP_CLUSTER=1 leaves the cluster running.
set -euo pipefail

cd "$(dirname "$0")/.."
CLUSTER=${KIND_CLUSTER:-specpair-e2e}
RUNTIME_CPU_IMAGE=${RUNTIME_CPU_IMAGE:-ghcr.io/specpair/runtime:0.1.0-cpu}
OPERATOR_IMAGE=${OPERATOR_IMAGE:-ghcr.io/specpair/operator:0.1.0}
RELEASE_NAMESPACE=specpair-system
PAIR_NAMESPACE=${PAIR_NAMESPACE:-default}
LOCAL_PORT=${LOCAL_PORT:-18000}
READY_TIMEOUT=${READY_TIMEOUT:-900s}
PY=${PYTHON:-.venv/bin/python}

skip() {
    echo "skipped: $*"
    exit 0
}
say() { echo "[e2e-kind] $*" >&2; }

command -v docker >/dev/null 2>&1 || skip "docker is not installed; make e2e-kind needs Docker and kind"
docker info >/dev/null 2>&1 || skip "the Docker daemon is not reachable (docker info failed)"
command -v kind >/dev/null 2>&1 || skip "kind is not installed (https://kind.sigs.k8s.io/docs/user/quick-start/)"
[[ -x $PY ]] || { echo "error: $PY not found; run make install" >&2; exit 2; }

# kubectl and helm: from PATH, else from make control-plane's cache.
cached_tool() {
    "$PY" -c "import sys; from tools.control_plane import Binaries, default_cache_dir; \
print(getattr(Binaries.under(default_cache_dir()), sys.argv[1]))" "$1"
}
KUBECTL=$(command -v kubectl || cached_tool kubectl)
HELM=$(command -v helm || cached_tool helm)
[[ -x $KUBECTL ]] || skip "kubectl is not installed (run make control-plane to fetch one)"
[[ -x $HELM ]] || skip "helm is not installed (run make control-plane to fetch one)"

PORT_FORWARD_PID=
cleanup() {
    if [[ -n $PORT_FORWARD_PID ]]; then kill "$PORT_FORWARD_PID" 2>/dev/null || true; fi
    if [[ ${KEEP_CLUSTER:-0} != 1 ]]; then
        say "deleting kind cluster $CLUSTER (KEEP_CLUSTER=1 keeps it)"
        kind delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true
    fi
}
trap cleanup EXIT

say "1/7 kind cluster $CLUSTER"
if ! kind get clusters 2>/dev/null | grep -qx "$CLUSTER"; then
    kind create cluster --name "$CLUSTER" --wait 180s
fi
CONTEXT="kind-$CLUSTER"
k() { "$KUBECTL" --context "$CONTEXT" "$@"; }

say "2/7 images $RUNTIME_CPU_IMAGE and $OPERATOR_IMAGE"
docker build -f runtime/Dockerfile.cpu -t "$RUNTIME_CPU_IMAGE" .
docker build -f operator/Dockerfile -t "$OPERATOR_IMAGE" .
kind load docker-image --name "$CLUSTER" "$RUNTIME_CPU_IMAGE" "$OPERATOR_IMAGE"

say "3/7 helm install"
"$HELM" --kube-context "$CONTEXT" upgrade --install specpair charts/specpair-operator \
    --namespace "$RELEASE_NAMESPACE" --create-namespace \
    --set "image.repository=${OPERATOR_IMAGE%:*}" --set "image.tag=${OPERATOR_IMAGE##*:}" \
    --set "defaultRuntimeImage=$RUNTIME_CPU_IMAGE" \
    --wait --timeout 5m

say "4/7 the CPU sample pair, on the demo models baked into $RUNTIME_CPU_IMAGE"
PAIR=$("$PY" -c "import yaml; print(yaml.safe_load(open('crds/samples/cpu-pair.yaml'))['metadata']['name'])")
OMP_WAIT_POLICY=PASSIVE "$PY" -m tools.make_demo_models \
    --sample crds/samples/cpu-pair.yaml --runtime-image "$RUNTIME_CPU_IMAGE" |
    k apply -n "$PAIR_NAMESPACE" -f -

say "5/7 waiting for $PAIR to be Ready (up to $READY_TIMEOUT)"
if ! k wait -n "$PAIR_NAMESPACE" --for=condition=Ready "spair/$PAIR" --timeout="$READY_TIMEOUT"; then
    k get spair -n "$PAIR_NAMESPACE" "$PAIR" -o yaml
    k get pods -n "$PAIR_NAMESPACE" -l "app.kubernetes.io/instance=$PAIR" -o wide
    k logs -n "$RELEASE_NAMESPACE" deployment/specpair-specpair-operator --tail=50
    exit 1
fi

say "6/7 a completion through a port-forward"
k port-forward -n "$PAIR_NAMESPACE" "service/$PAIR" "$LOCAL_PORT:8000" >/dev/null &
PORT_FORWARD_PID=$!
for _ in $(seq 1 50); do
    curl -fsS "http://127.0.0.1:$LOCAL_PORT/readyz" >/dev/null 2>&1 && break
    sleep 0.2
done
MODEL=$(curl -fsS "http://127.0.0.1:$LOCAL_PORT/v1/models" |
    "$PY" -c "import json, sys; print(json.load(sys.stdin)['data'][0]['id'])")
curl -fsS "http://127.0.0.1:$LOCAL_PORT/v1/completions" \
    -H 'Content-Type: application/json' \
    -d "{\"model\": \"$MODEL\", \"prompt\": \"Hello, how can I help\", \"max_tokens\": 16}"
echo

say "7/7 kubectl get spair"
k get spair -n "$PAIR_NAMESPACE"
