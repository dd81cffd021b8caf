{{/* The release's full name: the release name, with the chart's unless it already has it. */}}
{{- define "member-agent.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "member-agent.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "member-agent.labels" -}}
{{ include "member-agent.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: member-agent
app.kubernetes.io/part-of: gpufed
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "member-agent.serviceAccountName" -}}
{{- default (include "member-agent.fullname" .) .Values.serviceAccount.name -}}
{{- end -}}

{{/* --broker: every broker replica's URL (broker.urls), or the one URL (broker.url). */}}
{{- define "member-agent.brokerURLs" -}}
{{- if .Values.broker.urls -}}
{{- join "," .Values.broker.urls -}}
{{- else -}}
{{- required "broker.url (or broker.urls) is required" .Values.broker.url -}}
{{- end -}}
{{- end -}}

{{- define "member-agent.tokenSecret" -}}
{{- if .Values.broker.token.create -}}
{{- printf "%s-token" (include "member-agent.fullname" .) -}}
{{- else -}}
{{- required "broker.token.existingSecret (or broker.token.create with broker.token.value) is required" .Values.broker.token.existingSecret -}}
{{- end -}}
{{- end -}}

{{/* Whether the agent sends a token: one is configured, or no client certificate replaces it. */}}
{{- define "member-agent.hasToken" -}}
{{- if or .Values.broker.token.create .Values.broker.token.existingSecret (not .Values.clientCertificate.enabled) -}}
true
{{- end -}}
{{- end -}}

{{/* The Secret with this agent's client certificate and key (clientCertificate.enabled). */}}
{{- define "member-agent.clientTlsSecret" -}}
{{- if .Values.clientCertificate.existingSecret -}}
{{- .Values.clientCertificate.existingSecret -}}
{{- else if .Values.clientCertificate.certManager.enabled -}}
{{- printf "%s-client-tls" (include "member-agent.fullname" .) -}}
{{- else -}}
{{- required "clientCertificate.existingSecret (or clientCertificate.certManager.enabled) is required when clientCertificate.enabled" "" -}}
{{- end -}}
{{- end -}}
