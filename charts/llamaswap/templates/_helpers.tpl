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

{{/* An image reference: repository:tag, and @digest when the values pin one. */}}
{{- define "llamaswap.image" -}}
{{- printf "%s:%s" .image.repository (toString (default .default .image.tag)) }}
{{- with .image.digest }}@{{ . }}{{ end }}
{{- end }}

{{/* The sidecar image (also the init containers' and the helm test's): nobody publishes one,
so the chart refuses to render without the repository you pushed it to. */}}
{{- define "llamaswap.sidecarImage" -}}
{{- if not .Values.sidecar.image.repository }}
{{- fail (printf "sidecar.image.repository is required: the llamaswap image is not published anywhere. Build it from the repository's Dockerfile and push it to your registry:\n  docker build -t REGISTRY/llamaswap:%s .\n  docker push REGISTRY/llamaswap:%s\nthen set --set sidecar.image.repository=REGISTRY/llamaswap (see the chart's README)" .Chart.AppVersion .Chart.AppVersion) }}
{{- end }}
{{- include "llamaswap.image" (dict "image" .Values.sidecar.image "default" .Chart.AppVersion) }}
{{- end }}

{{/* With an Ingress (or a LoadBalancer or NodePort Service), the priority a caller claims must
not be trusted by default. */}}
{{- define "llamaswap.checkIngressPriority" -}}
{{- if not (dig "security" "priority" "mode" "" (default (dict) .Values.config)) }}
{{- if .Values.ingress.enabled }}
{{- fail "ingress.enabled needs an explicit config.security.priority.mode: the sidecar's default, trust, lets anyone on the internet choose any priority. Set clamp (with config.security.priority.min/max, e.g. -100..0: a max of 50 or more is the interactive band), strip, or trust if your ingress sets or authenticates X-LlamaSwap-Priority" }}
{{- else if has .Values.service.type (list "LoadBalancer" "NodePort") }}
{{- fail (printf "service.type %s needs an explicit config.security.priority.mode: the sidecar's default, trust, lets anyone who reaches the Service choose any priority. Set clamp (with config.security.priority.min/max, e.g. -100..0: a max of 50 or more is the interactive band), strip, or trust if whatever is in front sets or authenticates X-LlamaSwap-Priority" .Values.service.type) }}
{{- end }}
{{- end }}
{{- end }}

{{/* "true" when the listener is public (an Ingress, or a LoadBalancer or NodePort Service) and
the priority clamp lets callers into the interactive band (max >= 50, the sidecar's default max
being 100): what `llamaswap check-config` warns about, said in the NOTES. */}}
{{- define "llamaswap.publicClampReachesInteractive" -}}
{{- $priority := dig "security" "priority" (dict) (default (dict) .Values.config) -}}
{{- $public := or .Values.ingress.enabled (has .Values.service.type (list "LoadBalancer" "NodePort")) -}}
{{- if and $public (eq (toString (get $priority "mode")) "clamp") (ge (int (dig "max" 100 $priority)) 50) -}}
true
{{- end -}}
{{- end }}

{{/* The model id of a download entry: its name (or the URL's file name) without .gguf. */}}
{{- define "llamaswap.downloadModelId" -}}
{{- default (base (urlParse .url).path) .name | trimSuffix ".gguf" }}
{{- end }}

{{/* The model loaded before the pod is ready ("" = none): llamaServer.defaultModel, else the
first downloaded file; none when llamaServer.args replaces router mode. */}}
{{- define "llamaswap.defaultModel" -}}
{{- $ls := .Values.llamaServer }}
{{- if not $ls.args }}
{{- if $ls.defaultModel }}{{ $ls.defaultModel }}
{{- else if $ls.download.files }}{{ include "llamaswap.downloadModelId" (first $ls.download.files) }}
{{- end }}
{{- end }}
{{- end }}

