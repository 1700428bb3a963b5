{{/* The resources' name: <release>-sluice, or the release name when it says sluice. */}}
{{- define "sluice.fullname" -}}
{{- if contains "sluice" .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-sluice" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* The Secret holding the Redis password (key `password`); empty when Redis has none. */}}
{{- define "sluice.redisSecret" -}}
{{- if .Values.redis.existingSecret -}}
{{- .Values.redis.existingSecret -}}
{{- else if .Values.redis.password -}}
{{- printf "%s-redis" (include "sluice.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/* The user-info part of the Redis URL: the password from the environment, when there is one. */}}
{{- define "sluice.redisUserinfo" -}}
{{- if include "sluice.redisSecret" . -}}
:${SLUICE_REDIS_PASSWORD}@
{{- end -}}
{{- end -}}

{{/* The Secret holding the interception CA (keys `ca.pem`, `ca.key`). */}}
{{- define "sluice.caSecret" -}}
{{- .Values.interception.existingSecret | default (printf "%s-ca" (include "sluice.fullname" .)) -}}
{{- end -}}

{{/* The Secret holding the users file (key `users`); empty without proxy authentication. */}}
{{- define "sluice.usersSecret" -}}
{{- if .Values.auth.existingSecret -}}
{{- .Values.auth.existingSecret -}}
{{- else if .Values.auth.users -}}
{{- printf "%s-users" (include "sluice.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/* The Secret holding the admin token (key `token`); empty without one. */}}
{{- define "sluice.adminSecret" -}}
{{- if .Values.admin.existingSecret -}}
{{- .Values.admin.existingSecret -}}
{{- else if .Values.admin.token -}}
{{- printf "%s-admin" (include "sluice.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/*
The sluice.toml of the pods: `config` rendered as a template. It must say what the
values ask for (an edited `config` that lost a line would run without it): render
fails otherwise.
*/}}
{{- define "sluice.config" -}}
{{- $c := tpl .Values.config . -}}
{{- if and .Values.interception.enabled (not (regexMatch "(?m)^\\s*intercept\\s*=\\s*true" $c)) -}}
{{- fail "interception.enabled is true but config does not set tls.intercept = true: keep its intercept line" -}}
{{- end -}}
{{- if and (include "sluice.usersSecret" .) (not (contains "/etc/sluice/users/users" $c)) -}}
{{- fail "auth names a users file but config does not set security.auth_users_file = \"/etc/sluice/users/users\"" -}}
{{- end -}}
{{- if and (include "sluice.adminSecret" .) (not (contains "/etc/sluice/admin/token" $c)) -}}
{{- fail "admin names a token but config does not set proxy.admin_token_file = \"/etc/sluice/admin/token\"" -}}
{{- end -}}
{{- if and (contains "SLUICE_REDIS_PASSWORD" $c) (not (include "sluice.redisSecret" .)) -}}
{{- fail "config names ${SLUICE_REDIS_PASSWORD} but neither redis.password nor redis.existingSecret is set" -}}
{{- end -}}
{{- $c -}}
{{- end -}}
