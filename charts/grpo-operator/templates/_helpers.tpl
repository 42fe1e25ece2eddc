{{/* Chart name, truncated to the 63 characters a label value allows. */}}
{{- define "grpo-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Full name of every object. Keeps "grpo-operator" in it unless overridden, because the GRPOOperatorDown alert finds
the operator's scrape job by that substring.
*/}}
{{- define "grpo-operator.fullname" -}}
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

{{- define "grpo-operator.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "grpo-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "grpo-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "grpo-operator.labels" -}}
helm.sh/chart: {{ include "grpo-operator.chart" . }}
{{ include "grpo-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: grpo-operator
{{- end }}

{{- define "grpo-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "grpo-operator.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "grpo-operator.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* The release's CUDA variant of the trainer image unless trainerImage.tag names another. */}}
{{- define "grpo-operator.trainerImage" -}}
{{- printf "%s:%s" .Values.trainerImage.repository (default (printf "%s-cuda" .Chart.AppVersion) .Values.trainerImage.tag) }}
{{- end }}

{{/* The namespaces watched when not cluster-wide: the listed ones, or the release namespace. */}}
{{- define "grpo-operator.watchedNamespaces" -}}
{{- if .Values.watch.namespaces }}
{{- toJson .Values.watch.namespaces }}
{{- else }}
{{- toJson (list .Release.Namespace) }}
{{- end }}
{{- end }}

{{/*
The permissions the operator uses inside the namespaces it watches. One list for the ClusterRole and every Role, so
the two modes cannot drift apart. tests/chart_rbac.py checks it against the requests the operator makes.
*/}}
{{- define "grpo-operator.rules" -}}
- apiGroups: ["grpo.dev"]
  resources: ["grporuns"]
  # patch: finalizers and kopf's progress annotations; delete: ttlSecondsAfterFinished.
  verbs: ["get", "list", "watch", "patch", "update", "delete"]
- apiGroups: ["grpo.dev"]
  resources: ["grporuns/status"]
  verbs: ["patch"]
- apiGroups: [""]
  resources: ["pods", "services", "configmaps"]
  verbs: ["get", "list", "watch", "create", "delete", "patch"]
- apiGroups: [""]
  resources: ["events"]
  # core/v1 events (grpo_operator.cluster.events, never events.k8s.io ones); patch counts a repeat on the Event
  # posted first; list reads the kubelet's probe failures of a server pod that is not ready
  # (grpo_operator.cluster.probe_events), which the run's conditions name.
  verbs: ["create", "patch", "list"]
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloads"]
  # A run labelled kueue.x-k8s.io/queue-name is admitted through a Workload the operator creates (docs/kueue.md);
  # patched to the run's new size while it holds no quota.
  verbs: ["get", "create", "patch"]
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloads/status"]
  # Release the quota of an evicted Workload once its pods are gone; mark a finished one Finished.
  verbs: ["patch"]
- apiGroups: ["scheduling.x-k8s.io", "scheduling.volcano.sh"]
  resources: ["podgroups"]
  # spec.scheduling.gang: the PodGroup of the coscheduling plugin or of Volcano; patched when a suspended run's
  # edit changes the gang's size; deleted when the spec no longer asks for that gang.
  verbs: ["get", "create", "patch", "delete"]
{{- end }}

{{/*
Cluster-scoped reads kopf 1.45.2 makes on its own (kopf/_core/reactor/observation.py): it lists and watches
customresourcedefinitions to notice CRDs appearing or changing, and, only when it watches named namespaces rather
than the whole cluster, lists and watches namespaces to match them. Without these kopf logs a warning and falls
back to a one-time scan at start.
*/}}
{{- define "grpo-operator.discoveryRules" -}}
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["list", "watch"]
# Kueue's ResourceFlavors are cluster-scoped: their node labels and tolerations go onto an admitted run's pods.
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["resourceflavors"]
  verbs: ["get"]
{{- if .namespaces }}
- apiGroups: [""]
  resources: ["namespaces"]
  verbs: ["list", "watch"]
{{- end }}
{{- end }}

{{/*
fitCheck.readNodes: the fit check lists the nodes NVIDIA's GPU feature discovery labels (label selector
nvidia.com/gpu.product) to know the GPU a run's pods can get (grpo_operator.cluster.fit_check). Nodes are
cluster-scoped: a ClusterRole in either mode.
*/}}
{{- define "grpo-operator.nodeRules" -}}
- apiGroups: [""]
  resources: ["nodes"]
  verbs: ["list"]
{{- end }}

{{- define "grpo-operator.subjects" -}}
- kind: ServiceAccount
  name: {{ include "grpo-operator.serviceAccountName" . }}
  namespace: {{ .Release.Namespace }}
{{- end }}
