{{/*
Chart name, truncated so that "<name>-<component>-metrics" stays a DNS label.
*/}}
{{- define "oes.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 42 | trimSuffix "-" }}
{{- end }}

{{/*
Fully qualified release name; component objects append "-<component>" (at
most 21 more characters), so it is truncated to 42.
*/}}
{{- define "oes.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 42 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 42 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 42 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "oes.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Selector labels of the release (all components).
*/}}
{{- define "oes.releaseSelectorLabels" -}}
app.kubernetes.io/name: {{ include "oes.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/*
Common labels. Usage: include "oes.labels" .
*/}}
{{- define "oes.labels" -}}
helm.sh/chart: {{ include "oes.chart" . }}
{{ include "oes.releaseSelectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: openengine-serve
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
A component's objects and pods. Helpers take (dict "root" $ "component" <name>); a node group other
than the first adds "group" (its name) and "values" (the node settings with the group's on top,
from oes.nodeGroups). The group's pods get the component label "node-<group>" so that no two
Deployments, autoscalers or disruption budgets select the same pods.
*/}}
{{- define "oes.componentId" -}}
{{ .component }}{{ with .group }}-{{ . }}{{ end }}
{{- end }}

{{/*
Component selector labels. Usage: include "oes.selectorLabels" (dict "root" $ "component" "frontend")
*/}}
{{- define "oes.selectorLabels" -}}
{{ include "oes.releaseSelectorLabels" .root }}
app.kubernetes.io/component: {{ include "oes.componentId" . }}
{{- end }}

{{/*
Component labels (common + component). Same arguments as oes.selectorLabels.
*/}}
{{- define "oes.componentLabels" -}}
{{ include "oes.labels" .root }}
app.kubernetes.io/component: {{ include "oes.componentId" . }}
{{- end }}

{{/*
Object name of a component. Usage: include "oes.componentName" (dict "root" $ "component" "node")
*/}}
{{- define "oes.componentName" -}}
{{- printf "%s-%s" (include "oes.fullname" .root) (include "oes.componentId" .) }}
{{- end }}

{{/*
The node groups, as helper arguments: the first is `node` itself, then one per `node.groups` entry
with the entry's settings over `node`'s (maps merge key by key, other values and model.volume are
replaced). Sets .out.groups. Usage:
  {{- $nodes := dict }}{{- include "oes.nodeGroups" (dict "root" $ "out" $nodes) }}
  {{- range $nodes.groups }} ... include "oes.deployment" . ... {{- end }}
*/}}
{{- define "oes.nodeGroups" -}}
{{- $root := .root }}
{{- $base := omit $root.Values.node "groups" }}
{{- $groups := list (dict "root" $root "component" "node" "values" $base) }}
{{- range $root.Values.node.groups }}
{{- $values := deepCopy $base }}
{{- include "oes.overlay" (dict "dst" $values "src" (omit . "name")) }}
{{- if hasKey (default dict .model) "volume" }}
{{- $_ := set $values.model "volume" .model.volume }}
{{- end }}
{{- $groups = append $groups (dict "root" $root "component" "node" "group" .name "values" $values) }}
{{- end }}
{{- $_ := set .out "groups" $groups }}
{{- end }}

{{/* The component labels of the node groups' pods, comma-separated: node, node-<group>, ... */}}
{{- define "oes.nodeComponentIds" -}}
{{- $nodes := dict }}
{{- include "oes.nodeGroups" (dict "root" . "out" $nodes) }}
{{- $ids := list }}
{{- range $nodes.groups }}
{{- $ids = append $ids (include "oes.componentId" .) }}
{{- end }}
{{- join ", " $ids }}
{{- end }}

{{/* Where a group's settings are written in values.yaml: node, or node.groups[<name>]. */}}
{{- define "oes.groupPath" -}}
{{ .component }}{{ with .group }}.groups[{{ . }}]{{ end }}
{{- end }}

{{/*
A label selector (matchLabels, matchExpressions) of a component's pods in every node group.
Usage: include "oes.podsOf" (dict "root" $ "component" "node")
*/}}
{{- define "oes.podsOf" -}}
{{- if eq .component "node" -}}
matchLabels:
  {{- include "oes.releaseSelectorLabels" .root | nindent 2 }}
matchExpressions:
  - key: app.kubernetes.io/component
    operator: In
    values: [{{ include "oes.nodeComponentIds" .root }}]
{{- else -}}
matchLabels:
  {{- include "oes.selectorLabels" . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Sets every key of .src in .dst, merging maps into maps key by key. */}}
{{- define "oes.overlay" -}}
{{- range $key, $value := .src }}
{{- if and (kindIs "map" $value) (kindIs "map" (index $.dst $key)) }}
{{- include "oes.overlay" (dict "dst" (index $.dst $key) "src" $value) }}
{{- else }}
{{- $_ := set $.dst $key $value }}
{{- end }}
{{- end }}
{{- end }}

{{- define "oes.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "oes.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
Image reference of a component; the tag defaults to the chart's appVersion.
Usage: include "oes.image" (dict "root" $ "component" "frontend")
*/}}
{{- define "oes.image" -}}
{{- $image := (.values | default (index .root.Values .component)).image }}
{{- printf "%s:%s" $image.repository (default .root.Chart.AppVersion $image.tag) }}
{{- end }}

{{/*
host:port of the coordinator Service, the address frontends and nodes dial.
*/}}
{{- define "oes.coordinatorAddress" -}}
{{- printf "%s.%s.svc:%d" (include "oes.componentName" (dict "root" . "component" "coordinator")) .Release.Namespace (int .Values.coordinator.port) }}
{{- end }}

{{/*
terminationGracePeriodSeconds = preStop sleep + drain timeout + margin, so the
drain can use its whole budget before the kubelet sends SIGKILL.
Usage: include "oes.terminationGracePeriodSeconds" (dict "root" $ "component" "node")
*/}}
{{- define "oes.terminationGracePeriodSeconds" -}}
{{- $lc := .root.Values.lifecycle }}
{{- $c := .values | default (index .root.Values .component) }}
{{- add (int $lc.preStopSleepSeconds) (int $c.drainTimeoutSeconds) (int $lc.terminationMarginSeconds) }}
{{- end }}

{{/*
True (non-empty) when no Prometheus Operator monitor is rendered and the
prometheus.io/* annotations are wanted.
*/}}
{{- define "oes.prometheusAnnotations" -}}
{{- $m := .Values.metrics }}
{{- if and $m.prometheusAnnotations (not $m.serviceMonitor.enabled) (not $m.podMonitor.enabled) }}true{{ end }}
{{- end }}

{{/*
Chart-level consistency checks the JSON schema cannot express readably.
*/}}
{{- define "oes.validate" -}}
{{- if and .Values.metrics.serviceMonitor.enabled .Values.metrics.podMonitor.enabled }}
{{- fail "metrics.serviceMonitor.enabled and metrics.podMonitor.enabled are both true: enable at most one (each would scrape every pod)" }}
{{- end }}
{{- if and .Values.frontend.service.headless (ne .Values.frontend.service.type "ClusterIP") }}
{{- fail (printf "frontend.service.headless needs frontend.service.type ClusterIP, not %s (a headless Service has no cluster IP to expose)" .Values.frontend.service.type) }}
{{- end }}
{{- $groupNames := list }}
{{- range .Values.node.groups }}
{{- if has .name $groupNames }}
{{- fail (printf "node.groups has two groups named %s: each group is a Deployment of its own and needs its own name" .name) }}
{{- end }}
{{- $groupNames = append $groupNames .name }}
{{- end }}
{{- $nodes := dict }}
{{- include "oes.nodeGroups" (dict "root" . "out" $nodes) }}
{{- range $args := prepend $nodes.groups (dict "root" $ "component" "frontend") }}
{{- $at := include "oes.groupPath" $args }}
{{- $c := $args.values | default (index $.Values $args.component) }}
{{- $hpa := $c.autoscaling }}
{{- if and $hpa.enabled (gt (int $hpa.minReplicas) (int $hpa.maxReplicas)) }}
{{- fail (printf "%s.autoscaling.minReplicas (%d) is greater than %s.autoscaling.maxReplicas (%d)" $at (int $hpa.minReplicas) $at (int $hpa.maxReplicas)) }}
{{- end }}
{{- $model := $c.model }}
{{- if and (eq $args.component "node") $model.volume }}
{{- if not $model.path }}
{{- fail (printf "%s.model.volume is set but %s.model.path is empty: set %s.model.path to the GGUF file in the volume, e.g. %s/<file>.gguf (an empty path serves the embedded default model)" $at $at $at (trimSuffix "/" $model.mountPath)) }}
{{- end }}
{{- if not (hasPrefix (printf "%s/" (trimSuffix "/" $model.mountPath)) $model.path) }}
{{- fail (printf "%s.model.path %s is not in %s.model.mountPath %s, where %s.model.volume is mounted" $at $model.path $at $model.mountPath $at) }}
{{- end }}
{{- end }}
{{- end }}
{{- include "oes.validateSecurity" . }}
{{- end }}

{{/*
The Deployment of one component. Usage:
  include "oes.deployment" (dict "root" $ "component" "frontend" "env" (include "oes.frontendEnv" $))
"env" is a YAML list of component-specific environment variables; the optional
"volumes" and "volumeMounts" are YAML lists of component-specific volumes and
their mounts in the container.
*/}}
{{- define "oes.deployment" -}}
{{- $root := .root }}
{{- $component := .component }}
{{- $c := .values | default (index $root.Values $component) }}
{{- $args := . }}
{{- $loadScaled := and (hasKey $root.Values.autoscaling $component) (index $root.Values.autoscaling $component).enabled }}
{{- $autoscaled := or (and (hasKey $c "autoscaling") $c.autoscaling.enabled) $loadScaled }}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "oes.componentName" $args }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "oes.componentLabels" $args | nindent 4 }}
spec:
  {{- if eq $component "coordinator" }}
  replicas: 1
  {{- else if not $autoscaled }}
  replicas: {{ $c.replicas }}
  {{- end }}
  revisionHistoryLimit: 10
  strategy:
    type: RollingUpdate
    rollingUpdate:
      maxSurge: {{ $c.updateStrategy.maxSurge }}
      maxUnavailable: 0
  selector:
    matchLabels:
      {{- include "oes.selectorLabels" $args | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "oes.componentLabels" $args | nindent 8 }}
        {{- with $c.podLabels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- $prom := include "oes.prometheusAnnotations" $root }}
      {{- if or $prom $c.podAnnotations }}
      annotations:
        {{- if $prom }}
        prometheus.io/scrape: "true"
        prometheus.io/port: {{ $c.metricsPort | int | quote }}
        prometheus.io/path: /metrics
        {{- end }}
        {{- with $c.podAnnotations }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- end }}
    spec:
      serviceAccountName: {{ include "oes.serviceAccountName" $root }}
      automountServiceAccountToken: false
      # Service links would inject <SERVICE>_PORT=tcp://... variables, which can
      # collide with OPENENGINE_* configuration for a release named "openengine".
      enableServiceLinks: false
      terminationGracePeriodSeconds: {{ include "oes.terminationGracePeriodSeconds" $args }}
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $c.priorityClassName }}
      priorityClassName: {{ . }}
      {{- end }}
      securityContext:
        {{- toYaml $root.Values.podSecurityContext | nindent 8 }}
      containers:
        - name: {{ $component }}
          image: {{ include "oes.image" $args | quote }}
          imagePullPolicy: {{ $c.image.pullPolicy }}
          securityContext:
            {{- toYaml $root.Values.containerSecurityContext | nindent 12 }}
          ports:
            - name: grpc
              containerPort: {{ $c.port }}
              protocol: TCP
            {{- if and (eq $component "frontend") $c.httpPort }}
            - name: http
              containerPort: {{ $c.httpPort }}
              protocol: TCP
            {{- end }}
            - name: metrics
              containerPort: {{ $c.metricsPort }}
              protocol: TCP
          env:
            - name: HOME
              value: /tmp
            - name: OPENENGINE_HOST
              value: 0.0.0.0
            - name: OPENENGINE_PORT
              value: {{ $c.port | int | quote }}
            - name: OPENENGINE_METRICS_PORT
              value: {{ $c.metricsPort | int | quote }}
            - name: OPENENGINE_LOG_LEVEL
              value: {{ $c.logLevel | quote }}
            - name: OPENENGINE_DRAIN_TIMEOUT_S
              value: {{ $c.drainTimeoutSeconds | int | quote }}
            {{- with .env | trim }}
            {{- . | nindent 12 }}
            {{- end }}
            {{- with include "oes.securityEnv" $args | trim }}
            {{- . | nindent 12 }}
            {{- end }}
            {{- with $c.extraEnv }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          startupProbe:
            {{- include "oes.probeHandler" (dict "root" $root "component" $component "service" "liveness") | trim | nindent 12 }}
            periodSeconds: {{ $root.Values.probes.startup.periodSeconds }}
            timeoutSeconds: {{ $root.Values.probes.startup.timeoutSeconds }}
            failureThreshold: {{ divf $c.startupTimeoutSeconds $root.Values.probes.startup.periodSeconds | ceil | int }}
          livenessProbe:
            {{- include "oes.probeHandler" (dict "root" $root "component" $component "service" "liveness") | trim | nindent 12 }}
            periodSeconds: {{ $root.Values.probes.liveness.periodSeconds }}
            timeoutSeconds: {{ $root.Values.probes.liveness.timeoutSeconds }}
            failureThreshold: {{ $root.Values.probes.liveness.failureThreshold }}
          readinessProbe:
            {{- include "oes.probeHandler" (dict "root" $root "component" $component "service" "readiness") | trim | nindent 12 }}
            periodSeconds: {{ $root.Values.probes.readiness.periodSeconds }}
            timeoutSeconds: {{ $root.Values.probes.readiness.timeoutSeconds }}
            failureThreshold: {{ $root.Values.probes.readiness.failureThreshold }}
          lifecycle:
            preStop:
              # Keep serving while the endpoint removal propagates; SIGTERM
              # (readiness NOT_SERVING, then the drain) follows the sleep.
              sleep:
                seconds: {{ $root.Values.lifecycle.preStopSleepSeconds }}
          {{- with $c.resources }}
          resources:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          volumeMounts:
            - name: tmp
              mountPath: /tmp
            {{- with include "oes.securityMounts" $args | trim }}
            {{- . | nindent 12 }}
            {{- end }}
            {{- with .volumeMounts | default "" | trim }}
            {{- . | nindent 12 }}
            {{- end }}
      volumes:
        - name: tmp
          emptyDir:
            {{- with $c.tmpSizeLimit }}
            sizeLimit: {{ . }}
            {{- end }}
        {{- with include "oes.securityVolumes" $args | trim }}
        {{- . | nindent 8 }}
        {{- end }}
        {{- with .volumes | default "" | trim }}
        {{- . | nindent 8 }}
        {{- end }}
      {{- with $c.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $c.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $c.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $c.topologySpreadConstraints }}
      topologySpreadConstraints:
        {{- toYaml . | nindent 8 }}
      {{- end }}
{{- end }}

{{/*
PodDisruptionBudget of a component. Usage: include "oes.pdb" (dict "root" $ "component" "frontend")
*/}}
{{- define "oes.pdb" -}}
{{- $c := .values | default (index .root.Values .component) }}
{{- if $c.podDisruptionBudget.enabled }}
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "oes.componentName" . }}
  namespace: {{ .root.Release.Namespace }}
  labels:
    {{- include "oes.componentLabels" . | nindent 4 }}
