{{/* Chart name, truncated to a DNS label. */}}
{{- define "tandem.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* <release>-<chart>, or the release name alone when it already contains the chart name. */}}
{{- define "tandem.fullname" -}}
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

{{/* Name of one component's objects: (dict "root" $ "component" "router"). */}}
{{- define "tandem.componentName" -}}
{{- $full := include "tandem.fullname" .root }}
{{- printf "%s-%s" ($full | trunc (int (sub 62 (len .component))) | trimSuffix "-") .component }}
{{- end }}

{{- define "tandem.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tandem.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "tandem.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "tandem.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: tandem
{{- end }}

{{- define "tandem.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- end }}

{{/* The Ray head's GCS address, as every other Ray node and the router join it. */}}
{{- define "tandem.rayAddress" -}}
{{- printf "%s:%d" (include "tandem.componentName" (dict "root" . "component" "ray-head")) (int .Values.ray.port) }}
{{- end }}

{{/* CPUs Ray is told a worker pod has: limits.cpu, else requests.cpu ("500m" -> 1, "2.5" -> 2). */}}
{{- define "tandem.rayCpus" -}}
{{- $res := .resources | default dict }}
{{- $cpu := toString ((($res.limits | default dict).cpu) | default (($res.requests | default dict).cpu) | default "1") }}
{{- if hasSuffix "m" $cpu }}
{{- max 1 (div (trimSuffix "m" $cpu | atoi) 1000) }}
{{- else }}
{{- max 1 (int (float64 $cpu)) }}
{{- end }}
{{- end }}

{{/* GPUs of a worker pod: limits["nvidia.com/gpu"], else 0. */}}
{{- define "tandem.rayGpus" -}}
{{- int (index ((.resources | default dict).limits | default dict) "nvidia.com/gpu" | default 0) }}
{{- end }}

{{/* The worker pools of the chosen mode: a list of (dict "role" "pool"). */}}
{{- define "tandem.activePools" -}}
{{- if eq .Values.mode "colocated" }}
{{- list (dict "role" "colocated" "pool" .Values.colocated) | toJson }}
{{- else if eq .Values.mode "disaggregated" }}
{{- list (dict "role" "prefill" "pool" .Values.pools.prefill) (dict "role" "decode" "pool" .Values.pools.decode) | toJson }}
{{- else }}
{{- fail (printf "mode must be disaggregated or colocated, not %q" .Values.mode) }}
{{- end }}
{{- end }}

{{/* torch threads per worker: engine.numThreads, else the smallest active pool's CPU count. */}}
{{- define "tandem.numThreads" -}}
{{- if .Values.engine.numThreads }}
{{- int .Values.engine.numThreads }}
{{- else }}
{{- $cpus := list }}
{{- range include "tandem.activePools" . | fromJsonArray }}
{{- $cpus = append $cpus (include "tandem.rayCpus" .pool | atoi) }}
{{- end }}
{{- min (first $cpus) (last $cpus) }}
{{- end }}
{{- end }}

{{/* Name of the Secret holding the auth token, empty when auth is off. */}}
{{- define "tandem.authSecretName" -}}
{{- if .Values.auth.existingSecret }}
{{- .Values.auth.existingSecret }}
{{- else if .Values.auth.token }}
{{- include "tandem.componentName" (dict "root" . "component" "auth") }}
{{- end }}
{{- end }}

{{- define "tandem.authSecretKey" -}}
{{- if .Values.auth.existingSecret }}{{ .Values.auth.existingSecretKey | default "token" }}{{ else }}token{{ end }}
{{- end }}

{{/* The admin key's Secret, and the env entry that gives it (router and worker pods). */}}
{{- define "tandem.adminSecretName" -}}
{{- .Values.admin.existingSecret | default (include "tandem.componentName" (dict "root" . "component" "admin")) }}
{{- end }}

{{- define "tandem.adminEnv" -}}
- name: TANDEM_ADMIN_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ include "tandem.adminSecretName" . }}
      key: {{ if .Values.admin.existingSecret }}{{ .Values.admin.existingSecretKey | default "key" }}{{ else }}key{{ end }}
{{- end }}

{{/* Pod-level settings shared by every pod: (dict "root" $ "pool" <values with nodeSelector...>). */}}
{{- define "tandem.podCommon" -}}
automountServiceAccountToken: false
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .root.Values.podSecurityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .pool.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .pool.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .pool.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Env of every Ray container: its pod IP (the Ray node's address) and no usage stats. */}}
{{- define "tandem.rayEnv" -}}
- name: MY_POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
- name: RAY_USAGE_STATS_ENABLED
  value: "0"
{{- include "tandem.rayAuthEnv" . }}
{{- if .Values.kvTransfer.encryption.enabled }}
- name: TANDEM_KV_SECRET
  valueFrom:
    secretKeyRef:
      name: {{ include "tandem.kvSecretName" . }}
      key: {{ if .Values.kvTransfer.encryption.existingSecret }}{{ .Values.kvTransfer.encryption.existingSecretKey | default "secret" }}{{ else }}secret{{ end }}
{{- end }}
{{- end }}

{{/* Whether `model` is a Hugging Face hub id (org/name) rather than a path. */}}
{{- define "tandem.hubModel" -}}
{{- if regexMatch "^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+$" (.Values.model | default "") }}true{{ end }}
{{- end }}

{{/* The Hugging Face cache and token of the download step and the workers. */}}
{{- define "tandem.hfEnv" -}}
{{- if include "tandem.hubModel" . }}
- name: HF_HOME
  value: /var/cache/huggingface
{{- end }}
{{- if .Values.hf.tokenSecret }}
- name: HF_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ .Values.hf.tokenSecret }}
      key: {{ .Values.hf.tokenSecretKey | default "token" }}
{{- end }}
{{- end }}

{{- define "tandem.kvSecretName" -}}
{{- .Values.kvTransfer.encryption.existingSecret | default (include "tandem.componentName" (dict "root" . "component" "kv-secret")) }}
{{- end }}

{{/* Ray's token authentication, for every process that talks to Ray (nodes, router, probes). */}}
{{- define "tandem.rayAuthEnv" -}}
{{- if .Values.ray.auth.enabled }}
- name: RAY_AUTH_MODE
  value: token
- name: RAY_AUTH_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "tandem.rayAuthSecretName" . }}
      key: {{ if .Values.ray.auth.existingSecret }}{{ .Values.ray.auth.existingSecretKey | default "token" }}{{ else }}token{{ end }}
{{- end }}
{{- end }}

{{- define "tandem.rayAuthSecretName" -}}
{{- .Values.ray.auth.existingSecret | default (include "tandem.componentName" (dict "root" . "component" "ray-auth")) }}
{{- end }}

{{/* Init container of every Ray node but the head: wait until the head's GCS answers. */}}
{{- define "tandem.waitForHead" -}}
- name: wait-for-ray-head
  image: {{ include "tandem.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command: ["sh", "-c", "until ray health-check --address={{ include "tandem.rayAddress" . }} >/dev/null 2>&1; do echo waiting for the Ray head; sleep 2; done"]
  env:
    - name: RAY_USAGE_STATS_ENABLED
      value: "0"
    {{- include "tandem.rayAuthEnv" . | nindent 4 }}
  resources:
    requests: {cpu: 100m, memory: 256Mi}
    limits: {memory: 512Mi}
{{- end }}

{{/* /dev/shm for Ray's object store. */}}
{{- define "tandem.shmVolume" -}}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .Values.ray.shmSize }}
{{- end }}

{{/* A quantity in Mi: "1Gi" -> 1024, "512Mi" -> 512. */}}
{{- define "tandem.mebibytes" -}}
{{- $q := toString . }}
{{- if hasSuffix "Gi" $q }}
{{- int (ceil (mulf (float64 (trimSuffix "Gi" $q)) 1024)) }}
{{- else if hasSuffix "Mi" $q }}
{{- int (ceil (float64 (trimSuffix "Mi" $q))) }}
{{- else }}
{{- fail (printf "ray.shmSize must be in Gi or Mi, not %q" $q) }}
{{- end }}
{{- end }}

{{/* /dev/shm of a worker pod: (dict "root" $ "role" <pool>). A decode worker's KV pool lives
there too (so that prefill workers on its node could write the KV straight into it; without
room it falls back to private memory): Ray's object store plus engine.kvCacheMemoryGib and
64Mi for the pool's grant table and rounding. */}}
{{- define "tandem.workerShmVolume" -}}
{{- if eq .role "decode" }}
{{- $mi := add (include "tandem.mebibytes" .root.Values.ray.shmSize | atoi) (int (ceil (mulf (float64 .root.Values.engine.kvCacheMemoryGib) 1024))) 64 }}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ printf "%dMi" $mi }}
{{- else }}
{{- include "tandem.shmVolume" .root }}
{{- end }}
{{- end }}
