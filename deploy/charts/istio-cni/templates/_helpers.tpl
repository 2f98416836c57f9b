{{/*
Effective values. Every template starts with
  {{- $s := dict "root" . }}{{- $_ := include "istio-cni.values" $s }}{{- $v := $s.v }}
(the result is handed back in the dict, not as text, so numbers keep their type).

The layers, as Istio's istio-cni chart has them (later wins; the same merge, sprig's
mustMergeOverwrite: maps merge key by key, anything else replaces, and an explicit null replaces
too, so `tolerations: null` clears the default):
  1. the defaults (`_internal_defaults_do_not_set` in values.yaml);
  2. the profile files: `profile` (or `global.profile`), then `compatibilityVersion`, then
     `platform` (or `global.platform`), each files/profile-*.yaml;
  3. what the user set;
  4. the `cni` section of the result (Istio's legacy prefix): `cni.<value>` is copied over
     `<value>`. A profile file's values under `cni:` land there too, so they beat the user's own
     top-level value (NOTES.txt warns when that happens), and `cni.profile` / `cni.platform` /
     `cni.compatibilityVersion` select nothing (they are read at step 2, before the copy).
*/}}
{{- define "istio-cni.values" -}}
{{- $root := .root -}}
{{- $defaults := deepCopy (index $root.Values "_internal_defaults_do_not_set") -}}
{{- $user := deepCopy (omit $root.Values "_internal_defaults_do_not_set") -}}
{{- if $user.defaults -}}
{{- fail "values under `defaults` are not read: set them without the prefix (`--set hub=foo`, not `--set defaults.hub=foo`)" -}}
{{- end -}}
{{- $profile := dict -}}
{{- range $layer := include "istio-cni.layers" $root | fromYamlArray -}}
{{- $file := $root.Files.Get (printf "files/profile-%s.yaml" $layer.file) -}}
{{- if not $file -}}
{{- fail (printf "unknown %s %q (supported: %s)" $layer.kind $layer.name $layer.supported) -}}
{{- end -}}
{{- $_ := mustMergeOverwrite $profile (fromYaml $file) -}}
{{- end -}}
{{- if $profile -}}
{{- $_ := mustMergeOverwrite $defaults $profile -}}
{{- end -}}
{{- $values := mustMergeOverwrite $defaults $user -}}
{{- $legacy := index $values "cni" -}}
{{- if not (kindIs "invalid" $legacy) -}}
{{- if not (kindIs "map" $legacy) -}}
{{- fail (printf "value `cni` must be a map of this chart's values (the legacy prefix, e.g. cni.chained), not %v" $legacy) -}}
{{- end -}}
{{- $_ := mustMergeOverwrite $values $legacy -}}
{{- end -}}
{{- $_ := set . "v" $values -}}
{{- end -}}

{{/*
The profile files the user's values select, in merge order, as a YAML list of
{kind, name, file, supported}. `profile: default` is the same as no profile. A
`compatibilityVersion` written as a YAML number (1.30 arrives as 1.3) is read as the version.
*/}}
{{- define "istio-cni.layers" -}}
{{- $user := omit .Values "_internal_defaults_do_not_set" -}}
{{- $global := $user.global -}}
{{- if not (kindIs "map" $global) -}}{{- $global = dict -}}{{- end -}}
{{- $layers := list -}}
{{- $profile := coalesce $user.profile $global.profile -}}
{{- if and $profile (ne (toString $profile) "default") -}}
{{- $layers = append $layers (dict "kind" "profile" "name" (toString $profile) "file" (toString $profile) "supported" "default, ambient, demo, preview, remote, stable") -}}
{{- end -}}
{{- $compat := $user.compatibilityVersion -}}
{{- if kindIs "float64" $compat -}}{{- $compat = printf "%.2f" $compat -}}{{- end -}}
{{- if $compat -}}
{{- $layers = append $layers (dict "kind" "compatibilityVersion" "name" (toString $compat) "file" (printf "compatibility-version-%v" $compat) "supported" "1.25, 1.26, 1.27, 1.28, 1.29, 1.30") -}}
{{- end -}}
{{- $platform := coalesce $user.platform $global.platform -}}
{{- if $platform -}}
{{- $layers = append $layers (dict "kind" "global.platform" "name" (toString $platform) "file" (printf "platform-%v" $platform) "supported" "gke, k3d, k3s, microk8s, minikube, openshift") -}}
{{- end -}}
{{- toYaml $layers -}}
{{- end -}}

{{- define "istio-cni.name" -}}istio-cni{{- end -}}

{{/* Labels naming the chart and release (on every object). */}}
{{- define "istio-cni.chartLabels" -}}
app.kubernetes.io/name: istio-cni
app.kubernetes.io/part-of: istio
app.kubernetes.io/instance: {{ .Release.Name | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service | quote }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end -}}

{{/* Labels naming the Istio revision, installer and release (takes `v` and `root`). */}}
{{- define "istio-cni.ownerLabels" -}}
istio.io/rev: {{ .v.revision | default "default" | quote }}
install.operator.istio.io/owning-resource: {{ .v.ownerName | default "unknown" | quote }}
operator.istio.io/component: Cni
release: {{ .root.Release.Name | quote }}
{{- end -}}

{{/*
The image, as Istio's chart names it: `image` verbatim when it contains a `/`, else
<hub>/<image>:<tag>[-<variant>], the variant being `variant`, else `global.variant` (Istio's
ambient profile sets `distroless`; a release is published under that tag too). The tag is
`tag`, `global.tag`, else the chart's appVersion.
*/}}
{{- define "istio-cni.image" -}}
{{- if contains "/" .v.image -}}
{{ .v.image }}
{{- else -}}
{{ .v.hub | default .v.global.hub }}/{{ .v.image | default "install-cni" }}:{{ include "istio-cni.tag" . }}{{ with (.v.variant | default .v.global.variant) }}-{{ . }}{{ end }}
{{- end -}}
{{- end -}}

{{/* The release the agent reports (CURRENT_AGENT_VERSION): the tag without the variant, as in Istio's chart. */}}
{{- define "istio-cni.tag" -}}
{{ .v.tag | default .v.global.tag | default .root.Chart.AppVersion }}
{{- end -}}

{{/* Objects rendered for global.resourceScope `all`, or `cluster` / `namespace` (takes `v` and `scope`). */}}
{{- define "istio-cni.inScope" -}}
{{- $scope := .v.global.resourceScope -}}
{{- if or (eq $scope "all") (eq $scope .scope) -}}true{{- end -}}
{{- end -}}

{{/*
Container resources: `limits` and `requests` without their empty entries (a `cpu: null` set to
drop a default), each left out when nothing remains. Amounts are written as given, unquoted, as
Istio's chart writes them (`cpu: "1"` renders as the number 1; Kubernetes reads both the same).
*/}}
{{- define "istio-cni.resources" -}}
{{- range $kind := list "limits" "requests" -}}
{{- $amounts := index $ $kind -}}
{{- $set := list -}}
{{- range $name, $amount := $amounts -}}
{{- if $amount -}}{{- $set = append $set (printf "%s: %v" $name $amount) -}}{{- end -}}
{{- end -}}
{{- if $set }}
{{ $kind }}:
{{- range $set }}
  {{ . }}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
