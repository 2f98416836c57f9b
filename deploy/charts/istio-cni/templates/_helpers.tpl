{{/*
Effective values: chart defaults, then the `profile` file, then the `global.platform` file, then
what the user set. Every template starts with
  {{- $v := include "istio-cni.values" . | fromYaml }}
Merged with our own recursive helper rather than sprig's merge functions, which skip `false`, ""
and 0 on the overriding side (so `--set chained=false` would be lost).
*/}}
{{- define "istio-cni.values" -}}
{{- $defaults := deepCopy (index .Values "_internal_defaults_do_not_set") -}}
{{- $user := deepCopy (omit .Values "_internal_defaults_do_not_set") -}}
{{- $profile := dig "profile" "" $user -}}
{{- if and $profile (ne $profile "default") -}}
{{- $file := .Files.Get (printf "files/profile-%s.yaml" $profile) -}}
{{- if not $file -}}{{- fail (printf "unknown profile %q (supported: default, ambient)" $profile) -}}{{- end -}}
{{- include "istio-cni.merge" (dict "dst" $defaults "src" (fromYaml $file)) -}}
{{- end -}}
{{- $platform := coalesce (dig "global" "platform" "" $user) (dig "platform" "" $user) -}}
{{- if $platform -}}
{{- $file := .Files.Get (printf "files/profile-platform-%s.yaml" $platform) -}}
{{- if not $file -}}{{- fail (printf "unknown global.platform %q (supported: gke, k3d, k3s, microk8s, minikube, openshift)" $platform) -}}{{- end -}}
{{- include "istio-cni.merge" (dict "dst" $defaults "src" (fromYaml $file)) -}}
{{- end -}}
{{- include "istio-cni.merge" (dict "dst" $defaults "src" $user) -}}
{{- $_ := set $defaults "platformName" $platform -}}
{{- toYaml $defaults -}}
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
