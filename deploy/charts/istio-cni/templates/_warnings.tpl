{{/*
What NOTES.txt warns about: values that do not do what they seem to. The chart renders what
Istio's istio-cni chart renders for them (a values file must give the same objects with either
chart), so the surprise is Istio's; the warning says so. One `WARNING:` line each.
*/}}
{{- define "istio-cni.warnings" -}}
{{- $root := . -}}
{{- $s := dict "root" $root -}}
{{- $_ := include "istio-cni.values" $s -}}
{{- $v := $s.v -}}
{{- $user := deepCopy (omit $root.Values "_internal_defaults_do_not_set") -}}
{{- $defaults := index $root.Values "_internal_defaults_do_not_set" -}}
{{- $legacy := $user.cni -}}
{{- if not (kindIs "map" $legacy) -}}{{- $legacy = dict -}}{{- end -}}
{{- $global := $user.global -}}
{{- if not (kindIs "map" $global) -}}{{- $global = dict -}}{{- end -}}
{{- $out := dict "lines" list -}}

{{- /* Values this chart does not have, at the top level and under `cni.`. */ -}}
{{- $top := omit $user "cni" "global" "profile" "platform" "compatibilityVersion" "defaults" -}}
{{- include "istio-cni.unknownKeys" (dict "src" $top "known" $defaults "path" "" "out" $out) -}}
{{- include "istio-cni.unknownKeys" (dict "src" (omit $legacy "global" "profile" "platform" "compatibilityVersion") "known" $defaults "path" "cni." "out" $out) -}}

{{- /* Selectors Istio reads only before the `cni.` copy. */ -}}
{{- $selected := dict "profile" (coalesce $user.profile $global.profile "") "platform" (coalesce $user.platform $global.platform "") "compatibilityVersion" ($user.compatibilityVersion | default "") -}}
{{- $legacyGlobal := $legacy.global -}}
{{- if not (kindIs "map" $legacyGlobal) -}}{{- $legacyGlobal = dict -}}{{- end -}}
{{- range $key, $val := dict "cni.profile" $legacy.profile "cni.platform" $legacy.platform "cni.compatibilityVersion" $legacy.compatibilityVersion "cni.global.profile" $legacyGlobal.profile "cni.global.platform" $legacyGlobal.platform -}}
{{- $name := $key | trimPrefix "cni." | trimPrefix "global." -}}
{{- if and $val (ne (toString $val) (toString (index $selected $name))) -}}
{{- $where := ternary "`compatibilityVersion`" (printf "`%s` or `global.%s`" $name $name) (eq $name "compatibilityVersion") -}}
{{- $note := "" -}}
{{- if eq $name "platform" -}}{{- $note = " (only the OpenShift rule of ClusterRole istio-cni follows it)" -}}{{- end -}}
{{- $_ := set $out "lines" (append $out.lines (printf "`%s: %v` selects nothing: as in Istio's chart, a %s is selected only by %s%s." $key $val $name $where $note)) -}}
{{- end -}}
{{- end -}}

{{- /* A profile's `cni.` value beating the user's own top-level one. */ -}}
{{- $fromProfiles := dict -}}
{{- range $layer := include "istio-cni.layers" $root | fromYamlArray -}}
{{- $file := fromYaml ($root.Files.Get (printf "files/profile-%s.yaml" $layer.file)) -}}
{{- $acc := dict "leaves" list -}}
{{- include "istio-cni.leaves" (dict "m" ($file.cni | default dict) "path" list "out" $acc) -}}
{{- range $leaf := $acc.leaves -}}
{{- $_ := set $fromProfiles (join "." (index $leaf 0)) (dict "path" (index $leaf 0) "value" (index $leaf 1) "from" (printf "%s %s" $layer.kind $layer.name)) -}}
{{- end -}}
{{- end -}}
{{- range $dotted, $p := $fromProfiles -}}
{{- $mine := include "istio-cni.lookup" (dict "m" $user "path" $p.path) | fromJson -}}
{{- $theirs := include "istio-cni.lookup" (dict "m" $legacy "path" $p.path) | fromJson -}}
{{- if and $mine.found (not $theirs.found) (ne (toJson $mine.value) (toJson $p.value)) -}}
{{- $_ := set $out "lines" (append $out.lines (printf "`%s: %s` is overridden by %s (`cni.%s: %s`): in Istio's chart a profile's `cni.` values beat top-level ones. Set `cni.%s` to override it." $dotted (toJson $mine.value) $p.from $dotted (toJson $p.value) $dotted)) -}}
{{- end -}}
{{- end -}}

{{- /* An image nothing can pull: under this chart's local default hub (the name
       scripts/node-images gives images imported into a node's own store) with a pull policy
       that goes to a registry. */ -}}
{{- $image := include "istio-cni.image" (dict "v" $v "root" $root) -}}
{{- $pull := $v.pullPolicy | default $v.global.imagePullPolicy -}}
{{- if and (include "istio-cni.inScope" (dict "v" $v "scope" "namespace")) (hasPrefix "localhost/istio-cni-rs/" $image) (ne $pull "Never") -}}
{{- $_ := set $out "lines" (append $out.lines (printf "image %s is under the local default hub `localhost/istio-cni-rs`, which no registry serves: the agent's pods stay in ImagePullBackOff on any node that does not already have it. Set `global.hub` (and `global.tag`) to where the image was pushed (docs/install.md), or `global.imagePullPolicy: Never` for images imported into every node." $image)) -}}
{{- end -}}

