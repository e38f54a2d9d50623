{{/* Names and labels shared by the templates. */}}

{{- define "rlft.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "rlft.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "rlft.labels" -}}
{{ include "rlft.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/part-of: rlft
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "rlft.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "rlft.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name: name an existing ServiceAccount when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "rlft.image" -}}
{{- $image := .Values.image -}}
{{- if $image.digest -}}
{{- printf "%s@%s" $image.repository $image.digest -}}
{{- else -}}
{{- printf "%s:%s" $image.repository (default .Chart.AppVersion $image.tag) -}}
{{- end -}}
{{- end -}}

{{/* "clusterwide" when no namespaces are listed (the operator runs with -A). */}}
{{- define "rlft.mode" -}}
{{- if .Values.watchNamespaces -}}namespaced{{- else -}}clusterwide{{- end -}}
{{- end -}}

{{/* The generated RBAC rules (files/permissions.yaml) of this mode and a scope; the served
ones include the gang schedulers' PodGroups with rbac.gangScheduling. */}}
{{- define "rlft.rules" -}}
{{- $all := .root.Files.Get "files/permissions.yaml" | fromYaml -}}
{{- $mode := index $all (include "rlft.mode" .root) -}}
{{- $rules := index $mode .scope -}}
{{- if and (eq .scope "served") .root.Values.rbac.gangScheduling -}}
{{- $rules = concat $rules (index $mode "gangScheduling") -}}
{{- end -}}
{{- $rules | toYaml -}}
{{- end -}}

{{/* A Prometheus duration (`1m30s`, `500ms`) in milliseconds. */}}
{{- define "rlft.milliseconds" -}}
{{- $units := dict "ms" 1 "s" 1000 "m" 60000 "h" 3600000 "d" 86400000 "w" 604800000 "y" 31536000000 -}}
{{- $total := 0 -}}
{{- range regexFindAll "[0-9]+(ms|[smhdwy])" . -1 -}}
{{- $number := regexFind "^[0-9]+" . -}}
{{- $total = add $total (mul ($number | int64) (index $units (trimPrefix $number .))) -}}
{{- end -}}
{{- $total -}}
{{- end -}}

{{/* Refuse a monitor (.monitor, its values path .path) whose scrapeTimeout exceeds its
interval: prometheus-operator drops such a monitor, and Prometheus refuses the scrape. */}}
{{- define "rlft.checkScrape" -}}
{{- $m := .monitor -}}
{{- if and $m.interval $m.scrapeTimeout -}}
{{- if gt (include "rlft.milliseconds" $m.scrapeTimeout | int64) (include "rlft.milliseconds" $m.interval | int64) -}}
{{- fail (printf "%s.scrapeTimeout %s is longer than %s.interval %s: prometheus-operator would drop the monitor" .path $m.scrapeTimeout .path $m.interval) -}}
{{- end -}}
{{- end -}}
{{- end -}}