spec:
  maxUnavailable: {{ $c.podDisruptionBudget.maxUnavailable }}
  selector:
    matchLabels:
      {{- include "oes.selectorLabels" . | nindent 6 }}
{{- end }}
{{- end }}

{{/*
HorizontalPodAutoscaler of a component. Usage: include "oes.hpa" (dict "root" $ "component" "node")
*/}}
{{- define "oes.hpa" -}}
{{- $hpa := (.values | default (index .root.Values .component)).autoscaling }}
{{- if $hpa.enabled }}
apiVersion: autoscaling/v2
kind: HorizontalPodAutoscaler
metadata:
  name: {{ include "oes.componentName" . }}
  namespace: {{ .root.Release.Namespace }}
  labels:
    {{- include "oes.componentLabels" . | nindent 4 }}
spec:
  scaleTargetRef:
    apiVersion: apps/v1
    kind: Deployment
    name: {{ include "oes.componentName" . }}
  minReplicas: {{ $hpa.minReplicas }}
  maxReplicas: {{ $hpa.maxReplicas }}
  metrics:
    {{- if $hpa.metrics }}
    {{- toYaml $hpa.metrics | nindent 4 }}
    {{- else }}
    - type: Resource
      resource:
        name: cpu
        target:
          type: Utilization
          averageUtilization: {{ $hpa.targetCPUUtilizationPercentage }}
    {{- end }}
  {{- with $hpa.behavior }}
  behavior:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}
{{- end }}
