{{/*
Effective values, in layers (later wins): chart defaults, the `profile` (or `global.profile`)
file, the `compatibilityVersion` file, the `platform` (or `global.platform`) file, then what the
user set. Every template starts with
  {{- $v := include "istio-cni.values" . | fromYaml }}
Istio's legacy `cni.` prefix (`cni.chained=false`, the `values.cni` section of an IstioOperator)
is folded into the user's layer, winning over the same value set without the prefix, as in
Istio's chart. Unlike Istio's chart, a profile's value never beats one the user set.
Merged with our own recursive helper rather than sprig's merge functions, which skip `false`, ""
and 0 on the overriding side (so `--set chained=false` would be lost).
*/}}
{{- define "istio-cni.values" -}}
{{- $defaults := deepCopy (index .Values "_internal_defaults_do_not_set") -}}
{{- $raw := deepCopy (omit .Values "_internal_defaults_do_not_set") -}}
{{- if hasKey $raw "defaults" -}}
{{- fail "values under `defaults` are not read: set them without the prefix (`--set hub=foo`, not `--set defaults.hub=foo`)" -}}
{{- end -}}
{{- include "istio-cni.checkKeys" (dict "src" $raw "known" $defaults "path" "" "extra" (list "cni" "compatibilityVersion")) -}}
{{- $legacy := index $raw "cni" | default dict -}}
{{- if not (kindIs "map" $legacy) -}}{{- fail (printf "value `cni` must be a map of this chart's values (the legacy prefix, e.g. cni.chained), not %v" $legacy) -}}{{- end -}}
{{- include "istio-cni.checkKeys" (dict "src" $legacy "known" $defaults "path" "cni." "extra" (list "compatibilityVersion")) -}}
{{- $user := omit $raw "cni" -}}
{{- include "istio-cni.merge" (dict "dst" $user "src" $legacy) -}}
{{- $profile := coalesce (dig "profile" "" $user) (dig "global" "profile" "" $user) -}}
{{- if and $profile (ne $profile "default") -}}
{{- $file := .Files.Get (printf "files/profile-%s.yaml" $profile) -}}
{{- if not $file -}}{{- fail (printf "unknown profile %q (supported: default, ambient, demo, preview, remote, stable)" $profile) -}}{{- end -}}
{{- include "istio-cni.merge" (dict "dst" $defaults "src" (fromYaml $file)) -}}
{{- end -}}
{{- $compat := dig "compatibilityVersion" "" $user -}}
{{- if kindIs "float64" $compat -}}
{{- /* A YAML `compatibilityVersion: 1.30` arrives as the number 1.3. */ -}}
{{- $compat = printf "%.2f" $compat -}}
{{- end -}}
{{- if $compat -}}
{{- $file := .Files.Get (printf "files/profile-compatibility-version-%v.yaml" $compat) -}}
{{- if not $file -}}{{- fail (printf "unknown compatibilityVersion %q (supported: 1.25, 1.26, 1.27, 1.28, 1.29, 1.30)" (toString $compat)) -}}{{- end -}}
{{- include "istio-cni.merge" (dict "dst" $defaults "src" (fromYaml $file)) -}}
{{- end -}}
{{- $platform := coalesce (dig "platform" "" $user) (dig "global" "platform" "" $user) -}}
{{- if $platform -}}
{{- $file := .Files.Get (printf "files/profile-platform-%s.yaml" $platform) -}}
{{- if not $file -}}{{- fail (printf "unknown global.platform %q (supported: gke, k3d, k3s, microk8s, minikube, openshift)" $platform) -}}{{- end -}}
{{- include "istio-cni.merge" (dict "dst" $defaults "src" (fromYaml $file)) -}}
{{- end -}}
{{- include "istio-cni.merge" (dict "dst" $defaults "src" $user) -}}
{{- $_ := set $defaults "platformName" $platform -}}
{{- $_ := set $defaults "profileName" $profile -}}
{{- toYaml $defaults -}}
{{- end -}}

{{/*
Fails on a value this chart does not have (a typo would otherwise be dropped silently): `src` is
what the user set at `path`, `known` the defaults there. Only maps with a fixed set of keys are
checked inside; free-form ones (`global`, `env`, `affinity`, labels, Kubernetes objects) are not.
The top-level keys of Istio's other charts, which Istio's shared profile files
(manifests/helm-profiles) carry, are accepted and ignored so those files can be passed with -f.
*/}}
{{- define "istio-cni.checkKeys" -}}
{{- $fixed := list "ambient" "repair" "resourceQuotas" "logging" "networkPolicy" -}}
{{- $foreign := list "meshConfig" "pilot" "ztunnel" "gateways" "istiodRemote" "configMap" "telemetry" "experimental" "trustedZtunnelNamespace" -}}
{{- $known := .known -}}
{{- $path := .path -}}
{{- $top := not $path -}}
{{- range $key, $val := .src -}}
{{- $isExtra := or (has $key $.extra) (and $top (has $key $foreign)) -}}
{{- if not (or (hasKey $known $key) $isExtra) -}}
{{- fail (printf "unknown value %s%s: not a value of this chart (deploy/charts/istio-cni/README.md lists them)" $path $key) -}}
{{- end -}}
{{- if and (has $key $fixed) (kindIs "map" $val) (kindIs "map" (index $known $key)) -}}
{{- include "istio-cni.checkKeys" (dict "src" $val "known" (index $known $key) "path" (printf "%s%s." $path $key) "extra" list) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Deep merge of map `src` into map `dst` (in place): maps merge, everything else replaces. */}}
{{- define "istio-cni.merge" -}}
{{- $dst := .dst -}}
{{- range $key, $val := .src -}}
{{- $cur := index $dst $key -}}
{{- if and (kindIs "map" $val) (kindIs "map" $cur) -}}
{{- include "istio-cni.merge" (dict "dst" $cur "src" $val) -}}
{{- else if not (kindIs "invalid" $val) -}}
{{- $_ := set $dst $key $val -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "istio-cni.name" -}}istio-cni{{- end -}}

{{/* Labels on every object (takes the effective values as `.v` and the root as `.root`). */}}
{{- define "istio-cni.labels" -}}
app.kubernetes.io/name: istio-cni
app.kubernetes.io/part-of: istio
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version }}
istio.io/rev: {{ .v.revision | default "default" | quote }}
install.operator.istio.io/owning-resource: {{ .v.ownerName | default "unknown" }}
operator.istio.io/component: Cni
release: {{ .root.Release.Name }}
{{- end -}}

{{- define "istio-cni.image" -}}
{{- if contains "/" .v.image -}}
{{ .v.image }}
{{- else -}}
{{- $hub := .v.hub | default .v.global.hub -}}
{{- $tag := .v.tag | default .v.global.tag | default .root.Chart.AppVersion -}}
{{- $variant := .v.variant | default .v.global.variant -}}
{{- if $hub }}{{ $hub }}/{{ end }}{{ .v.image | default "install-cni" }}:{{ $tag }}{{ if $variant }}-{{ $variant }}{{ end }}
{{- end -}}
{{- end -}}

{{/* Objects rendered for global.resourceScope: "cluster" or "namespace" (or "all"). */}}
{{- define "istio-cni.inScope" -}}
{{- $scope := lower (.v.global.resourceScope | default "all") -}}
{{- if or (eq $scope "all") (eq $scope .scope) -}}true{{- end -}}
{{- end -}}