{{/* progressDeadlineSeconds: the value, or the old pod's stop + the startup budget + 300. */}}
{{- define "llamaswap.progressDeadlineSeconds" -}}
{{- $v := .Values }}
{{- $grace := int $v.terminationGracePeriodSeconds }}
{{- if gt (int $v.progressDeadlineSeconds) 0 }}
{{- if le (int $v.progressDeadlineSeconds) $grace }}
{{- fail (printf "progressDeadlineSeconds (%d) must be above terminationGracePeriodSeconds (%d): a Recreate rollout first waits for the old pod to stop" (int $v.progressDeadlineSeconds) $grace) }}
{{- end }}
{{- int $v.progressDeadlineSeconds }}
{{- else }}
{{- $llama := mul (int $v.llamaServer.startupProbe.periodSeconds) (int $v.llamaServer.startupProbe.failureThreshold) }}
{{- $sidecar := mul (int $v.sidecar.startupProbe.periodSeconds) (int $v.sidecar.startupProbe.failureThreshold) }}
{{- add $grace (max $llama $sidecar) 300 }}
{{- end }}
{{- end }}

{{/* ---------------------------------------------------------------------------------
The configuration file: .Values.config as it is. The sidecar reads it, and the envoy-config
init container builds Envoy's bootstrap from it (llamaswap.envoy.bootstrap.build_bootstrap), so the
chart holds no copy of either's defaults.
--------------------------------------------------------------------------------- */}}
{{- define "llamaswap.configFile" -}}
{{- $config := deepCopy (default (dict) .Values.config) }}
{{- $ip := .Values.inferencePool }}
{{- /* The InferenceObjectives the chart creates are the priorities of the requests that name
them (routing.objectives), unless the config says otherwise: one list, the values'. */ -}}
{{- if and $ip.enabled $ip.objectives.create (not (hasKey (default (dict) $config.routing) "objectives")) }}
{{- $objectives := dict }}
{{- range $ip.objectives.items }}{{ $_ := set $objectives .name (int .priority) }}{{ end }}
{{- $routing := default (dict) $config.routing }}
{{- $_ := set $routing "objectives" $objectives }}
{{- $_ := set $config "routing" $routing }}
{{- end }}
{{- /* llamaServer.maxLoaded: llama-server's --models-max and the sidecar's upstream.maxLoaded, one
number, so that the router never evicts on its own a model the scheduler keeps resident. */ -}}
{{- $ls := .Values.llamaServer }}
{{- $maxLoaded := int (default 1 $ls.maxLoaded) }}
{{- if and (hasKey $ls "modelsMax") (ne (int $ls.modelsMax) $maxLoaded) }}
{{- fail (printf "llamaServer.modelsMax (%v) is renamed llamaServer.maxLoaded, which also sets the sidecar's config.upstream.maxLoaded: set llamaServer.maxLoaded: %v and remove modelsMax" $ls.modelsMax $ls.modelsMax) }}
{{- end }}
{{- $upstreamConfig := default (dict) $config.upstream }}
{{- if and (hasKey $upstreamConfig "maxLoaded") (not $ls.args) }}
{{- if ne (int $upstreamConfig.maxLoaded) $maxLoaded }}
{{- fail (printf "config.upstream.maxLoaded is %v and llamaServer.maxLoaded is %d: the chart starts llama-server with --models-max llamaServer.maxLoaded and writes it into config.upstream.maxLoaded, so they must agree: remove config.upstream.maxLoaded and set llamaServer.maxLoaded" $upstreamConfig.maxLoaded $maxLoaded) }}
{{- end }}
{{- else if and (gt $maxLoaded 1) (not (hasKey $upstreamConfig "maxLoaded")) }}
{{- $_ := set $upstreamConfig "maxLoaded" $maxLoaded }}
{{- $_ := set $config "upstream" $upstreamConfig }}
{{- end }}
{{- /* llamaServer.idleUnloadSeconds: the sidecar's upstream.idleUnloadSeconds (one number, either place). */ -}}
{{- $idle := float64 (default 0 $ls.idleUnloadSeconds) }}
{{- if gt $idle 0.0 }}
{{- $upstreamIdle := default (dict) $config.upstream }}
{{- if and (hasKey $upstreamIdle "idleUnloadSeconds") (ne (float64 $upstreamIdle.idleUnloadSeconds) $idle) }}
{{- fail (printf "config.upstream.idleUnloadSeconds is %v and llamaServer.idleUnloadSeconds is %v: the chart writes llamaServer.idleUnloadSeconds into config.upstream.idleUnloadSeconds, so set one of them" $upstreamIdle.idleUnloadSeconds $ls.idleUnloadSeconds) }}
{{- end }}
{{- $_ := set $upstreamIdle "idleUnloadSeconds" $ls.idleUnloadSeconds }}
{{- $_ := set $config "upstream" $upstreamIdle }}
{{- end }}
{{- $gpus := int .Values.llamaServer.gpus }}
{{- if hasKey $config "upstreams" }}
{{- fail "config.upstreams is written by the chart, one entry per llama-server container of the pod: remove config.upstreams and set llamaServer.gpus (the number of GPUs, one llama-server each)" }}
{{- end }}
{{- if gt $gpus 1 }}
{{- /* One upstream per llama-server container (llamaServer.gpus), on the ports the containers
get. upstream.url (only the first port) and upstream.slots (now on each entry) go: the sidecar
refuses them beside upstreams. upstream's other keys apply to every upstream. */ -}}
{{- $upstreams := list }}
{{- range $i, $port := (include "llamaswap.llamaServerPorts" . | fromJsonArray) }}
{{- $entry := dict "name" (printf "gpu%d" $i) "url" (printf "http://127.0.0.1:%d" (int $port)) }}
{{- with dig "upstream" "slots" "" $config }}{{ $_ := set $entry "slots" . }}{{ end }}
{{- $upstreams = append $upstreams $entry }}
{{- end }}
{{- $upstream := omit (default (dict) $config.upstream) "url" "slots" }}
{{- if $upstream }}{{ $_ := set $config "upstream" $upstream }}{{ else }}{{ $_ := unset $config "upstream" }}{{ end }}
{{- $_ := set $config "upstreams" $upstreams }}
{{- end }}
{{- /* The Batch API's directory is the mount of its volume (batches.*): the chart's to write. */ -}}
{{- $batches := default (dict) $config.batches }}
{{- if hasKey $batches "dir" }}
{{- fail "config.batches.dir is written by the chart: the batches' volume, mounted in the sidecar at batches.mountPath. Remove config.batches.dir; set batches.enabled (and batches.persistence.*) instead" }}
{{- end }}
{{- if .Values.batches.enabled }}
{{- $_ := set $batches "dir" .Values.batches.mountPath }}
{{- if and .Values.batches.maxStoredBytes (not (hasKey $batches "maxStoredBytes")) }}
{{- $_ := set $batches "maxStoredBytes" .Values.batches.maxStoredBytes }}
{{- end }}
{{- $_ := set $config "batches" $batches }}
{{- end }}
{{- if and .Values.llamaServer.apiKey.existingSecret (not (dig "upstream" "apiKey" "" $config)) -}}
{{- $_ := set $config "upstream" (merge (dict "apiKey" (printf "env:%s" (include "llamaswap.upstreamKeyEnv" .))) (default (dict) (get $config "upstream"))) -}}
{{- end -}}
{{- toYaml $config }}
{{- end }}

