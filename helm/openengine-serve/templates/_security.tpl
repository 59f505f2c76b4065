{{/*
TLS, API keys and internal mutual TLS (see docs/kubernetes.md "TLS and API keys").
Every helper takes (dict "root" $ "component" <name>).
*/}}

{{/*
How the internal plane gets its certificates (one per component, docs/security.md): "secrets" (the operator's),
"cert-manager" (Certificates of this chart), or "" (internal TLS off). Takes the root.
*/}}
{{- define "oes.internalTlsMode" -}}
{{- $i := .Values.internalTls }}
{{- $certManager := toString $i.certManager.enabled }}
{{- if or $i.secrets.frontend $i.secrets.coordinator $i.secrets.node }}secrets
{{- else if eq $certManager "true" }}cert-manager
{{- else if and (eq $certManager "auto") (.Capabilities.APIVersions.Has "cert-manager.io/v1") }}cert-manager
{{- end }}
{{- end }}

{{/* The Secret holding the component's internal certificate. */}}
{{- define "oes.internalTlsSecret" -}}
{{- if eq (include "oes.internalTlsMode" .root) "secrets" }}
{{- index .root.Values.internalTls.secrets .component }}
{{- else }}
{{- include "oes.componentName" . }}-internal-tls
{{- end }}
{{- end }}

{{/* "public" when the component's gRPC port serves the public TLS, "internal" for internal mTLS, else "". */}}
{{- define "oes.tlsPort" -}}
{{- if eq .component "frontend" }}
{{- if .root.Values.frontend.tls.secretName }}public{{ end }}
{{- else if include "oes.internalTlsMode" .root }}internal
{{- end }}
{{- end }}

{{/* Client flags of `openengine-serve health|generate` against the component's TLS port (a YAML list). */}}
{{- define "oes.clientTlsArgs" -}}
{{- $tls := include "oes.tlsPort" . }}
{{- if eq $tls "public" }}
{{- $t := .root.Values.frontend.tls }}
- --tls-ca-file
- /etc/openengine/tls/{{ $t.caKey }}
- --tls-server-name
- {{ include "oes.componentName" (dict "root" .root "component" "frontend") }}
{{- if $t.clientCaKey }}
- --tls-cert-file
- /etc/openengine/tls/tls.crt
- --tls-key-file
- /etc/openengine/tls/tls.key
{{- end }}
{{- else if eq $tls "internal" }}
- --tls-ca-file
- /etc/openengine/internal-tls/ca.crt
- --tls-cert-file
- /etc/openengine/internal-tls/tls.crt
- --tls-key-file
- /etc/openengine/internal-tls/tls.key
- --tls-server-name
- {{ .root.Values.internalTls.serverName }}
{{- end }}
{{- end }}

{{/*
A probe handler: the native gRPC probe on a plaintext port; on a TLS port (which kubelet's gRPC probe
cannot speak) the image's CLI over TLS. Takes also "service".
*/}}
{{- define "oes.probeHandler" -}}
{{- $c := index .root.Values .component }}
{{- if include "oes.tlsPort" . }}
exec:
  command:
    - openengine-serve
    - health
    - --target
    - {{ printf "127.0.0.1:%d" (int $c.port) | quote }}
    - --service
    - {{ .service }}
    {{- include "oes.clientTlsArgs" . | trim | nindent 4 }}
{{- else }}
grpc:
  port: {{ $c.port }}
  service: {{ .service }}
{{- end }}
{{- end }}

{{- define "oes.securityEnv" -}}
{{- $v := .root.Values }}
{{- if include "oes.internalTlsMode" .root }}
- name: OPENENGINE_INTERNAL_TLS_CERT_FILE
  value: /etc/openengine/internal-tls/tls.crt
- name: OPENENGINE_INTERNAL_TLS_KEY_FILE
  value: /etc/openengine/internal-tls/tls.key
- name: OPENENGINE_INTERNAL_TLS_CA_FILE
  value: /etc/openengine/internal-tls/ca.crt
- name: OPENENGINE_INTERNAL_TLS_SERVER_NAME
  value: {{ $v.internalTls.serverName | quote }}
{{- end }}
{{- if eq .component "frontend" }}
{{- if $v.frontend.tls.secretName }}
- name: OPENENGINE_TLS_CERT_FILE
  value: /etc/openengine/tls/tls.crt
