{{- define "disagg-operator.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "disagg-operator.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "disagg-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "disagg-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "disagg-operator.labels" -}}
{{ include "disagg-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: operator
app.kubernetes.io/part-of: disagg
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "disagg-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "disagg-operator.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Rules on namespaced objects: the CRs, their children, and Events. No wildcards. */}}
{{- define "disagg-operator.namespacedRules" -}}
- apiGroups: ["disagg.dev"]
  resources: ["disaggregatedmodels"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["disagg.dev"]
  resources: ["disaggregatedmodels/status"]
  verbs: ["get", "patch"]
- apiGroups: ["disagg.dev"]
  resources: ["disaggregatedmodels/finalizers"]
  verbs: ["update"]
# Prefill's scaling adapter: created once per model, its replicas handed on to the model, its status kept current.
- apiGroups: ["disagg.dev"]
  resources: ["rolescalers"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: ["disagg.dev"]
  resources: ["rolescalers/status"]
  verbs: ["patch"]
- apiGroups: ["apps"]
  resources: ["statefulsets"]
  verbs: ["get", "list", "watch", "create", "patch"]
# delete: the kvstore's Deployment, Service and NetworkPolicy go when spec.kvCache.store does (only those the
# model owns; server-side apply removes nothing by itself).
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# The router Deployment's ReplicaSets: a router pod is believed only when its owner chain leads to the model.
- apiGroups: ["apps"]
  resources: ["replicasets"]
  verbs: ["get", "list", "watch"]
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get", "create"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch"]
# delete: the endpoint picker's budget goes when spec.gateway does (only the one the model owns).
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# Roles whose instances span nodes run as LeaderWorkerSets (sigs.k8s.io/lws, installed separately).
- apiGroups: ["leaderworkerset.x-k8s.io"]
  resources: ["leaderworkersets"]
  verbs: ["get", "list", "watch", "create", "patch"]
# spec.gateway: the endpoint picker's ServiceAccount (bound to no Role: the picker makes no API call, and the
# operator writes no RBAC), the InferencePool and the HTTPRoute; each deleted when the model's spec no longer asks.
- apiGroups: [""]
  resources: ["serviceaccounts"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: ["inference.networking.k8s.io"]
  resources: ["inferencepools"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: ["gateway.networking.k8s.io"]
  resources: ["httproutes"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
# The planner's Apply leaves a role alone whose scale subresource an HPA targets (planner_loop.py).
- apiGroups: ["autoscaling"]
  resources: ["horizontalpodautoscalers"]
  verbs: ["list"]
{{- end -}}

{{- define "disagg-operator.peeringName" -}}
{{- include "disagg-operator.fullname" . -}}
{{- end -}}

{{/* The values' affinity; with more than one replica and no podAntiAffinity of its own, replicas prefer
distinct nodes, so one node's loss does not take the active operator and its standby at once. */}}
{{- define "disagg-operator.affinity" -}}
{{- $affinity := deepCopy .Values.affinity -}}
{{- if and (gt (int .Values.replicas) 1) (not (hasKey $affinity "podAntiAffinity")) -}}
{{- $term := dict "topologyKey" "kubernetes.io/hostname" "labelSelector" (dict "matchLabels" (include "disagg-operator.selectorLabels" . | fromYaml)) -}}
{{- $_ := set $affinity "podAntiAffinity" (dict "preferredDuringSchedulingIgnoredDuringExecution" (list (dict "weight" 100 "podAffinityTerm" $term))) -}}
{{- end -}}
{{- if $affinity -}}
{{- toYaml $affinity -}}
{{- end -}}
{{- end -}}
