{{/* The resources' name: <release>-sluice, or the release name when it says sluice. */}}
{{- define "sluice.fullname" -}}
{{- if contains "sluice" .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-sluice" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* The Secret holding the Redis password. */}}
{{- define "sluice.redisSecret" -}}
{{- .Values.redis.existingSecret | default (printf "%s-redis" (include "sluice.fullname" .)) -}}
{{- end -}}

{{/* The Secret holding the interception CA. */}}
{{- define "sluice.caSecret" -}}
{{- .Values.interception.existingSecret | default (printf "%s-ca" (include "sluice.fullname" .)) -}}
{{- end -}}