{{/* The Batch API keeps a batch in one pod (its database, the lines it sends): refuse the
layouts where two pods would share the batches' volume, or a client's next request could reach
a pod that does not know its batch. */}}
{{- define "llamaswap.checkBatches" -}}
{{- $v := .Values }}
{{- if $v.batches.enabled }}
{{- if gt (int $v.replicas) 1 }}
{{- fail (printf "batches.enabled with replicas: %d: a batch lives in one pod (its database on the batches volume, the lines that pod sends), so behind the Service a client's next request could reach a pod that does not know it, and pods sharing the volume would each send every line. Set batches.enabled=false, or replicas: 1 (several GPUs under one queue: llamaServer.gpus)" (int $v.replicas)) }}
{{- end }}
{{- if eq $v.strategy.type "RollingUpdate" }}
{{- $surge := toString (dig "rollingUpdate" "maxSurge" "25%" (default (dict) $v.strategy)) }}
{{- if not (has $surge (list "0" "0%")) }}
{{- fail (printf "batches.enabled with a RollingUpdate that may surge (maxSurge %s): the new pod and the old would share the batches volume and both send every line. Use strategy Recreate (the default), rollingUpdate.maxSurge: 0, or batches.enabled=false" $surge) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/* The sidecar's variable holding llama-server's API key (llamaServer.apiKey). */}}
{{- define "llamaswap.upstreamKeyEnv" -}}LLAMASWAP_UPSTREAM_API_KEY{{- end }}

