{{/* The release's full name: the release name, with the chart's unless it already has it. */}}
{{- define "broker.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "broker.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "broker.labels" -}}
{{ include "broker.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: broker
app.kubernetes.io/part-of: gpufed
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "broker.serviceAccountName" -}}
{{- default (include "broker.fullname" .) .Values.serviceAccount.name -}}
{{- end -}}

{{/* The SQLite file lives on the data volume, mounted at /var/lib/gpufed. */}}
{{- define "broker.storeURL" -}}
{{- if eq .Values.store.type "etcd" -}}
{{- required "store.etcd.url is required when store.type is etcd" .Values.store.etcd.url -}}
{{- else -}}
sqlite:////var/lib/gpufed/broker.db
{{- end -}}
{{- end -}}

{{- define "broker.dataClaim" -}}
{{- default (printf "%s-data" (include "broker.fullname" .)) .Values.store.sqlite.existingClaim -}}
{{- end -}}