{{- /* Settings that have no effect with the others given. */ -}}
{{- if and (not $v.useAppArmorAnnotation) (semverCompare "<1.30-0" $root.Capabilities.KubeVersion.Version) -}}
{{- $_ := set $out "lines" (append $out.lines (printf "`useAppArmorAnnotation: false` sets securityContext.appArmorProfile, which Kubernetes %s does not know: the agent may run under the runtime's default AppArmor profile, or the API server may reject the DaemonSet. Keep `useAppArmorAnnotation: true` before Kubernetes 1.30." $root.Capabilities.KubeVersion.Version)) -}}
{{- end -}}
{{- if and $v.istioOwnedCNIConfigFileName (not $v.istioOwnedCNIConfig) -}}
{{- $_ := set $out "lines" (append $out.lines "`istioOwnedCNIConfigFileName` is ignored unless `istioOwnedCNIConfig: true` (as in Istio's chart).") -}}
{{- end -}}
{{- range $key, $val := dict "ambient.configDir" (($v.ambient | default dict).configDir) "repair.hub" (($v.repair | default dict).hub) "repair.tag" (($v.repair | default dict).tag) -}}
{{- if $val -}}
{{- $_ := set $out "lines" (append $out.lines (printf "`%s: %v` has no effect (nor in Istio's chart)." $key $val)) -}}
{{- end -}}
{{- end -}}

{{- range $out.lines }}
WARNING: {{ . }}
{{- end -}}
{{- end -}}

{{/*
Unknown keys: `src` (what the user set at `path`) against `known` (the defaults there); appends
to `out.lines`. Inside the maps with a fixed set of keys it looks one level down; free-form maps
(Kubernetes objects, labels, env) are not checked. Top-level sections of Istio's other charts,
which a values file shared by all of them carries, are not reported.
*/}}
{{- define "istio-cni.unknownKeys" -}}
{{- $fixed := list "ambient" "repair" "resourceQuotas" "logging" "monitoring" "podMonitor" "prometheusRule" "dashboard" -}}
{{- $otherCharts := list "base" "defaultRevision" "revisionTags" "sidecarInjectorWebhook" "sidecarInjectorWebhookAnnotations" "istio_cni" "pilot" "meshConfig" "ztunnel" "gateways" "gatewayClasses" "istiodRemote" "telemetry" "experimental" "configMap" "trustedZtunnelNamespace" "trustedZtunnelName" -}}
{{- $hints := dict
  "logLevel" "set `logging.level` (or `global.logging.level`)"
  "rollingMaxUnavailable" "set `updateStrategy.rollingUpdate.maxUnavailable`"
  "enabled" "installing this chart is what enables the agent"
  "privileged" "the container is never privileged; its capabilities are fixed"
  "psp_cluster_role" "PodSecurityPolicy is gone from Kubernetes"
  "resource_quotas" "set `resourceQuotas`"
  "redirectMode" "there is one redirect mode"
  "networkPolicy" "set `global.networkPolicy.enabled`"
  "resourceScope" "set `global.resourceScope`"
-}}
{{- $out := .out -}}
{{- $path := .path -}}
{{- $known := .known | default dict -}}
{{- range $key, $val := .src -}}
{{- if not (or (hasKey $known $key) (and (eq $path "") (has $key $otherCharts))) -}}
{{- $hint := "" -}}
{{- if hasKey $hints $key -}}{{- $hint = printf ": %s" (index $hints $key) -}}{{- end -}}
{{- $_ := set $out "lines" (append $out.lines (printf "`%s%s` is not a value of this chart (nor of Istio's istio-cni chart) and is ignored%s." $path $key $hint)) -}}
{{- else if and (has $key $fixed) (kindIs "map" $val) (kindIs "map" (index $known $key)) -}}
{{- include "istio-cni.unknownKeys" (dict "src" $val "known" (index $known $key) "path" (printf "%s%s." $path $key) "out" $out) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Every leaf of map `m` as [path, value] into `out.leaves` (`path`: the keys above `m`). */}}
{{- define "istio-cni.leaves" -}}
{{- $out := .out -}}
{{- $path := .path -}}
{{- range $key, $val := .m -}}
{{- if and (kindIs "map" $val) $val -}}
{{- include "istio-cni.leaves" (dict "m" $val "path" (append $path $key) "out" $out) -}}
{{- else -}}
{{- $_ := set $out "leaves" (append $out.leaves (list (append $path $key) $val)) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The value at `path` (a list of keys) in map `m`, as JSON {found, value}. */}}
{{- define "istio-cni.lookup" -}}
{{- $cur := .m -}}
{{- $found := true -}}
{{- range $key := .path -}}
{{- if and $found (kindIs "map" $cur) (hasKey $cur $key) -}}
{{- $cur = index $cur $key -}}
{{- else -}}
{{- $found = false -}}
{{- end -}}
{{- end -}}
{{- toJson (dict "found" $found "value" $cur) -}}
{{- end -}}