{{/* An env entry NAME with llama-server's API key from llamaServer.apiKey's Secret; nothing without one. */}}
{{- define "llamaswap.upstreamKeyEntry" -}}
{{- with .root.Values.llamaServer.apiKey.existingSecret }}
- name: {{ $.name }}
  valueFrom:
    secretKeyRef:
      name: {{ . | quote }}
      key: {{ $.root.Values.llamaServer.apiKey.secretKey | quote }}
{{- end }}
{{- end }}

{{/* The few config values the pod's own wiring reads (probes, ports, hooks). */}}
{{- define "llamaswap.listenHTTP" -}}
{{- required "config.listen.http is needed: Envoy's listener, which the Service targets (e.g. \"0.0.0.0:8080\")" (dig "listen" "http" "" (default (dict) .Values.config)) }}
{{- end }}

{{- define "llamaswap.listenAdmin" -}}
{{- required "config.listen.admin is needed: the sidecar's admin address, which the probes call (e.g. \"127.0.0.1:9090\")" (dig "listen" "admin" "" (default (dict) .Values.config)) }}
{{- end }}

{{/* llama-server's port in the pod: the port of config.upstream.url, which must name this
pod's localhost over http (llama-server listens on 127.0.0.1 there). */}}
{{- define "llamaswap.llamaServerPort" -}}
{{- $url := required "config.upstream.url is needed: llama-server's address in the pod (e.g. \"http://127.0.0.1:8081\")" (dig "upstream" "url" "" (default (dict) .Values.config)) }}
{{- $parts := urlParse $url }}
{{- $host := regexReplaceAll ":[0-9]*$" $parts.host "" | trimPrefix "[" | trimSuffix "]" }}
{{- if or (ne $parts.scheme "http") (not (has $host (list "127.0.0.1" "localhost"))) }}
{{- fail (printf "config.upstream.url must be http://127.0.0.1:PORT (llama-server in this pod, on localhost), got %q" $url) }}
{{- end }}
{{- if regexMatch ":[0-9]+$" $parts.host }}{{ regexReplaceAll "^.*:" $parts.host "" }}{{ else }}80{{ end }}
{{- end }}

{{/* The ports of the llama-server containers, a JSON list: the port of config.upstream.url,
then one more for each further GPU (llamaServer.gpus). Refuses ports the pod already uses. */}}
{{- define "llamaswap.llamaServerPorts" -}}
{{- $base := int (include "llamaswap.llamaServerPort" .) }}
{{- $gpus := int .Values.llamaServer.gpus }}
{{- $ports := list }}
{{- range $i := until $gpus }}{{ $ports = append $ports (add $base $i) }}{{ end }}
{{- if gt $gpus 1 }}
{{- if gt (int (last $ports)) 65535 }}
{{- fail (printf "llamaServer.gpus: %d llama-server containers take ports %d..%d (config.upstream.url's port + 0..%d), past 65535: lower the port of config.upstream.url" $gpus $base (int (last $ports)) (sub $gpus 1)) }}
{{- end }}
{{- $config := default (dict) .Values.config }}
{{- $taken := dict }}
{{- range $key := list "http" "admin" "grpc" }}
{{- with dig "listen" $key "" $config }}{{ $_ := set $taken (include "llamaswap.port" .) (printf "config.listen.%s" $key) }}{{ end }}
{{- end }}
{{- $_ := set $taken (include "llamaswap.port" .Values.envoy.admin) "envoy.admin" }}
{{- range $port := $ports }}
{{- with get $taken (toString $port) }}
{{- fail (printf "llamaServer.gpus: the llama-server containers take ports %d..%d (config.upstream.url's port + 0..%d), and %d is %s's: move config.upstream.url's port or %s" $base (int (last $ports)) (sub $gpus 1) (int $port) . .) }}
{{- end }}
{{- end }}
{{- end }}
{{- toJson $ports }}
{{- end }}

