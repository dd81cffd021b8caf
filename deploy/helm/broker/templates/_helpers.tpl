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

{{/* "true" when the chart runs its own etcd: store.type etcd without external endpoints. */}}
{{- define "broker.etcd.embedded" -}}
{{- if and (eq .Values.store.type "etcd") (not .Values.store.etcd.endpoints) -}}
true
{{- end -}}
{{- end -}}

{{/* The chart's etcd: StatefulSet, headless Service and PDB share this name (53 characters at
most, so that "<name>-<ordinal>" stays a DNS label). */}}
{{- define "broker.etcd.name" -}}
{{- printf "%s-etcd" (include "broker.fullname" .) | trunc 53 | trimSuffix "-" -}}
{{- end -}}

{{- define "broker.etcd.selectorLabels" -}}
app.kubernetes.io/name: etcd
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "broker.etcd.labels" -}}
{{ include "broker.etcd.selectorLabels" . }}
app.kubernetes.io/version: {{ .Values.etcd.image.tag | quote }}
app.kubernetes.io/component: store
app.kubernetes.io/part-of: gpufed
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* The domain of the etcd pods' stable names: <pod>.<this>. */}}
{{- define "broker.etcd.domain" -}}
{{- printf "%s.%s.svc.%s" (include "broker.etcd.name" .) .Release.Namespace .Values.clusterDomain -}}
{{- end -}}

{{- define "broker.etcd.scheme" -}}
{{- if .Values.store.etcd.tls.enabled -}}https{{- else -}}http{{- end -}}
{{- end -}}

{{/* --initial-cluster: every member's name and peer URL, from the StatefulSet's pod names. */}}
{{- define "broker.etcd.initialCluster" -}}
{{- $name := include "broker.etcd.name" . -}}
{{- $domain := include "broker.etcd.domain" . -}}
{{- $scheme := include "broker.etcd.scheme" . -}}
{{- $members := list -}}
{{- range $i := until (int .Values.etcd.replicas) -}}
{{- $members = append $members (printf "%s-%d=%s://%s-%d.%s:2380" $name $i $scheme $name $i $domain) -}}
{{- end -}}
{{- join "," $members -}}
{{- end -}}

{{/* The broker's --store. etcd: every member (the chart's pods, or store.etcd.endpoints). */}}
{{- define "broker.storeURL" -}}
{{- if eq .Values.store.type "etcd" -}}
{{- if .Values.store.etcd.endpoints -}}
etcd://{{ join "," .Values.store.etcd.endpoints }}
{{- else -}}
{{- $name := include "broker.etcd.name" . -}}
{{- $domain := include "broker.etcd.domain" . -}}
{{- $members := list -}}
{{- range $i := until (int .Values.etcd.replicas) -}}
{{- $members = append $members (printf "%s-%d.%s:2379" $name $i $domain) -}}
{{- end -}}
etcd://{{ join "," $members }}
{{- end -}}
{{- else -}}
{{- /* The SQLite file lives on the data volume, mounted at /var/lib/gpufed. */ -}}
sqlite:////var/lib/gpufed/broker.db
{{- end -}}
{{- end -}}

{{- define "broker.dataClaim" -}}
{{- default (printf "%s-data" (include "broker.fullname" .)) .Values.store.sqlite.existingClaim -}}
{{- end -}}

{{/* Pod anti-affinity: spread the pods matching `selector` over `topologyKey` domains. */}}
{{- define "broker.podAntiAffinity" -}}
{{- $term := dict "labelSelector" (dict "matchLabels" (.selector | fromYaml)) "topologyKey" .spec.topologyKey -}}
{{- if eq .spec.type "required" -}}
podAntiAffinity:
  requiredDuringSchedulingIgnoredDuringExecution:
    {{- list $term | toYaml | nindent 4 }}
{{- else if eq .spec.type "preferred" -}}
podAntiAffinity:
  preferredDuringSchedulingIgnoredDuringExecution:
    {{- list (dict "weight" 100 "podAffinityTerm" $term) | toYaml | nindent 4 }}
{{- end -}}
{{- end -}}

{{/* The Secret with the broker's own certificate and key (tls.enabled). */}}
{{- define "broker.tlsSecret" -}}
{{- if .Values.tls.existingSecret -}}
{{- .Values.tls.existingSecret -}}
{{- else if .Values.tls.certManager.enabled -}}
{{- printf "%s-tls" (include "broker.fullname" .) -}}
{{- else -}}
{{- required "tls.existingSecret (or tls.certManager.enabled) is required when tls.enabled" "" -}}
{{- end -}}
{{- end -}}

{{/* http or https: what the broker's port speaks. */}}
{{- define "broker.scheme" -}}
{{- if .Values.tls.enabled -}}https{{- else -}}http{{- end -}}
{{- end -}}
