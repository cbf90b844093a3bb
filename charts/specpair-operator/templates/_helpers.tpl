{{/* The chart name, truncated to the 63 characters of a DNS label. */}}
{{- define "specpair-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The full name of the release's objects. */}}
{{- define "specpair-operator.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "specpair-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "specpair-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "specpair-operator.labels" -}}
{{ include "specpair-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: operator
app.kubernetes.io/part-of: specpair
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end }}

{{- define "specpair-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "specpair-operator.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name: set it when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "specpair-operator.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/*
RBAC rules, kept identical to deploy/rbac/cluster_role.yaml (a test compares
them). The one delete is of the ConfigMaps of revisions that left the history;
the rest goes by garbage collection through ownerReferences. Pods are only
listed (their IPs). No secrets.
*/}}
{{- define "specpair-operator.namespacedRules" -}}
# Watch the pairs; patch only for the failed-revision annotation.
- apiGroups: [specpair.dev]
  resources: [speculativepairs]
  verbs: [get, list, watch, patch]
- apiGroups: [specpair.dev]
  resources: [speculativepairs/status]
  verbs: [get, patch]
# For blockOwnerDeletion under the OwnerReferencesPermissionEnforcement admission plugin.
- apiGroups: [specpair.dev]
  resources: [speculativepairs/finalizers]
  verbs: [update]
# The children: watched, written back where they depart from the spec.
- apiGroups: [""]
  resources: [configmaps, services]
  verbs: [get, list, watch, create, update]
# ConfigMaps of revisions neither current nor in status.revisions are deleted.
- apiGroups: [""]
  resources: [configmaps]
  verbs: [delete]
# The pods' IPs: why a new pod is not ready, and the acceptance scrape.
- apiGroups: [""]
  resources: [pods]
  verbs: [list, watch]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, update]
# Rollback reads the last good pod template from its ReplicaSet.
- apiGroups: [apps]
  resources: [replicasets]
  verbs: [list, watch]
# engine vllm past one node: a LeaderWorkerSet (its CRD and controller come with LWS).
- apiGroups: [leaderworkerset.x-k8s.io]
  resources: [leaderworkersets]
  verbs: [get, list, watch, create, update]
# Does a Secret the pair names exist, with its key? Get by name only.
- apiGroups: [""]
  resources: [secrets]
  verbs: [get]
# Events about the pairs, from the operator and kopf.
- apiGroups: [""]
  resources: [events]
  verbs: [create]
{{- end }}

{{- define "specpair-operator.clusterRules" -}}
# GPU memory from the nvidia.com/gpu.memory node label (a watched copy).
- apiGroups: [""]
  resources: [nodes]
  verbs: [list, watch]
# kopf follows the CRDs to notice when its resource appears or goes.
- apiGroups: [apiextensions.k8s.io]
  resources: [customresourcedefinitions]
  verbs: [list, watch]
{{- end }}