{{/* Values of the old layout (chart 0.1): each moved under config: or went away. Helm's
schema accepts them only so that this can say where they went. */}}
{{- define "llamaswap.checkMovedValues" -}}
{{- $v := .Values }}
{{- $moved := list }}
{{- range $key := list "routing" "models" "listen" "upstream" "security" }}
{{- if hasKey $v $key }}{{ $moved = append $moved (printf "%s -> config.%s" $key $key) }}{{ end }}
{{- end }}
{{- range $key := list "streamIdleTimeoutSeconds" "maxRequestBytes" "maxSidecarStreams" "failOpen" }}
{{- if hasKey $v.envoy $key }}{{ $moved = append $moved (printf "envoy.%s -> config.envoy.%s" $key $key) }}{{ end }}
{{- end }}
{{- if hasKey $v.envoy "extProcMessageTimeoutMs" }}{{ $moved = append $moved "envoy.extProcMessageTimeoutMs: gone (the data path is ext_authz and an access log now), remove it" }}{{ end }}
{{- if hasKey $v.envoy "serviceName" }}{{ $moved = append $moved "envoy.serviceName: gone (llamaswap envoy-config names Envoy's spans llamaswap-envoy), remove it" }}{{ end }}
{{- if hasKey $v.sidecar "extraConfig" }}{{ $moved = append $moved "sidecar.extraConfig -> its keys go under config" }}{{ end }}
{{- if hasKey $v.llamaServer "port" }}{{ $moved = append $moved "llamaServer.port -> the port of config.upstream.url (e.g. http://127.0.0.1:8081)" }}{{ end }}
{{- if $moved }}
{{- fail (printf "values of the old layout (see the chart's README, \"Upgrading from 0.1\"):\n- %s" (join "\n- " $moved)) }}
{{- end }}
{{- end }}

{{/* ---------------------------------------------------------------------------------
Addresses: "host:port" as in the configuration (IPv6 as [::1]:8080).
--------------------------------------------------------------------------------- */}}

{{/* The port of "host:port". */}}
{{- define "llamaswap.port" -}}
{{- regexReplaceAll "^.*:" . "" }}
{{- end }}

{{/* The host of "host:port" (brackets of an IPv6 address removed). */}}
{{- define "llamaswap.host" -}}
{{- regexReplaceAll ":[0-9]+$" . "" | trimPrefix "[" | trimSuffix "]" }}
{{- end }}

{{/* Where a client inside the pod connects for a listen address: 0.0.0.0 -> 127.0.0.1,
:: -> ::1. */}}
{{- define "llamaswap.connectHost" -}}
{{- $host := include "llamaswap.host" . }}
{{- if or (eq $host "0.0.0.0") (eq $host "") }}127.0.0.1
{{- else if eq $host "::" }}::1
{{- else }}{{ $host }}
{{- end }}
{{- end }}

{{/* "http://host:port" for a listen address, from inside the pod (IPv6 in brackets). */}}
{{- define "llamaswap.connectURL" -}}
{{- $host := include "llamaswap.connectHost" . }}
{{- printf "http://%s:%s" (ternary (printf "[%s]" $host) $host (contains ":" $host)) (include "llamaswap.port" .) }}
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
{{- $url := printf "%s%s" (include "llamaswap.connectURL" (include "llamaswap.listenAdmin" .root)) .path -}}
import sys, urllib.request
sys.exit(0 if urllib.request.urlopen({{ $url | squote }}, timeout=4).status == 200 else 1)
{{- end }}

