{{/* Chart name, truncated to the 63 characters a DNS label allows. */}}
{{- define "modelcanary.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Full name: <release>-<chart>, or the release name when it already contains the chart name. */}}
{{- define "modelcanary.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* <fullname>-<suffix>, within 63 characters. Call with (list $ "suffix"). */}}
{{- define "modelcanary.componentName" -}}
{{- $root := index . 0 -}}
{{- $suffix := index . 1 -}}
{{- $base := include "modelcanary.fullname" $root | trunc (int (sub 62 (len $suffix))) | trimSuffix "-" -}}
{{- printf "%s-%s" $base $suffix -}}
{{- end -}}

{{- define "modelcanary.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "modelcanary.labels" -}}
helm.sh/chart: {{ include "modelcanary.chart" . }}
{{ include "modelcanary.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: modelcanary
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "modelcanary.selectorLabels" -}}
app.kubernetes.io/name: {{ include "modelcanary.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* Labels of one component. Call with (list $ "proxy"). */}}
{{- define "modelcanary.componentLabels" -}}
{{ include "modelcanary.labels" (index . 0) }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{- define "modelcanary.componentSelectorLabels" -}}
{{ include "modelcanary.selectorLabels" (index . 0) }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{- define "modelcanary.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "modelcanary.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "modelcanary.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
{{- end -}}

{{- define "modelcanary.proxyServiceName" -}}
{{- include "modelcanary.componentName" (list . "proxy") -}}
{{- end -}}

{{/* Ports the workers and the controller serve /metrics and /healthz on (config.collect/control.metrics_port). */}}
{{- define "modelcanary.workersMetricsPort" -}}
{{- $collect := default dict .Values.config.collect -}}
{{- if hasKey $collect "metrics_port" -}}{{ int $collect.metrics_port }}{{- else -}}9464{{- end -}}
{{- end -}}

{{- define "modelcanary.controllerMetricsPort" -}}
{{- $control := default dict .Values.config.control -}}
{{- if hasKey $control "metrics_port" -}}{{ int $control.metrics_port }}{{- else -}}9465{{- end -}}
{{- end -}}

{{- define "modelcanary.kafkaSecurityProtocol" -}}
{{- if .Values.kafka.securityProtocol -}}
{{- .Values.kafka.securityProtocol -}}
{{- else if and .Values.kafka.sasl.enabled .Values.kafka.tls.enabled -}}
SASL_SSL
{{- else if .Values.kafka.sasl.enabled -}}
SASL_PLAINTEXT
{{- else if .Values.kafka.tls.enabled -}}
SSL
{{- else -}}
PLAINTEXT
{{- end -}}
{{- end -}}

{{/*
The effective config file: the user's `config` with the keys the chart owns set by the chart.
events.kafka.security names environment variables (keys ending in _env) and mounted files,
never secret values.
*/}}
{{- define "modelcanary.config" -}}
{{- $cfg := deepCopy (default dict .Values.config) -}}
{{- $server := default dict $cfg.server -}}
{{- $_ := set $server "host" "0.0.0.0" -}}
{{- $_ := set $server "port" 8080 -}}
{{- $_ := set $cfg "server" $server -}}
{{- $events := default dict $cfg.events -}}
{{- $_ := set $events "backend" "kafka" -}}
{{- $kafka := default dict $events.kafka -}}
{{- $_ := set $kafka "bootstrap_servers" .Values.kafka.bootstrapServers -}}
{{- range $key := list "sasl_plain_password" "ssl_password" -}}
{{- if hasKey (default dict $kafka.security) $key -}}
{{- fail (printf "config.events.kafka.security.%s would put a secret in the ConfigMap: set %s_env to a variable from a Secret (kafka.sasl.existingSecret does this for SASL)" $key $key) -}}
{{- end -}}
{{- end -}}
{{- if or .Values.kafka.securityProtocol .Values.kafka.sasl.enabled .Values.kafka.tls.enabled -}}
{{- $security := default dict $kafka.security -}}
{{- $owned := dict "security_protocol" (include "modelcanary.kafkaSecurityProtocol" .) -}}
{{- if .Values.kafka.sasl.enabled -}}
{{- $_ := set $owned "sasl_mechanism" .Values.kafka.sasl.mechanism -}}
{{- $_ := set $owned "sasl_plain_username_env" "MODELCANARY_KAFKA_SASL_USERNAME" -}}
{{- $_ := set $owned "sasl_plain_password_env" "MODELCANARY_KAFKA_SASL_PASSWORD" -}}
{{- end -}}
{{- if .Values.kafka.tls.enabled -}}
{{- $_ := set $owned "ssl_cafile" (printf "/etc/modelcanary/kafka-tls/%s" .Values.kafka.tls.caKey) -}}
{{- if .Values.kafka.tls.certKey -}}
{{- $_ := set $owned "ssl_certfile" (printf "/etc/modelcanary/kafka-tls/%s" .Values.kafka.tls.certKey) -}}
{{- end -}}
{{- if .Values.kafka.tls.keyKey -}}
{{- $_ := set $owned "ssl_keyfile" (printf "/etc/modelcanary/kafka-tls/%s" .Values.kafka.tls.keyKey) -}}
{{- end -}}
{{- $_ := set $owned "ssl_check_hostname" .Values.kafka.tls.checkHostname -}}
{{- end -}}
{{- /* the chart's key wins over the user's, in either form (`<key>` or `<key>_env`) */ -}}
{{- range $key, $value := $owned -}}
{{- $_ := unset $security (trimSuffix "_env" $key) -}}
{{- $_ := unset $security (printf "%s_env" (trimSuffix "_env" $key)) -}}
{{- $_ := set $security $key $value -}}
{{- end -}}
{{- $_ := set $kafka "security" $security -}}
{{- end -}}
{{- $_ := set $events "kafka" $kafka -}}
{{- $spool := default dict $events.spool -}}
{{- $_ := set $spool "dir" "/var/lib/modelcanary/spool" -}}
{{- $_ := set $events "spool" $spool -}}
{{- $_ := set $cfg "events" $events -}}
{{- $_ := set $cfg "state_dir" "/var/lib/modelcanary/state" -}}
{{- $notify := default dict $cfg.notify -}}
{{- if $notify.webhook_url -}}
{{- fail "config.notify.webhook_url would put a secret in the ConfigMap: give it from a Secret with notify.existingSecret (and notify.urlKey)" -}}
{{- end -}}
{{- if .Values.notify.existingSecret -}}
{{- $_ := unset $notify "webhook_url" -}}
{{- $_ := set $notify "webhook_url_env" "MODELCANARY_WEBHOOK_URL" -}}
{{- $_ := set $cfg "notify" $notify -}}
{{- end -}}
{{- toYaml $cfg -}}
{{- end -}}

{{/* Environment of one component's container. Call with (list $ "proxy"). */}}
{{- define "modelcanary.env" -}}
{{- $component := index . 1 -}}
{{- with index . 0 -}}
{{- if .Values.kafka.sasl.enabled }}
- name: MODELCANARY_KAFKA_SASL_USERNAME
  valueFrom:
    secretKeyRef:
      name: {{ required "kafka.sasl.existingSecret is required when kafka.sasl.enabled" .Values.kafka.sasl.existingSecret | quote }}
      key: {{ .Values.kafka.sasl.usernameKey | quote }}
- name: MODELCANARY_KAFKA_SASL_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ .Values.kafka.sasl.existingSecret | quote }}
      key: {{ .Values.kafka.sasl.passwordKey | quote }}
{{- end }}
{{- /* the proxies notify operator actions, the leading controller its own decisions */ -}}
{{- if and .Values.notify.existingSecret (has $component (list "proxy" "controller")) }}
- name: MODELCANARY_WEBHOOK_URL
  valueFrom:
    secretKeyRef:
      name: {{ .Values.notify.existingSecret | quote }}
      key: {{ .Values.notify.urlKey | quote }}
{{- end }}
{{- with .Values.env }}
{{ toYaml . }}
{{- end }}
{{- end -}}
{{- end -}}

{{- define "modelcanary.envFrom" -}}
{{- if .Values.existingSecret }}
- secretRef:
    name: {{ .Values.existingSecret | quote }}
{{- end }}
{{- with .Values.envFrom }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* The container's env and envFrom blocks, both omitted when empty. Call with (list $ "proxy"). */}}
{{- define "modelcanary.containerEnv" -}}
{{- $env := include "modelcanary.env" . | trim -}}
{{- $envFrom := include "modelcanary.envFrom" (index . 0) | trim -}}
{{- if $env -}}
env:
{{ $env }}
{{ end -}}
{{- if $envFrom -}}
envFrom:
{{ $envFrom }}
{{ end -}}
{{- end -}}

{{- define "modelcanary.volumeMounts" -}}
- name: config
  mountPath: /etc/modelcanary/modelcanary.yaml
  subPath: modelcanary.yaml
  readOnly: true
- name: data
  mountPath: /var/lib/modelcanary
- name: tmp
  mountPath: /tmp
{{- if .Values.kafka.tls.enabled }}
- name: kafka-tls
  mountPath: /etc/modelcanary/kafka-tls
  readOnly: true
{{- end }}
{{- end -}}

{{- define "modelcanary.volumes" -}}
- name: config
  configMap:
    name: {{ include "modelcanary.fullname" . }}
- name: data
  emptyDir:
    sizeLimit: {{ .Values.dataVolumeSizeLimit }}
- name: tmp
  emptyDir:
    sizeLimit: 64Mi
{{- if .Values.kafka.tls.enabled }}
- name: kafka-tls
  secret:
    secretName: {{ required "kafka.tls.existingSecret is required when kafka.tls.enabled" .Values.kafka.tls.existingSecret | quote }}
{{- end }}
{{- end -}}

{{/* Pod-level settings shared by every Deployment. Call with (list $ .Values.<component>). */}}
{{- define "modelcanary.podSpecCommon" -}}
{{- $root := index . 0 -}}
{{- $c := index . 1 -}}
serviceAccountName: {{ include "modelcanary.serviceAccountName" $root }}
automountServiceAccountToken: false
enableServiceLinks: false
securityContext:
  {{- toYaml $root.Values.podSecurityContext | nindent 2 }}
{{- with $root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $c.priorityClassName }}
priorityClassName: {{ . | quote }}
{{- end }}
{{- with $c.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $c.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $c.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $c.topologySpreadConstraints }}
topologySpreadConstraints:
  {{- toYaml . | nindent 2 }}
{{- end }}
terminationGracePeriodSeconds: {{ $c.terminationGracePeriodSeconds }}
volumes:
  {{- include "modelcanary.volumes" $root | nindent 2 }}
{{- end -}}

{{/* Probes of one container. Call with the component's values. */}}
{{- define "modelcanary.probes" -}}
{{- with .startupProbe }}
startupProbe:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .readinessProbe }}
readinessProbe:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .livenessProbe }}
livenessProbe:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}
