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