- name: OPENENGINE_TLS_KEY_FILE
  value: /etc/openengine/tls/tls.key
{{- with $v.frontend.tls.clientCaKey }}
- name: OPENENGINE_TLS_CLIENT_CA_FILE
  value: /etc/openengine/tls/{{ . }}
{{- end }}
{{- end }}
{{- if $v.frontend.apiKeys.secretName }}
- name: OPENENGINE_API_KEYS_FILE
  value: /etc/openengine/api-keys/{{ $v.frontend.apiKeys.secretKey }}
{{- if $v.frontend.apiKeys.allowPlaintext }}
- name: OPENENGINE_ALLOW_PLAINTEXT_KEYS
  value: "1"
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/* Secret mounts (read-only; files readable by the pod's fsGroup). */}}
{{- define "oes.securityMounts" -}}
{{- $v := .root.Values }}
{{- if and (eq .component "frontend") $v.frontend.tls.secretName }}
- name: tls
  mountPath: /etc/openengine/tls
  readOnly: true
{{- end }}
{{- if and (eq .component "frontend") $v.frontend.apiKeys.secretName }}
- name: api-keys
  mountPath: /etc/openengine/api-keys
  readOnly: true
{{- end }}
{{- if and (ne .component "test") (include "oes.internalTlsMode" .root) }}
- name: internal-tls
  mountPath: /etc/openengine/internal-tls
  readOnly: true
{{- end }}
{{- end }}

{{- define "oes.securityVolumes" -}}
{{- $v := .root.Values }}
{{- if and (eq .component "frontend") $v.frontend.tls.secretName }}
- name: tls
  secret:
    secretName: {{ $v.frontend.tls.secretName }}
    defaultMode: 0440
{{- end }}
{{- if and (eq .component "frontend") $v.frontend.apiKeys.secretName }}
- name: api-keys
  secret:
    secretName: {{ $v.frontend.apiKeys.secretName }}
    defaultMode: 0440
{{- end }}
{{- if and (ne .component "test") (include "oes.internalTlsMode" .root) }}
- name: internal-tls
  secret:
    secretName: {{ include "oes.internalTlsSecret" . }}
    defaultMode: 0440
{{- end }}
{{- end }}

{{- define "oes.validateSecurity" -}}
{{- $v := .Values }}
{{- $i := $v.internalTls }}
{{- if $i.secretName }}
{{- fail "internalTls.secretName (one certificate for every component) is replaced by one certificate per component: the coordinator and nodes check each caller's role in its certificate's Common Name (openengine-frontend, openengine-coordinator, openengine-node). Set internalTls.secrets.frontend, .coordinator and .node, or let cert-manager issue them (internalTls.certManager.enabled); see docs/security.md" }}
{{- end }}
{{- if and (or $i.secrets.frontend $i.secrets.coordinator $i.secrets.node) (not (and $i.secrets.frontend $i.secrets.coordinator $i.secrets.node)) }}
{{- fail "internalTls.secrets needs all three of frontend, coordinator and node (one certificate per component)" }}
{{- end }}
{{- if and $i.secrets.frontend (eq (toString $i.certManager.enabled) "true") }}
{{- fail "internalTls.secrets and internalTls.certManager.enabled=true both set: use one (certManager.enabled=false with your own Secrets)" }}
{{- end }}
{{- if and $v.frontend.tls.secretName (eq $v.frontend.grpcServer "pygrpc-native") }}
{{- fail "frontend.tls.secretName is set but frontend.grpcServer=pygrpc-native has no TLS: use grpcServer=grpcio, or terminate TLS in front (an ingress with a gRPC backend or a sidecar; see docs/kubernetes.md)" }}
{{- end }}
{{- if and $v.frontend.tls.certManager.issuerRef.name (not $v.frontend.tls.secretName) }}
{{- fail "frontend.tls.certManager.issuerRef needs frontend.tls.secretName (the Secret cert-manager writes)" }}
{{- end }}
{{- if and $v.frontend.tls.clientCaKey (not $v.frontend.tls.secretName) }}
{{- fail "frontend.tls.clientCaKey needs frontend.tls.secretName" }}
{{- end }}
{{- if and $v.frontend.apiKeys.secretName (not $v.frontend.tls.secretName) (not $v.frontend.apiKeys.allowPlaintext) }}
{{- fail "frontend.apiKeys.secretName without frontend.tls.secretName sends keys in plaintext: set frontend.tls, or frontend.apiKeys.allowPlaintext=true when TLS ends in front of the frontend (an ingress or a sidecar)" }}
{{- end }}
{{- if and $v.frontend.apiKeys.secretName $v.tests.enabled (not $v.tests.apiKeySecret.name) }}
{{- fail "frontend.apiKeys.secretName is set: helm test needs a key, set tests.apiKeySecret.name (or tests.enabled=false)" }}
{{- end }}
{{- end }}
