{{/* ---------------------------------------------------------------------------------
Names and labels
--------------------------------------------------------------------------------- */}}

{{- define "llamaswap.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "llamaswap.fullname" -}}
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

{{/* A component's name: "<fullname>-<component>", within 63 characters. */}}
{{- define "llamaswap.componentName" -}}
{{- printf "%s-%s" (include "llamaswap.fullname" .root | trunc (int (sub 62 (len .component))) | trimSuffix "-") .component }}
{{- end }}

{{- define "llamaswap.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "llamaswap.labels" -}}
helm.sh/chart: {{ include "llamaswap.chart" . }}
{{ include "llamaswap.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: llamaswap
{{- end }}

{{- define "llamaswap.selectorLabels" -}}
app.kubernetes.io/name: {{ include "llamaswap.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Selector labels of one component: (dict "root" $ "component" "server") */}}
{{- define "llamaswap.componentSelectorLabels" -}}
{{ include "llamaswap.selectorLabels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "llamaswap.componentLabels" -}}
{{ include "llamaswap.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "llamaswap.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "llamaswap.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "llamaswap.image" -}}
{{- printf "%s:%s" .image.repository (toString (default .default .image.tag)) }}
{{- end }}

{{/* ---------------------------------------------------------------------------------
Addresses. "host:port" strings as in the sidecar's configuration (llamaswap.config).
--------------------------------------------------------------------------------- */}}

{{/* The port of "host:port". */}}
{{- define "llamaswap.port" -}}
{{- regexReplaceAll "^.*:" . "" }}
{{- end }}

{{/* The host of "host:port" (brackets of an IPv6 address removed). */}}
{{- define "llamaswap.host" -}}
{{- regexReplaceAll ":[0-9]+$" . "" | trimPrefix "[" | trimSuffix "]" }}
{{- end }}

{{/* Where a local client connects for a listen host: 0.0.0.0 -> 127.0.0.1, :: -> ::1. */}}
{{- define "llamaswap.connectHost" -}}
{{- $host := include "llamaswap.host" . }}
{{- if or (eq $host "0.0.0.0") (eq $host "") }}127.0.0.1
{{- else if eq $host "::" }}::1
{{- else }}{{ $host }}
{{- end }}
{{- end }}

{{/* "true" when the host is an IP address (Envoy STATIC cluster), else "" (STRICT_DNS). */}}
{{- define "llamaswap.isIP" -}}
{{- if or (regexMatch "^[0-9]{1,3}\\.[0-9]{1,3}\\.[0-9]{1,3}\\.[0-9]{1,3}$" .) (contains ":" .) }}true{{ end }}
{{- end }}

{{/* llama-server's address inside the pod. */}}
{{- define "llamaswap.upstreamURL" -}}
{{- printf "http://127.0.0.1:%d" (int .Values.llamaServer.port) }}
{{- end }}

{{/* The OTLP/gRPC endpoint the sidecar and Envoy export to ("" = none). */}}
{{- define "llamaswap.otlpEndpoint" -}}
{{- if .Values.collector.enabled }}
{{- printf "http://%s.%s.svc.%s:4317" (include "llamaswap.componentName" (dict "root" . "component" "collector")) .Release.Namespace .Values.clusterDomain }}
{{- else }}
{{- .Values.collector.endpoint }}
{{- end }}
{{- end }}

{{/* The OTLP/gRPC endpoint (host:port) the collector sends traces to ("" = none). */}}
{{- define "llamaswap.jaegerOtlpEndpoint" -}}
{{- if .Values.jaeger.enabled }}
{{- printf "%s.%s.svc.%s:4317" (include "llamaswap.componentName" (dict "root" . "component" "jaeger")) .Release.Namespace .Values.clusterDomain }}
{{- else }}
{{- .Values.jaeger.endpoint }}
{{- end }}
{{- end }}

{{/* Seconds the sidecar lets the running request finish after SIGTERM. */}}
{{- define "llamaswap.graceSeconds" -}}
{{- if gt (int .Values.sidecar.graceSeconds) 0 }}
{{- int .Values.sidecar.graceSeconds }}
{{- else }}
{{- max 1 (sub (int .Values.terminationGracePeriodSeconds) 15) }}
{{- end }}
{{- end }}

{{/* Seconds a preStop hook may wait, leaving Kubernetes time to send SIGTERM. */}}
{{- define "llamaswap.preStopSeconds" -}}
{{- max 1 (sub (int .Values.terminationGracePeriodSeconds) 5) }}
{{- end }}

{{/* ---------------------------------------------------------------------------------
The sidecar's configuration file (llamaswap serve -c). Every value the Envoy bootstrap
depends on is written out, so the two always agree.
--------------------------------------------------------------------------------- */}}
{{- define "llamaswap.sidecarConfig" -}}
{{- $v := .Values }}
{{- $priority := dict "mode" $v.security.priority.mode "min" (int $v.security.priority.min) "max" (int $v.security.priority.max) }}
{{- with $v.security.priority.trustedHeader }}{{ $_ := set $priority "trustedHeader" . }}{{ end }}
{{- $config := dict
  "routing" (dict "scheduler" (dict
      "use" $v.routing.scheduler.use
      "maxQueued" (int $v.routing.scheduler.maxQueued)
      "maxWaitSeconds" $v.routing.scheduler.maxWaitSeconds
      "maxRunSeconds" $v.routing.scheduler.maxRunSeconds
      "settings" (dict "serial" (dict
          "agingDivisor" $v.routing.scheduler.settings.serial.agingDivisor
          "swapAffinityBonus" (int $v.routing.scheduler.settings.serial.swapAffinityBonus)))))
  "models" (deepCopy (default (dict) $v.models))
  "listen" (dict "http" $v.listen.http "grpc" $v.listen.grpc "admin" $v.listen.admin)
  "upstream" (dict
      "url" (include "llamaswap.upstreamURL" .)
      "modelsPollSeconds" $v.upstream.modelsPollSeconds)
  "envoy" (dict
      "streamIdleTimeoutSeconds" $v.envoy.streamIdleTimeoutSeconds
      "extProcMessageTimeoutMs" (int64 $v.envoy.extProcMessageTimeoutMs)
      "maxRequestBytes" (int64 $v.envoy.maxRequestBytes)
      "maxSidecarStreams" (int64 $v.envoy.maxSidecarStreams)
      "failOpen" $v.envoy.failOpen)
  "security" (dict "priority" $priority)
}}
{{- toYaml (mergeOverwrite $config (deepCopy (default (dict) $v.sidecar.extraConfig))) }}
{{- end }}

{{/* ---------------------------------------------------------------------------------
Probe and hook scripts
--------------------------------------------------------------------------------- */}}

{{/* bash: send one HTTP request to Envoy's admin port; sets $status and $body. No curl in
the Envoy image, so it uses bash's /dev/tcp. Args: the admin "host:port". */}}
{{- define "llamaswap.envoyAdminRequestFn" -}}
admin() {
  exec 3<>/dev/tcp/{{ include "llamaswap.connectHost" . }}/{{ include "llamaswap.port" . }} || return 1
  printf '%s %s HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Length: 0\r\n\r\n' "$1" "$2" >&3
  IFS= read -r -t 5 status <&3 || { exec 3<&-; return 1; }
  body=""
  while IFS= read -r -t 5 line <&3 || [ -n "$line" ]; do body+="$line"$'\n'; line=""; done
  exec 3<&-
}
{{- end }}

{{- define "llamaswap.envoyReadyScript" -}}
{{ include "llamaswap.envoyAdminRequestFn" .Values.envoy.admin }}
admin GET /ready && [[ "$status" == *" 200 "* ]]
{{- end }}

{{- define "llamaswap.envoyLiveScript" -}}
{{ include "llamaswap.envoyAdminRequestFn" .Values.envoy.admin }}
admin GET /ready && [[ "$status" == HTTP/* ]]
{{- end }}

{{/* preStop: drain the listener (clients get "Connection: close" / GOAWAY), then wait until
no request is active or the grace period is nearly over; SIGTERM follows. */}}
{{- define "llamaswap.envoyPreStopScript" -}}
{{ include "llamaswap.envoyAdminRequestFn" .Values.envoy.admin }}
deadline=$((SECONDS + {{ include "llamaswap.preStopSeconds" . }}))
admin POST '/drain_listeners?graceful' || exit 0
while (( SECONDS < deadline )); do
  admin GET '/stats?filter=^http\.ingress\.downstream_rq_active$' || exit 0
  [[ "$body" =~ downstream_rq_active:\ ([0-9]+) ]] && [[ "${BASH_REMATCH[1]}" == 0 ]] && exit 0
  sleep 1
done
{{- end }}

{{/* python in the sidecar image: GET a path on the admin port, exit 0 on 200. */}}
{{- define "llamaswap.sidecarProbeScript" -}}
{{- $url := printf "http://%s:%s%s" (include "llamaswap.connectHost" .root.Values.listen.admin) (include "llamaswap.port" .root.Values.listen.admin) .path -}}
import sys, urllib.request
sys.exit(0 if urllib.request.urlopen({{ $url | squote }}, timeout=4).status == 200 else 1)
{{- end }}

{{/* sh in the llama-server image: stay up until the sidecar has exited (it exits once the
running request has finished), so the GPU's last generation completes. */}}
{{- define "llamaswap.llamaPreStopScript" -}}
end=$(( $(date +%s) + {{ include "llamaswap.preStopSeconds" . }} ))
while [ "$(date +%s)" -lt "$end" ] && curl -fsS -o /dev/null -m 2 {{ printf "http://%s:%s/healthz" (include "llamaswap.connectHost" .Values.listen.admin) (include "llamaswap.port" .Values.listen.admin) }}; do
  sleep 1
done
{{- end }}