{{/* sh in the llama-server image: stay up until the sidecar has exited (it exits once the
running request has finished), so the GPU's last generation completes. */}}
{{- define "llamaswap.llamaPreStopScript" -}}
end=$(( $(date +%s) + {{ include "llamaswap.preStopSeconds" . }} ))
while [ "$(date +%s)" -lt "$end" ] && curl -fsS -o /dev/null -m 2 {{ printf "%s/healthz" (include "llamaswap.connectURL" (include "llamaswap.listenAdmin" .)) }}; do
  sleep 1
done
{{- end }}

{{/* sh in the llama-server image: does llama-server see a GPU? Prints what it lists; exit 1
with the fix when no line is a GPU device (llamaServer.gpuCheck.devicePattern). */}}
{{- define "llamaswap.gpuCheckScript" -}}
{{- $ls := .Values.llamaServer -}}
devices=$({{ $ls.binary | squote }} --list-devices 2>&1)
status=$?
printf '%s\n' "$devices"
if [ "$status" -eq 0 ] && printf '%s\n' "$devices" | grep -Eq {{ $ls.gpuCheck.devicePattern | squote }}; then
  echo "gpu-check: ok, llama-server sees a GPU"
  exit 0
fi
echo "gpu-check: llama-server sees no GPU (--list-devices exited $status and lists no device matching llamaServer.gpuCheck.devicePattern): it would run on the CPU. Check the node's GPU driver and device plugin, llamaServer.resources.limits (e.g. nvidia.com/gpu: 1) and runtimeClassName (e.g. nvidia); set llamaServer.gpuCheck.enabled=false if CPU is intended." >&2
exit 1
{{- end }}

{{/* ---------------------------------------------------------------------------------
Many nodes: the InferencePool and its endpoint picker (templates/inferencepool.yaml)
--------------------------------------------------------------------------------- */}}

{{- define "llamaswap.inferencePoolName" -}}
{{- default (include "llamaswap.fullname" .) .Values.inferencePool.name }}
{{- end }}

{{- define "llamaswap.eppConfigKey" -}}
llamaswap-epp.yaml
{{- end }}

{{/* The EndpointPickerConfig (llm-d's router): the metrics data source reading the pods'
picker page, the core-metrics-extractor with llamaswap's engine config (the router wires the two
together when both are declared under their type names), then the scorers, picker and profiles
of the values. */}}
{{- define "llamaswap.eppConfig" -}}
{{- $ip := .Values.inferencePool }}
{{- $engine := merge (dict "name" $ip.engineType) $ip.engineConfig }}
{{- $source := dict "type" "metrics-data-source" "parameters" (dict "scheme" "http" "path" $ip.endpointPicker.metricsPath) }}
{{- $extractor := dict "type" "core-metrics-extractor" "parameters" (dict "engineConfigs" (list $engine)) }}
{{- $plugins := concat (list $source $extractor) $ip.endpointPicker.plugins }}
{{- $config := dict "apiVersion" "llm-d.ai/v1alpha1" "kind" "EndpointPickerConfig" "plugins" $plugins "schedulingProfiles" $ip.endpointPicker.schedulingProfiles }}
{{- toYaml (merge $config $ip.endpointPicker.extraConfig) }}
{{- end }}

{{/* Whether the Batch API is on and tells no callers apart: no batches.apiKeys, no
callerHeader, no upstream key. Every caller who reaches the listener then reads, deletes and
cancels every file and batch. */}}
{{- define "llamaswap.batchesOpen" -}}
{{- $v := .Values }}
{{- $batches := default (dict) $v.config.batches }}
{{- if and $v.batches.enabled (not $batches.apiKeys) (not $batches.callerHeader) (not (dig "upstream" "apiKey" "" $v.config)) (not $v.llamaServer.apiKey.existingSecret) -}}
true
{{- end }}
{{- end }}
